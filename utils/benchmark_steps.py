"""The accuracy benchmark's settings and steps (scripts/benchmark_accuracy.py runs them in phases): each step is one
of this toolkit's commands (qat.py, export_qat.py, val_trt.py) run as a user runs it, logged, and skipped when its
output exists, so an interrupted benchmark resumes; plus what an entry keeps of each run.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

from utils.datasplit import image_files
from utils.io_utils import atomic_write, write_json


PHASES_AT_ONCE = 4  # scripts/benchmark_accuracy.py starts the float model's, the default command's, its control's
#                    and its --max-loss variant's phases together, each with --jobs runs at a time


@dataclass(frozen=True)
class Bench:
    dataset: str
    data: str
    imgsz: int
    device: str
    batch_size: int
    workers: int
    seeds: tuple[int, ...]
    methods: tuple[str, ...]
    qat_epochs: int
    iters: int
    calib_batches: int
    qat_args: tuple[str, ...]
    modelopt: tuple[str, ...]  # Model Optimizer's calibration methods run as the peer (none: no peer)
    skip: tuple[str, ...]
    jobs: int
    ort_seeds: int
    work: Path
    out: Path
    max_loss: float | None = None
    cache: str | None = None
    # the caller's OMP_NUM_THREADS, read before anything imports upstream's utils.general: that import sets it to
    # min(8, cores - 1) in os.environ, which every step would inherit
    threads: str | None = None

    def device_for(self, slot: int) -> str:
        """--device 0,1,...: the device of run `slot` (a run is one process on one device; the runs going side by
        side take consecutive slots, so they spread over the devices)."""
        devices = self.device.split(",")
        return devices[slot % len(devices)]

    @property
    def step_env(self) -> dict[str, str]:
        """Each step's environment. More OpenMP threads than cores spin against each other (two jobs of two threads
        on two cores ran auto's range computations 20x slower), so: on a GPU, where a step's math is not on those
        threads, the thread count the caller set, else with several jobs at a time each job's share of the CPUs; on
        the CPU, each step that can run at once (--jobs in each phase going side by side) gets its share of the
        caller's count, else of the CPUs (the test's benchmark on 2 cores: 302 s with 2 threads a step, 72 s with 1)."""
        env = dict(os.environ)
        if self.device == "cpu":
            budget = int(self.threads) if self.threads else (os.cpu_count() or 1)
            env["OMP_NUM_THREADS"] = str(max(1, budget // (self.jobs * PHASES_AT_ONCE)))
        elif self.threads:
            env["OMP_NUM_THREADS"] = self.threads
        elif self.jobs > 1:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.jobs))
        return env

    def env_for(self, device: str) -> dict[str, str]:
        """A step's environment on `device`: a GPU index is also the only GPU the step sees. A script's device choice
        by CUDA_VISIBLE_DEVICES (upstream's select_device) comes too late once anything has asked CUDA for its
        device count, and every step would then run on the first GPU."""
        return {**self.step_env, "CUDA_VISIBLE_DEVICES": device} if device.isdigit() else self.step_env

    def common(self, weights: Path, data: Path, slot: int) -> list[str]:
        return ["--weights", str(weights), "--data", str(data), "--imgsz", str(self.imgsz), "--device",
                self.device_for(slot), "--batch-size", str(self.batch_size), "--calib-batches",
                str(self.calib_batches), "--workers", str(self.workers),
                *(["--cache", self.cache] if self.cache else [])]


# --------------------------------------------------------------------------------------------------
# Steps (each skipped when its output exists)
# --------------------------------------------------------------------------------------------------
def run_step(cmd: list[str], log: Path, env: dict[str, str]) -> None:
    print("+ " + shlex.join(cmd), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed (exit {r.returncode}); log {log}:\n{log.read_text()[-1500:]}")


def log_beside(step_output: Path) -> Path:
    """A step's log: its output's whole name + .log (with_suffix would cut 'val-ptq-percentile-99.9' at the dot, and
    the candidates 99.9, 99.99 and 99.999, measured side by side, would write one file)."""
    return step_output.with_name(step_output.name + ".log")


def quantize_run(args: list[str], save_dir: Path, env: dict[str, str]) -> dict:
    """A `qat.py quantize` run (resumed where it stopped); its report. A folder made with other arguments is an
    error, not a result: its numbers would be reported as this run's."""
    report, recorded = save_dir / "report.json", save_dir / "benchmark_args.json"
    what = _result_args(args)
    if recorded.is_file() and json.loads(recorded.read_text()) != what:
        raise RuntimeError(f"{save_dir} holds a run made with other arguments ({recorded}); use another --work")
    if not report.is_file():
        save_dir.mkdir(parents=True, exist_ok=True)
        write_json(recorded, what)
    if not (report.is_file() and json.loads(report.read_text()).get("finished")):
        resume = ["--resume", str(save_dir)] if report.is_file() else \
            [*args, "--project", str(save_dir.parent), "--name", save_dir.name, "--exist-ok"]
        run_step([sys.executable, "qat.py", "quantize", *resume], log_beside(save_dir), env)
    return json.loads(report.read_text())


def _result_args(args: list[str]) -> list[str]:
    """The arguments that decide a run's numbers: where and how fast it runs (--device, --workers, --cache: the same
    batches) may change when it resumes."""
    out, i = [], 0
    while i < len(args):
        if args[i] in ("--device", "--workers", "--cache"):
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def recipe_tag(qat_args: tuple[str, ...]) -> str:
    """'' for the default recipe, else e.g. '-recipe-reference': QAT with --qat-args gets folders of its own."""
    return "".join(f"-{re.sub(r'[^A-Za-z0-9.-]+', '_', a.lstrip('-'))}" for a in qat_args)


def measure(model: Path, data: Path, out: Path, bench: Bench) -> dict:
    """mAP of a .pt (PyTorch) or .onnx (ONNX Runtime) through val_trt.py: one loop, one letterbox for all."""
    result = out / "val_trt.json"
    if not result.is_file():
        device = bench.device_for(zlib.crc32(str(out).encode()))  # measurements spread over the devices
        # the one GPU the step sees (env_for) is its first
        source = ["--onnx-file", str(model)] if model.suffix == ".onnx" else ["--weights", str(model), "--device",
                                                                             "0" if device.isdigit() else device]
        run_step([sys.executable, "val_trt.py", *source, "--data", str(data), "--imgsz", str(bench.imgsz),
                  "--batch-size", "8", "--workers", str(bench.workers), "--project", str(out.parent), "--name",
                  out.name, "--exist-ok"], log_beside(out), bench.env_for(device))
    return scored(json.loads(result.read_text()))


METRICS = ("ap", "ap50", "precision", "recall")  # of the boxes; a segmenter's masks as mask_ap, ...


def scored(metrics: dict) -> dict:
    """The mAP, mAP50, precision and recall of the boxes, and of the masks where the model has them."""
    return {k: metrics[k] for prefix in ("", "mask_") for k in (prefix + m for m in METRICS) if k in metrics}


def select_curves(epochs: list[dict]) -> dict:
    """A run's select mAP50-95 by epoch: of the boxes, and of the masks where the model has them."""
    return {"select_by_epoch": [e["ap"] for e in epochs],
            **({"select_mask_by_epoch": [e["mask_ap"] for e in epochs]} if epochs and "mask_ap" in epochs[0] else {})}


def export(weights: Path, dtype: str, bench: Bench, end2end: bool = False) -> Path:
    """The deployable graph of a checkpoint: FP32 (PyTorch's arithmetic, Model Optimizer's input) or FP16 (what
    TensorRT 11 builds); with `end2end` NMS inside (standard ONNX NonMaxSuppression, at val_trt.py's evaluation
    thresholds, so its mAP is comparable). Written beside a copy named after it."""
    onnx_file = weights.with_name(f"{weights.stem}-{dtype}{'-e2e' if end2end else ''}.onnx")
    if not onnx_file.is_file():
        copy = weights.with_name(onnx_file.stem + ".pt")
        shutil.copyfile(weights, copy)
        include = ["--include", "onnx_end2end", "--nms", "onnx", "--conf-thres", "0.001", "--iou-thres", "0.7",
                   "--topk-all", "300"] if end2end else ["--include", "onnx"]
        run_step([sys.executable, "export_qat.py", "--weights", str(copy), *include, "--dynamic",
                  "--imgsz", str(bench.imgsz), "--dtype", dtype, "--exist-ok"], copy.with_suffix(".export.log"),
                 bench.step_env)
        copy.unlink()
        if end2end:
            copy.with_name(copy.stem + "-end2end.onnx").rename(onnx_file)
    return onnx_file


_BANNER = re.compile(r"torch-(\S+) (?:CUDA:\d+ \((.+?), \d+MiB\)|CPU)")  # upstream's select_device line


def step_devices(folder: Path) -> list[str]:
    """Where the steps under `folder` ran, as their own logs say (upstream's banner, e.g. 'torch-2.11.0+cu130 CUDA:0
    (NVIDIA H100 80GB HBM3, 81079MiB)'): each distinct device and torch. A benchmark resumed elsewhere reuses the
    steps' outputs, so the machine that writes the entry need not be the one that measured it."""
    found = set()
    for log in folder.rglob("*.log"):
        for m in _BANNER.finditer(log.read_text(errors="replace")):
            found.add(f"{m[2] or 'CPU'} (torch {m[1]})")
    return sorted(found)


def lint_summary(onnx_file: Path) -> dict:
    """Counted by one rule for every graph (ours and the peer's): utils/qdq_lint.py."""
    from utils.qdq_lint import lint_file
    report = lint_file(onnx_file)
    return {"qdq_nodes": report.quantize_nodes, "quantized_convs": report.quantized_convs, "convs": report.convs,
            "unshared_joins": len(report.unshared_joins), "unquantized_convs": len(report.unquantized_convs)}


def images_per_second(epochs: list[dict], batch_size: int, iters: int) -> float | None:
    """Training images per second of a run's QAT epochs (their `train_s`, the steps alone), as it ran: beside the
    benchmark's other jobs on the same GPU and CPUs, so a floor for one run alone. None where the epochs' length
    is not a count of iterations (--iters 0: one pass over the images) or no time was recorded."""
    seconds = sum(e.get("train_s", 0) for e in epochs)
    return round(len(epochs) * iters * batch_size / seconds, 1) if seconds and iters else None


def mixed_summary(record: dict) -> dict:
    """What the entry keeps of a run's mixed-precision record: the budget, what was kept in float and why, what it
    costs the engine, the select mAP all-INT8 and mixed, and the time the choice took."""
    keep = ("max_loss", "reached", "kept_float", "float_convs", "int8_mac_share", "boundaries", "lint_problems",
            "origin_select", "all_int8_select", "mixed_select", "candidates", "seconds")
    return {k: record[k] for k in keep if k in record} | {"measured": len(record.get("measured", {})),
                                                          "tried": len(record.get("tried", []))}


def public(run: dict) -> dict:
    """A run's numbers without machine-local paths and file lists (the sample is identified by its digest)."""
    return {k: v for k, v in run.items() if k not in ("final_file", "calibration_images", "file")}


def yaml_split(split_yaml: Path) -> dict:
    import yaml
    return yaml.safe_load(split_yaml.read_text())["split"]


def sample_id(names: list[str]) -> str:
    """Which images a calibration used, as a digest of their names in the order drawn."""
    import hashlib
    return hashlib.md5("\n".join(names).encode()).hexdigest()


def calibration_array(split_yaml: Path, names: list[str], imgsz: int, path: Path) -> Path:
    """The named fit images, square-letterboxed as the pipeline's calibration loader gives them, float32 0-1
    NCHW (Model Optimizer's --calibration_data_path)."""
    if path.is_file():
        return path
    import numpy as np
    import yaml
    from utils.dataloaders import LoadImages
    fit = {f.name: f for f in image_files(yaml.safe_load(split_yaml.read_text())["train"])}
    missing = [n for n in names if n not in fit]
    if missing:
        raise ValueError(f"calibration images not in the fit split: {missing[:3]}")
    images = [im.astype(np.float32) / 255 for _, im, *_ in
              (next(iter(LoadImages(str(fit[n]), img_size=imgsz, stride=32, auto=False))) for n in names)]
    atomic_write(path, lambda tmp: np.save(open(tmp, "wb"), np.stack(images)))
    return path
