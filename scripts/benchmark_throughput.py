#!/usr/bin/env python3
"""QAT training throughput and where a step's time goes, in one process or several (torchrun), on the real data
path of `qat.py quantize` (upstream's augmenting loader, this rank's share of each global batch) and its real
step (models/finetuning/finetune.py FineTuner), for QAT and its float control.

    python scripts/benchmark_throughput.py --cfg models/detect/gelan-c.yaml --data D.yaml --batch-size 32
    torchrun --standalone --nproc_per_node 2 scripts/benchmark_throughput.py ... --device 0,1

Run from the patched YOLOv9 checkout. Weights are random (throughput does not depend on what a model learned);
calibration uses max on a few batches. For each arm: `--warmup` untimed steps (more where the loader's workers
load more batches ahead: those are ready after the first step's compile), then `--steps` timed steps
(images/s over them, the device synchronized at both ends only), then `--breakdown-steps` steps with the device
synchronized at every phase boundary (models/finetuning/finetune.py StepClock: the seconds per phase, which add up to
more than a free-running step), and on a GPU the peak memory allocated over those two. Rank 0 writes
OUT/<model>.json (results/scaling/ by default), keeping the entries of other world sizes and batches; `speedup` is
this run's throughput over the 1-process run's of the same model, image size and global batch, where that one is
recorded.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

import torch  # noqa: E402

from models.finetuning.fast_step import STEP_MODES  # noqa: E402
from utils.io_utils import write_json  # noqa: E402
from utils.provenance import command_line, machine, overlay_repo, toolkit_commit  # noqa: E402


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="models/detect/gelan-c.yaml")
    p.add_argument("--data", required=True, help="dataset.yaml (its training images feed the loader)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--workers", type=int, default=None,
                   help="dataloader workers per process (default: as qat.py's, its share of the cores less one)")
    p.add_argument("--cache", nargs="?", const="ram", default=None, choices=("ram", "disk"),
                   help="decoded training images kept in RAM (or on disk), as qat.py quantize --cache (default: "
                        "decoded at every draw)")
    p.add_argument("--step", choices=STEP_MODES, default="auto", help="as qat.py quantize --step")
    p.add_argument("--loader-batches", type=int, default=40,
                   help="batches of the loader alone timed first, at least (0: none)")
    p.add_argument("--device", default="0")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--breakdown-steps", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="then this many free-running steps under torch.profiler (rank 0's summary: JSON and log)")
    p.add_argument("--hyp", default="data/hyps/hyp.scratch-high.yaml")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="cuDNN times its algorithms for each new shape and keeps the fastest (qat.py does not: "
                        "no faster for gelan-c on an H200, results/scaling/h200x2/2026-11-30-b/)")
    p.add_argument("--out", type=Path, default=overlay_repo() / "results" / "scaling")
    opt = p.parse_args(argv)
    from models.core.distributed import loader_workers, world_from_env
    opt.workers = loader_workers(opt.workers, world_from_env())
    return opt


def warmup_steps(asked: int, loader) -> int:
    """`asked`, or more: one past the batches the loader's workers load before they are asked for (`prefetch_factor`
    each). All of those are ready after the first step's compile, and steps served from them never wait for it."""
    return max(asked, loader.num_workers * (loader.prefetch_factor or 0) + 1)


def loader_images_per_s(loader, device, n: int, batch: int) -> tuple[float, int]:
    """The loader alone: images/s and the batches timed, at least `n`, from when each worker has delivered its first
    batch (their start behind) over whole rounds of the workers: the workers' batches of a round arrive together,
    and a clock started inside a round would count batches loaded before it."""
    from utils.batches import seeded_batches
    workers = max(loader.num_workers, 1)
    skip, timed = max(5, workers), workers * max(2, math.ceil(n / workers))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = None
    for i, _ in enumerate(seeded_batches(loader, device, skip + timed, 0)):
        if i == skip - 1:
            sync()
            t0 = time.perf_counter()
    sync()
    return round(timed * batch / (time.perf_counter() - t0), 1), timed


def arm_result(tuner, loader, device, opt, warmup: int) -> dict:
    """Images/s over the timed steps, then the per-phase breakdown (per step, seconds). All three parts read one
    stream of batches, as an epoch of qat.py does: the loader's start (its workers, their first batches) falls in
    the `warmup` steps, as it does once an epoch, and so do the batches loaded ahead while the first step compiled
    (`warmup_steps`): the timed steps wait for the loader as long steps of a run do."""
    from models.finetuning.finetune import StepClock
    from utils.batches import seeded_batches

    stream = seeded_batches(loader, device, warmup + opt.steps + opt.breakdown_steps + opt.profile_steps, 1)

    def run(n: int, stamps: list[float] | None = None) -> float:
        sync()
        t0 = time.perf_counter()
        batches = itertools.islice(stream, n)
        tuner.epoch(batches if stamps is None else stamped(batches, stamps), "")
        sync()
        return time.perf_counter() - t0

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run(warmup)
    if device.type == "cuda":  # the steps' own peak, not the compile's (warm-up)
        torch.cuda.reset_peak_memory_stats(device)
    stamps: list[float] = []
    with full_collections() as collections:
        seconds = run(opt.steps, stamps)
    step_ms = [round((b - a) * 1000, 1) for a, b in zip(stamps, stamps[1:])]
    tuner.clock = StepClock(device)
    run(opt.breakdown_steps)
    phases = {k: round(v / opt.breakdown_steps, 5) for k, v in tuner.clock.seconds.items()}
    tuner.clock = StepClock(None, enabled=False)
    peak_gb = round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None
    if opt.profile_steps:
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            run(opt.profile_steps)
        profiled = profile_summary(prof, opt.profile_steps)
    else:
        profiled = None
    return {"step_s": round(seconds / opt.steps, 5), "images_per_s": round(opt.steps * opt.batch_size / seconds, 1),
            "first_step_s": None if tuner.first_step_s is None else round(tuner.first_step_s, 1),
            "first_step_compiled": tuner.first_step_compiled,
            "timed_step_ms": {"median": statistics.median(step_ms), "max": max(step_ms), "each": step_ms}
            if step_ms else None,  # the time between two batches: none for one timed step
            "timed_full_gc_s": [round(t, 3) for t in collections], "peak_memory_gb": peak_gb,
            "breakdown_s_per_step": phases, "breakdown_total_s": round(sum(phases.values()), 5), "profile": profiled}


def stamped(batches, stamps: list[float]):
    """`batches`, noting the time each one is asked for: their differences are the steps' times as the host sees
    them. Nothing in a step reads the device back, but the host runs ahead of the GPU only as far as CUDA's queue of
    launches lets it, so past the first steps they keep the GPU's pace. A step far above the median is a one-off
    stall, not a slower step."""
    for batch in batches:
        stamps.append(time.perf_counter())
        yield batch


@contextlib.contextmanager
def full_collections():
    """The seconds of each full (generation-2) garbage collection inside the block: a full collection walks every
    object of the process, and a compile leaves about a million of them."""
    seconds: list[float] = []
    started = [0.0]

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            seconds.append(time.perf_counter() - started[0])
    gc.callbacks.append(note)
    try:
        yield seconds
    finally:
        gc.callbacks.remove(note)


def profile_summary(prof, steps: int) -> str:
    """Where free-running steps spend their time: the wall time per step, the share of it in which the GPU ran
    anything (the union of its kernels' and copies' intervals: idle GPU time is time the host did not feed it),
    and the ops with the most host time and the most device time."""
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    device = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA")
    host = [e for e in events if e.device_type.name == "CPU"]
    wall = (max(e.time_range.end for e in events) - min(e.time_range.start for e in host)) if host else 0.0
    busy, end = 0.0, float("-inf")
    for start, stop in device:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    averages = prof.key_averages()
    return (f"{steps} steps: {wall / steps / 1000:.1f} ms/step, GPU busy {busy / max(wall, 1e-9):.0%}\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=20) + "\n"
            + averages.table(sort_by="self_device_time_total", row_limit=20))


def main(argv=None) -> int:
    opt = parse_opt(argv)
    from models.core.distributed import data_parallel, init, shutdown_after, world_from_env
    from models.core.task import task_of
    from models.finetuning.fast_step import compiled, plan_step, to_layout
    from models.finetuning.finetune import RECIPES, FineTuner, QATObjective
    from models.pipeline import RunConfig, train_loader
    from models.quantization.quantize import QuantRecipe, calibrate, copy_float, named_quantizers, quantize_model
    from models.yolo import Model
    from utils.batches import load_data, load_hyp, seeded_batches
    from utils.torch_utils import select_device
    world = world_from_env()
    if opt.batch_size % world.size:
        print(f"benchmark_throughput: error: --batch-size {opt.batch_size} must divide by {world.size}",
              file=sys.stderr)
        return 2
    device = select_device(opt.device)
    if world.distributed and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    init(world, device)
    with shutdown_after(world):
        data, hyp = load_data(opt.data), load_hyp(opt.hyp)
        torch.manual_seed(0)
        model = Model(opt.cfg, nc=int(data["nc"])).to(device).eval()
        model.fuse()
        teacher = copy_float(model)
        task = task_of(model)
        cfg = replace(RunConfig(weights="", data=opt.data, hyp=opt.hyp), imgsz=opt.imgsz, batch_size=opt.batch_size,
                      workers=opt.workers)
        loader = train_loader(task, data, cfg, hyp, augment=True, world=world, cache=opt.cache)
        plan = plan_step(opt.step, device, learn_amax=False)
        torch.backends.cudnn.benchmark = opt.cudnn_benchmark  # this process's own setting, for its whole run
        results = {"step_plan": plan.reason, "cudnn_benchmark": opt.cudnn_benchmark}
        if world.distributed and device.type == "cuda":  # without peer access NCCL goes through host memory
            n = torch.cuda.device_count()
            results["gpu_peer_access"] = all(torch.cuda.can_device_access_peer(a, b)
                                             for a in range(n) for b in range(n) if a != b)
        if opt.loader_batches:
            results["loader_images_per_s"], results["loader_batches_timed"] = loader_images_per_s(
                loader, device, opt.loader_batches, opt.batch_size // world.size)
        results["warmup_steps"] = warmup = warmup_steps(opt.warmup, loader)
        to_layout(teacher, plan)
        calib = [b.images for b in seeded_batches(train_loader(task, data, cfg, hyp, augment=False, world=world),
                                                  device, 2, 0)]
        for arm in ("qat", "control"):
            student = quantize_model(copy.deepcopy(model), QuantRecipe(calib_method="max"))  # fresh parameters
            calibrate(student, QuantRecipe(calib_method="max"), calib, world)
            if arm == "control":
                for _, q in named_quantizers(student):
                    q.disable()
            student.train()
            to_layout(student, plan)
            forward = compiled(data_parallel(student, world, device), plan)
            with QATObjective(RECIPES["default"], student, teacher, hyp, forward, compiled(teacher, plan)) as objective:
                tuner = FineTuner(objective, 1, warmup + opt.steps + opt.breakdown_steps,
                                  amp=device.type == "cuda", plan=plan)
                results[arm] = arm_result(tuner, loader, device, opt, warmup)
            world.barrier()
        if world.main:
            write(opt, results, world.size)
    return 0


def write(opt, results: dict, world_size: int) -> None:
    name = Path(opt.cfg).stem
    path = opt.out / f"{name}.json"
    old = json.loads(path.read_text()) if path.is_file() else {"model": name, "runs": []}
    key = {"world_size": world_size, "global_batch": opt.batch_size, "imgsz": opt.imgsz, "step": opt.step}
    runs = [r for r in old["runs"] if {k: r.get(k) for k in key} != key]
    run = {**key, "per_gpu_batch": opt.batch_size // world_size, "workers_per_process": opt.workers,
           "cache": opt.cache,
           "steps": opt.steps, "breakdown_steps": opt.breakdown_steps, **results,
           "qat_over_control_step": round(results["qat"]["step_s"] / results["control"]["step_s"], 3),
           "commit": toolkit_commit(), "command": command_line(), "machine": machine()}
    single = next((r for r in runs if r["world_size"] == 1 and r["global_batch"] == opt.batch_size
                   and r["imgsz"] == opt.imgsz and r.get("step") == opt.step), None)
    if world_size > 1 and single is not None:
        run["speedup"] = round(results["qat"]["images_per_s"] / single["qat"]["images_per_s"], 3)
    runs.append(run)
    write_json(path, {"model": name, "runs": sorted(runs, key=lambda r: (r["imgsz"], r["global_batch"],
                                                                          r["world_size"]))})
    for arm in ("qat", "control"):
        r = results[arm]
        if r.get("profile"):
            print(f"{name} {arm} profile:\n{r['profile']}")
        phases = ", ".join(f"{k} {v * 1000:.1f}" for k, v in r["breakdown_s_per_step"].items())
        spread = (f"; median {r['timed_step_ms']['median']}, slowest {r['timed_step_ms']['max']}"
                  if r["timed_step_ms"] else "")
        peak = f"; peak GPU memory {r['peak_memory_gb']} GB" if r["peak_memory_gb"] is not None else ""
        print(f"{name} {arm}: {world_size} process(es), global batch {opt.batch_size} at {opt.imgsz}: "
              f"{r['images_per_s']} img/s ({r['step_s'] * 1000:.1f} ms/step{spread}; full collections "
              f"{r['timed_full_gc_s']} s{peak}); ms/step by phase: {phases}")
    print(f"QAT step / control step: {run['qat_over_control_step']}" +
          (f"; speedup over 1 process: {run['speedup']}" if "speedup" in run else "") + f"; {path}")


if __name__ == "__main__":
    sys.exit(main())
