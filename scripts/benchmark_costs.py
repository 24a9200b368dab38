#!/usr/bin/env python3
"""What quantization costs in training time: the QAT step against the same step of its float control (the same
recipe, teacher and batch, every quantizer disabled), interleaved A/B in one process, plus calibration time per
method and peak memory. Weights and images are random: costs do not depend on what the model has learned.

    python scripts/benchmark_costs.py --cfg models/detect/gelan-c.yaml --batch-size 16 --imgsz 640 --steps 60

Run from the patched YOLOv9 checkout (CUDA). Writes results/costs/<model>.json (--out).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

import torch  # noqa: E402

from utils.io_utils import write_json  # noqa: E402
from utils.provenance import command_line, machine, overlay_repo, toolkit_commit  # noqa: E402

WHAT = ("one optimizer step of `qat.py quantize`'s recipe (models/finetuning/finetune.py FineTuner.step): teacher "
        "forward without gradients, student forward, head distillation + detection loss, backward, Adam step, AMP on "
        "CUDA; the QAT student has its quantizers enabled, the control the same model with every quantizer disabled; "
        "the two alternate step by step on the same batches, each timed with a CUDA synchronize before and after")


def random_targets(batch_size: int, per_image: int, nc: int, device) -> torch.Tensor:
    """Upstream targets [image, class, x, y, w, h] (normalised)."""
    g = torch.Generator().manual_seed(0)
    n = batch_size * per_image
    img = torch.arange(batch_size).repeat_interleave(per_image).float()
    cls = torch.randint(0, nc, (n,), generator=g).float()
    xy = torch.rand(n, 2, generator=g) * 0.8 + 0.1
    wh = torch.rand(n, 2, generator=g) * 0.15 + 0.05
    return torch.cat([img[:, None], cls[:, None], xy, wh], 1).to(device)


def trainable_copy(model):
    """A deep copy whose parameters are fresh leaves (fused convs can hold non-leaf tensors); quantizer state,
    amax included, is copied along."""
    model = copy.deepcopy(model)
    for m in model.modules():
        for name, param in list(m._parameters.items()):
            if param is not None:
                m._parameters[name] = torch.nn.Parameter(param.detach().clone())
    return model.train()


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def quantiles(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=10)
    return {"median": round(statistics.median(times), 5), "p10": round(q[0], 5), "p90": round(q[-1], 5)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="models/detect/gelan-c.yaml")
    p.add_argument("--nc", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--steps", type=int, default=60, help="timed steps of each arm (>= 50 for the median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each arm first")
    p.add_argument("--hyp", default="data/hyps/hyp.scratch-high.yaml")
    p.add_argument("--out", type=Path, default=overlay_repo() / "results" / "costs")
    opt = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (training-step costs on a CPU say nothing about a GPU's)")

    from models.finetuning.finetune import RECIPES, FineTuner, QATObjective
    from models.quantization.held_state import held
    from models.quantization.quantize import (QuantRecipe, calibrate, copy_float, named_quantizers, quantize_model,
                                              quantizer_counts)
    from models.yolo import Model
    from utils.batches import load_hyp
    device = torch.device("cuda:0")
    torch.manual_seed(0)
    model = Model(opt.cfg, nc=opt.nc).to(device).eval()
    model.fuse()
    teacher = copy_float(model)
    images = [torch.rand(opt.batch_size, 3, opt.imgsz, opt.imgsz, device=device) for _ in range(4)]
    targets = random_targets(opt.batch_size, 8, opt.nc, device)
    quantize_model(model, QuantRecipe())
    calib_s = {m: round(timed(lambda m=m: calibrate(model, QuantRecipe(calib_method=m), images)), 3)
               for m in ("max", "mse", "percentile", "entropy")}  # mse last sets the amax QAT starts from
    calibrate(model, QuantRecipe(calib_method="mse"), images)
    hyp = load_hyp(opt.hyp)
    arms = {}
    for arm in ("qat", "control"):
        student = trainable_copy(model)
        if arm == "control":
            for _, q in named_quantizers(student):
                q.disable()
        objective = QATObjective(RECIPES["default"], student, teacher, hyp)
        arms[arm] = FineTuner(objective, epochs=1, iters=opt.steps + opt.warmup, amp=True)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    peak: dict[str, float] = {}
    with held(*(tuner.objective.student for tuner in arms.values())):  # the scales, as FineTuner.epoch holds them
        for i in range(opt.steps + opt.warmup):
            for arm, tuner in arms.items():  # A, B, A, B, ...: drifts of clock or temperature hit both alike
                torch.cuda.reset_peak_memory_stats()
                t = timed(lambda: tuner.step(images[i % len(images)], targets, None))
                peak[arm] = max(peak.get(arm, 0.0), torch.cuda.max_memory_allocated() / 2**30)
                if i >= opt.warmup:
                    times[arm].append(t)
    for tuner in arms.values():
        tuner.objective.__exit__()
    result = {"model": Path(opt.cfg).stem, "batch_size": opt.batch_size, "imgsz": opt.imgsz, "what": WHAT,
              "steps": opt.steps, "warmup": opt.warmup, "qat_step_s": quantiles(times["qat"]),
              "control_step_s": quantiles(times["control"]),
              "ratio": round(statistics.median(times["qat"]) / statistics.median(times["control"]), 3),
              "calibration_s": calib_s, "calibration_batches": len(images),
              "peak_gib": {k: round(v, 2) for k, v in peak.items()}, "quantizers": quantizer_counts(model),
              "commit": toolkit_commit(), "command": command_line(), "machine": machine()}
    path = write_json(opt.out / f"{result['model']}.json", result)
    print(f"QAT step {result['qat_step_s']['median']:.4f} s vs float control {result['control_step_s']['median']:.4f} s"
          f" = {result['ratio']:.2f}x ({opt.steps} steps each, interleaved); {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
