#!/usr/bin/env python3
"""Accuracy benchmark: float vs PTQ (each calibration method) vs the default `qat.py quantize` command (`auto`
calibration, QAT, the best of PTQ and every QAT epoch delivered) vs its float control (the same fine-tune with
quantizers disabled) vs NVIDIA Model Optimizer's ONNX PTQ, over seeds, with every choice made on a selection split.

    python scripts/benchmark_accuracy.py --dataset helmet --data /data/helmet-416/data.yaml --imgsz 416 \\
        --models gelan-s=assets/gelan-s-helmet.pt --seeds 0 1 2 --device 0 --batch-size 32 [--modelopt]
    python scripts/benchmark_accuracy.py --render [--check] [--docs]   # tables in --out [and README, RESULTS]

Run from the patched YOLOv9 checkout. The training images are split into `fit` (calibration and fine-tuning) and
`select` (every choice: calibration method, delivered model, the peer's method) by the rule `qat.py quantize` itself
applies (utils/datasplit.py, models/selection.py): each run carves it from --data and the benchmark checks that its
fingerprint is the benchmark's; the val images are only measured. Everything is written under --work and --out;
`--docs` also renders this repository's README.md and docs/RESULTS.md. Each seed draws its own calibration sample and fine-tuning order. Every step is one of this toolkit's
commands (qat.py, export_qat.py, val_trt.py) or Model Optimizer's, logged under --work and skipped when its output
exists, so a call that ran out of time resumes, on this machine or another (a qat.py folder made with other arguments
than --device and --workers is refused). The result of a model is OUT/<dataset>/<model>/entry.json:
provenance (commit, command, machine, seeds, split fingerprints, weights sha256) and every per-seed number.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from utils.datasplit import image_files, write_split  # noqa: E402
from utils.io_utils import atomic_write, write_json  # noqa: E402
from utils.provenance import command_line, machine, overlay_repo, sha256, toolkit_commit  # noqa: E402
from utils.results import difference, fmt, fmt_difference, render_files, spread  # noqa: E402

CALIBRATIONS = {"max": ["--calib-method", "max"], "mse": ["--calib-method", "mse"],
                "percentile-99.99": ["--calib-method", "percentile", "--percentile", "99.99"],
                "percentile-99.999": ["--calib-method", "percentile", "--percentile", "99.999"],
                "entropy": ["--calib-method", "entropy"]}
# QAT recipe variants, each spelled out in full (the default is QATRecipe()'s): judged on select, over seeds
_HEAD = ["--distill", "head", "--lr-schedule", "cosine"]
ABLATION = {
    "default": ("head distillation + detection loss, Adam 1e-4 cosine", []),
    "lr-3e-5": ("the default at lr 3e-5", ["--lr", "3e-5"]),
    "lr-3e-4": ("the default at lr 3e-4", ["--lr", "3e-4"]),
    "head-only": ("head distillation, no detection loss", [*_HEAD, "--det-loss", "0"]),
    "det-only": ("detection loss on labels, no teacher", ["--distill", "none", "--det-loss", "1"]),
    "reference": ("NVIDIA's: per-layer MSE, Adam 1e-5, step schedule", ["--recipe", "reference"]),
    "ema": ("the default + weight EMA 0.995", ["--ema", "0.995"]),
    "learn-amax": ("the default + learned activation ranges", ["--learn-amax"]),
    "det-3": ("the default, detection loss weighted 3", ["--det-loss", "3"]),
    "layers-det": ("per-layer MSE distillation + detection loss, Adam 1e-4 cosine", ["--distill", "layers"]),
    # finetune_args' --epochs is overridden by the variant's (the last one given wins)
    "long": ("the default over 10 epochs (the published runs have 5)", ["--epochs", "10"]),
    "float-2": ("the first 2 epochs in float, then calibrated anew and QAT", ["--float-epochs", "2"]),
    "float-3": ("the first 3 epochs in float, then calibrated anew and QAT", ["--float-epochs", "3"]),
    "control": ("float fine-tuning with the default recipe", ["--float-control"]),
    "long-control": ("float fine-tuning over 10 epochs", ["--epochs", "10", "--float-control"]),
}
MODELOPT_METHODS = ("max", "entropy")  # Model Optimizer's INT8 calibration methods
DFL_NODES = ".*dfl.*"  # the box decoder's fixed-weight conv: float in our graphs, so excluded from the peer's too
REPO = overlay_repo()


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
    modelopt: bool
    skip: tuple[str, ...]
    jobs: int
    ort_seeds: int
    work: Path
    out: Path
    max_loss: float | None = None

    def device_for(self, seed: int) -> str:
        """--device 0,1: each seed's runs on one of the GPUs in turn (a run is one process on one device)."""
        devices = self.device.split(",")
        return devices[self.seeds.index(seed) % len(devices)] if seed in self.seeds else devices[0]

    @property
    def step_env(self) -> dict[str, str]:
        """Each step's environment: with several jobs at a time, each gets its share of the CPUs for its math
        threads (more OpenMP threads than cores spin against each other: two jobs of two threads on two cores ran
        auto's range computations 20x slower). A thread count the caller set is kept."""
        env = dict(os.environ)
        if self.jobs > 1:
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.jobs)))
        return env

    def common(self, weights: Path, data: Path, seed: int) -> list[str]:
        return ["--weights", str(weights), "--data", str(data), "--imgsz", str(self.imgsz), "--device",
                self.device_for(seed),
                "--batch-size", str(self.batch_size), "--calib-batches", str(self.calib_batches), "--workers",
                str(self.workers)]


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
        run_step([sys.executable, "qat.py", "quantize", *resume], save_dir.with_name(save_dir.name + ".log"), env)
    return json.loads(report.read_text())


def _result_args(args: list[str]) -> list[str]:
    """The arguments that decide a run's numbers: where it runs (--device, --workers) may change when it resumes."""
    out, i = [], 0
    while i < len(args):
        if args[i] in ("--device", "--workers"):
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
        source = ["--onnx-file", str(model)] if model.suffix == ".onnx" else ["--weights", str(model), "--device",
                                                                             bench.device_for(-1)]
        run_step([sys.executable, "val_trt.py", *source, "--data", str(data), "--imgsz", str(bench.imgsz),
                  "--batch-size", "8", "--workers", str(bench.workers), "--project", str(out.parent), "--name",
                  out.name, "--exist-ok"], out.with_suffix(".log"), bench.step_env)
    m = json.loads(result.read_text())
    return {k: m[k] for k in ("ap", "ap50", "precision", "recall")}


def export(weights: Path, dtype: str, bench: Bench) -> Path:
    """The deployable graph of a checkpoint: FP32 (PyTorch's arithmetic, Model Optimizer's input) or FP16 (what
    TensorRT 11 builds), written beside a copy named after it."""
    onnx_file = weights.with_name(f"{weights.stem}-{dtype}.onnx")
    if not onnx_file.is_file():
        copy = weights.with_name(onnx_file.stem + ".pt")
        shutil.copyfile(weights, copy)
        run_step([sys.executable, "export_qat.py", "--weights", str(copy), "--include", "onnx", "--dynamic",
                  "--imgsz", str(bench.imgsz), "--dtype", dtype, "--exist-ok"], copy.with_suffix(".export.log"),
                 bench.step_env)
        copy.unlink()
    return onnx_file


def lint_summary(onnx_file: Path) -> dict:
    """Counted by one rule for every graph (ours and the peer's): utils/qdq_lint.py."""
    from utils.qdq_lint import lint_file
    report = lint_file(onnx_file)
    return {"qdq_nodes": report.quantize_nodes, "quantized_convs": report.quantized_convs, "convs": report.convs,
            "unshared_joins": len(report.unshared_joins), "unquantized_convs": len(report.unquantized_convs)}


# --------------------------------------------------------------------------------------------------
# One model
# --------------------------------------------------------------------------------------------------
class ModelBench:
    def __init__(self, bench: Bench, name: str, weights: Path):
        self.bench, self.name, self.weights = bench, name, weights.resolve()
        self.work = bench.work / bench.dataset / name
        self.split = write_split(bench.data, bench.work / bench.dataset / "split")  # qat.py's own rule
        self.select_fingerprint = yaml_split(self.split)["fingerprint"]["select"]
        self.report_yaml = self._report_yaml()

    def _report_yaml(self) -> Path:
        """The split's yaml with val = the reported val images (train stays fit)."""
        import yaml
        spec = yaml.safe_load(self.split.read_text())
        spec["val"] = spec.pop("test")
        path = self.split.with_name("report.yaml")
        atomic_write(path, lambda tmp: Path(tmp).write_text(yaml.safe_dump(spec, sort_keys=False)))
        return path

    def pool(self):
        return ThreadPoolExecutor(self.bench.jobs)

    def on_both(self, model: Path, out: Path) -> dict:
        return {"select": measure(model, self.split, out / "select", self.bench),
                "val": measure(model, self.report_yaml, out / "val", self.bench)}

    def quantize(self, folder: str, seed: int, extra: list[str]) -> dict:
        """A `qat.py quantize` run on --data (it carves the select split itself; checked to be this benchmark's)."""
        b = self.bench
        r = quantize_run([*b.common(self.weights, Path(b.data), seed), "--seed", str(seed), "--no-eval-origin", *extra],
                         self.work / folder, b.step_env)
        if r["select"]["fingerprint"] != self.select_fingerprint:
            raise RuntimeError(f"{self.work / folder}: qat.py held out other select images than the benchmark's split")
        return r

    def finetune_args(self, *extra: str) -> list[str]:
        b = self.bench
        return ["--epochs", str(b.qat_epochs), "--iters", str(b.iters), "--no-eval-ptq", *extra]

    def ptq(self) -> dict:
        """Every fixed calibration method x seed: PTQ measured on select (in the run) and on val."""
        b = self.bench
        jobs = [(m, s) for m in b.methods for s in b.seeds]

        def one(job):
            m, s = job
            r = self.quantize(f"ptq-{m}-seed{s}", s, [*CALIBRATIONS[m], "--epochs", "0"])
            d = self.work / f"ptq-{m}-seed{s}"
            seconds = r["calibration"]["seconds"]
            return {"select": r["ptq"], "val": measure(Path(r["ptq_file"]), self.report_yaml, d / "val", b),
                    "calib_s": round(seconds["collect"] + sum(seconds["ranges"].values()), 2),
                    "calibration_sample": sample_id(r["calibration_images"]),
                    "calibration_images": r["calibration_images"], "file": r["ptq_file"]}
        with self.pool() as pool:
            runs = dict(zip(jobs, pool.map(one, jobs)))
        return {m: {str(s): runs[(m, s)] for s in b.seeds} for m in b.methods}

    def default_command(self, extra: tuple[str, ...] = ()) -> dict:
        """The command users run, per seed: `auto` calibration (its choice and every candidate's select mAP), QAT,
        the delivered model (the best on select of PTQ and every QAT epoch); the PTQ, the best QAT epoch, the last
        and the delivered model measured on val. `extra`: flags of a variant of it (--max-loss)."""
        b = self.bench
        tag = "qat" + recipe_tag(b.qat_args + extra)

        def one(s):
            r = self.quantize(f"{tag}-seed{s}", s, self.finetune_args(*b.qat_args, *extra))
            d = self.work / f"{tag}-seed{s}"
            cal, final, epochs = r["calibration"], r["final"], r["qat"]
            ptq_val = measure(Path(r["ptq_file"]), self.report_yaml, d / "val-ptq", b)
            best, last = r["qat_best"], epochs[-1]
            val_best = measure(Path(r["qat_best_file"]), self.report_yaml, d / "val-best", b)
            val_last = val_best if best["epoch"] == last["epoch"] else \
                measure(Path(last["file"]), self.report_yaml, d / "val-last", b)
            return {"recipe": r["config"]["qat"], "auto": {"chosen": cal["chosen"], "candidates": cal["candidates"],
                                                          "seconds": cal["seconds"], "val": ptq_val},
                    "train_img_s": images_per_second(epochs, r["config"]["batch_size"], b.iters),
                    "best_epoch": best["epoch"], "select_by_epoch": [e["ap"] for e in epochs], "val_best": val_best,
                    "val_last": val_last, "final": {"stage": final["stage"], "epoch": final["epoch"]},
                    "val_final": ptq_val if final["stage"] == "ptq" else val_best, "final_file": final["file"],
                    **({"mixed_precision": _mixed_summary(r["mixed_precision"])} if "mixed_precision" in r else {})}
        with self.pool() as pool:
            return dict(zip(map(str, b.seeds), pool.map(one, b.seeds)))

    def control(self) -> dict:
        """The float control of the default command per seed: its best epoch on select and its last, on val."""
        b = self.bench
        tag = "fpft" + recipe_tag(b.qat_args)

        def one(s):
            d = self.work / f"{tag}-seed{s}"
            r = self.quantize(f"{tag}-seed{s}", s, self.finetune_args(*b.qat_args, "--float-control"))
            best, last = r["qat_best"], r["qat"][-1]
            val_best = measure(Path(r["qat_best_file"]), self.report_yaml, d / "val-best", b)
            return {"recipe": r["config"]["qat"], "best_epoch": best["epoch"],
                    "select_by_epoch": [e["ap"] for e in r["qat"]], "val_best": val_best,
                    "val_last": val_best if best["epoch"] == last["epoch"] else
                    measure(Path(last["file"]), self.report_yaml, d / "val-last", b)}
        with self.pool() as pool:
            return dict(zip(map(str, b.seeds), pool.map(one, b.seeds)))

    def ablation(self, variants: tuple[str, ...]) -> dict:
        """Recipe variants x seed, as the default command with the variant's flags: the best epoch's and the last
        epoch's select mAP (val is not looked at). The best of more epochs is a maximum over more noisy values;
        the last epoch is not picked, so it compares schedules of different lengths without that bias."""
        b = self.bench
        variants = ("default", *(v for v in variants if v != "default"))
        jobs = [(v, s) for v in variants for s in b.seeds]

        def one(job):
            v, s = job
            same_as_qat = v == "default" and not b.qat_args  # the default command's own run, not a rerun
            r = self.quantize(f"qat-seed{s}" if same_as_qat else f"ablation-{v}-seed{s}", s,
                              self.finetune_args(*ABLATION[v][1]))
            return r["qat_best"]["ap"], r["qat"][-1]["ap"], r["final"]["ap"]
        with self.pool() as pool:
            runs = dict(zip(jobs, pool.map(one, jobs)))
        rows = {v: {"what": ABLATION[v][0], "args": ABLATION[v][1],
                    **{column: spread([runs[(v, s)][k] for s in b.seeds])
                       for k, column in enumerate(("select_best", "select_last", "select_delivered"))}}
                for v in variants}
        for row in rows.values():
            row["vs_default"] = difference(row["select_best"], rows["default"]["select_best"])
            row["last_vs_default"] = difference(row["select_last"], rows["default"]["select_last"])
            row["delivered_vs_default"] = difference(row["select_delivered"], rows["default"]["select_delivered"])
        result = {"model": self.name, "dataset": b.dataset, "calibration": "auto", "provenance": self.provenance(),
                  "settings": self.settings(), "variants": rows}
        write_json(b.out / b.dataset / self.name / "ablation.json", result)
        return result

    def deployed(self, qat: dict) -> dict:
        """The delivered model of the first --ort-seeds seeds as the FP32 and the FP16 graph, in ONNX Runtime on
        val (on the CPU: the bigger models' graphs take minutes each)."""
        b, dtypes = self.bench, ("fp32", "fp16")
        jobs = [(dtype, s) for dtype in dtypes for s in list(qat)[:b.ort_seeds]]

        def one(job):
            dtype, s = job
            graph = export(Path(qat[s]["final_file"]), dtype, b)
            out = self.work / f"ort{recipe_tag(b.qat_args)}-{dtype}-seed{s}"
            return {"val": measure(graph, self.report_yaml, out, b), "lint": lint_summary(graph)}
        with self.pool() as pool:
            runs = dict(zip(jobs, pool.map(one, jobs)))
        return {dtype: {s: r for (d, s), r in runs.items() if d == dtype} for dtype in dtypes}

    def modelopt(self, ptq_choice: dict) -> dict:
        """Model Optimizer's ONNX INT8 PTQ of the float model, each method x seed, calibrated on the very images our
        calibration of that seed used (count and identity), the DFL conv kept float as in ours."""
        b = self.bench
        fp_onnx = export(self._float_copy(), "fp32", b)
        jobs = [(m, s) for m in MODELOPT_METHODS for s in b.seeds]

        def one(job):
            m, s = job
            files = ptq_choice[str(s)]["calibration_images"]
            calib = calibration_array(self.split, files, b.imgsz, self.work / f"modelopt-calib-seed{s}.npy")
            q = self.work / f"modelopt-{m}-seed{s}" / "model.onnx"
            if not q.is_file():  # its own copy of the input: Model Optimizer writes intermediate files beside it
                q.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(fp_onnx, q.with_name("float.onnx"))
                run_step([sys.executable, "-m", "modelopt.onnx.quantization",
                          "--onnx_path", str(q.with_name("float.onnx")),
                          "--quantize_mode", "int8", "--calibration_method", m, "--calibration_data_path", str(calib),
                          "--calibration_eps", "cpu", "--high_precision_dtype", "fp32", "--nodes_to_exclude", DFL_NODES,
                          "--output_path", str(q)], q.with_suffix(".log"), b.step_env)
            return {**self.on_both(q, self.work / f"ort-modelopt-{m}-seed{s}"), "lint": lint_summary(q),
                    "calib_images": len(files), "calibration_sample": sample_id(files)}
        with self.pool() as pool:
            runs = dict(zip(jobs, pool.map(one, jobs)))
        return {m: {str(s): runs[(m, s)] for s in b.seeds} for m in MODELOPT_METHODS}

    def _float_copy(self) -> Path:
        copy = self.work / f"fp-{self.weights.name}"  # exports are written beside their .pt: not the user's folder
        if not copy.is_file():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.weights, copy)
        return copy

    def run(self, ablation: tuple[str, ...] = ()) -> dict:
        """The independent phases side by side (fixed PTQ beside the default command, then the control beside the
        deployed graphs), each with --jobs runs at a time: two phases' GPU memory at once, not three."""
        fp = self.on_both(self.weights, self.work / "fp")
        skip = self.bench.skip
        with ThreadPoolExecutor(2) as phases:
            ptq_runs = phases.submit(self.ptq)
            qat_runs = phases.submit(self.default_command) if "qat" not in skip else None
            ptq, qat = ptq_runs.result(), qat_runs and qat_runs.result()
        choice = max(ptq, key=lambda m: spread([r["select"]["ap"] for r in ptq[m].values()])["mean"])
        if ablation:
            self.ablation(ablation)
        entry = {"model": self.name, "dataset": self.bench.dataset, "imgsz": self.bench.imgsz,
                 "provenance": self.provenance(), "settings": self.settings(), "fp": fp,
                 "ptq": {m: {s: _public(r) for s, r in runs.items()} for m, runs in ptq.items()},
                 "ptq_choice": choice, "not_run": list(skip)}
        ours = Path(ptq[choice][str(self.bench.seeds[0])]["file"])  # the deployed graph of our best stage
        with ThreadPoolExecutor(3) as phases:
            mixed = phases.submit(self.default_command, ("--max-loss", f"{self.bench.max_loss:g}")) \
                if qat and self.bench.max_loss is not None else None
            control = phases.submit(self.control) if "fp_ft" not in skip else None
            deployed = phases.submit(self.deployed, qat) if qat and "ort" not in skip else None
            if qat:
                entry["qat"] = {s: _public(r) for s, r in qat.items()}
                ours = Path(qat[str(self.bench.seeds[0])]["final_file"])
            if deployed:
                entry["ort"] = deployed.result()
            if control:
                entry["fp_ft"] = control.result()
            if mixed:
                entry["mixed"] = {s: _public(r) for s, r in mixed.result().items()}
        if self.bench.modelopt:
            peer = self.modelopt(ptq[choice])
            entry["modelopt"] = peer
            entry["modelopt_choice"] = max(peer, key=lambda m: spread([r["select"]["ap"] for r in peer[m].values()])
                                           ["mean"])
            entry["ours_lint"] = {"graph": "delivered" if "qat" in entry else f"ptq-{choice}",
                                  **lint_summary(export(ours, "fp32", self.bench))}
        entry["summary"] = summarize(entry)
        write_json(self.bench.out / self.bench.dataset / self.name / "entry.json", entry)
        return entry

    def provenance(self) -> dict:
        digest = sha256(self.weights)
        train = self.bench.out / self.bench.dataset / self.name / "float" / "train.json"
        trained = json.loads(train.read_text()) if train.is_file() else {}
        return {"commit": toolkit_commit(), "command": command_line(), "machine": machine(),
                "weights": str(self.weights.relative_to(REPO) if self.weights.is_relative_to(REPO) else self.weights),
                "weights_sha256": digest, "seeds": list(self.bench.seeds),
                "split": yaml_split(self.split),
                "float_training": {k: trained[k] for k in ("epochs_run", "best_epoch", "best_select_map", "converged")}
                if digest in (trained.get("weights_sha256"), (trained.get("converted") or {}).get("weights_sha256"))
                else None}

    def settings(self) -> dict:
        return {k: v for k, v in asdict(self.bench).items() if k not in ("work", "out", "data", "jobs", "device",
                                                                        "skip", "ort_seeds", "max_loss")}


def images_per_second(epochs: list[dict], batch_size: int, iters: int) -> float | None:
    """Training images per second of a run's QAT epochs (their `train_s`, the steps alone), as it ran: beside the
    benchmark's other jobs on the same GPU and CPUs, so a floor for one run alone. None where the epochs' length
    is not a count of iterations (--iters 0: one pass over the images) or no time was recorded."""
    seconds = sum(e.get("train_s", 0) for e in epochs)
    return round(len(epochs) * iters * batch_size / seconds, 1) if seconds and iters else None


def _mixed_summary(record: dict) -> dict:
    """What the entry keeps of a run's mixed-precision record: the budget, what was kept in float and why, what it
    costs the engine, the select mAP all-INT8 and mixed, and the time the choice took."""
    keep = ("max_loss", "reached", "kept_float", "float_convs", "int8_mac_share", "boundaries", "lint_problems",
            "origin_select", "all_int8_select", "mixed_select", "candidates", "seconds")
    return {k: record[k] for k in keep if k in record} | {"measured": len(record.get("measured", {})),
                                                          "tried": len(record.get("tried", []))}


def _public(run: dict) -> dict:
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


# --------------------------------------------------------------------------------------------------
# Summary: mean +- std over seeds, and what is within noise
# --------------------------------------------------------------------------------------------------
def summarize(e: dict) -> dict:
    """Mean +- std over seeds of every stage that ran, on val, and the differences the claims rest on."""
    over = lambda runs, key: spread([r[key]["ap"] for r in runs.values()])  # noqa: E731
    s = {"fp": spread([e["fp"]["val"]["ap"]], fixed=True),
         "ptq": {m: over(runs, "val") for m, runs in e["ptq"].items()},
         "ptq_select": {m: over(runs, "select") for m, runs in e["ptq"].items()}}
    best_ptq = s["ptq"][e["ptq_choice"]]
    s["best_ptq_vs_fp"] = difference(best_ptq, s["fp"])
    s["best_fixed_on_val"] = max(s["ptq"], key=lambda m: s["ptq"][m]["mean"])  # the hardest bar, known only after
    best_fixed = s["ptq"][s["best_fixed_on_val"]]
    if "qat" in e:
        s["auto"] = spread([r["auto"]["val"]["ap"] for r in e["qat"].values()])
        s["auto_vs_best_fixed"] = difference(s["auto"], best_fixed)
        s["qat_best"], s["qat_last"] = over(e["qat"], "val_best"), over(e["qat"], "val_last")
        s["final"] = over(e["qat"], "val_final")
        s["user_gain"] = difference(s["final"], s["fp"])                      # delivered - the float model
        s["final_vs_best_fixed"] = difference(s["final"], best_fixed)
        s["qat_vs_best_ptq"] = difference(s["qat_best"], best_ptq)
    if "fp_ft" in e:
        s["fp_ft_best"], s["fp_ft_last"] = over(e["fp_ft"], "val_best"), over(e["fp_ft"], "val_last")
    if "mixed" in e:
        s["mixed"] = over(e["mixed"], "val_final")
        s["mixed_vs_fp"] = difference(s["mixed"], s["fp"])
        s["mixed_int8_share"] = spread([r["mixed_precision"]["int8_mac_share"] for r in e["mixed"].values()])
        if "fp_ft" in e:
            s["mixed_vs_fp_ft"] = difference(s["mixed"], s["fp_ft_best"])
    if "qat" in e and "fp_ft" in e:
        s["quantization_cost"] = difference(s["final"], s["fp_ft_best"])      # delivered - its float control
    if "ort" in e:  # against the same seeds' delivered checkpoint in PyTorch: that is the file exported
        s["ort"] = {d: over(runs, "val") for d, runs in e["ort"].items()}
        s["ort_vs_pytorch"] = {d: difference(v, spread([e["qat"][seed]["val_final"]["ap"] for seed in e["ort"][d]]))
                               for d, v in s["ort"].items()}
    if "modelopt" in e:
        s["modelopt"] = {m: over(runs, "val") for m, runs in e["modelopt"].items()}
        peer = s["modelopt"][e["modelopt_choice"]]
        s["ptq_vs_modelopt"] = difference(best_ptq, peer)
        if "qat" in e:
            s["qat_vs_modelopt"] = difference(s["qat_best"], peer)
    return s


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------
def entries(out: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob("*/*/entry.json"))]


def model_table(e: dict) -> str:
    """One model: every stage's mAP50-95 on val (mean +- std over seeds) and on select where choices were made."""
    s, seeds = e["summary"], len(e["provenance"]["seeds"])
    not_run = "not run (" + ", ".join(e.get("not_run", [])) + " skipped)"
    rows = [("FP32 (the trained model)", s["fp"], fmt(spread([e["fp"]["select"]["ap"]])))]
    for m in s["ptq"]:
        chosen = " (chosen on select)" if m == e["ptq_choice"] else ""
        rows.append((f"PTQ {m}{chosen}", s["ptq"][m], fmt(s["ptq_select"][m])))
    if "auto" in s:
        chosen = ", ".join(r["auto"]["chosen"] for r in e["qat"].values())
        rows.append((f"PTQ auto, the default (chose {chosen})", s["auto"],
                     fmt(spread([r["auto"]["candidates"][r["auto"]["chosen"]] for r in e["qat"].values()]))))
    for key, name in (("fp_ft_best", "FP fine-tune control, best epoch on select"),
                      ("fp_ft_last", "FP fine-tune control, last epoch"), ("qat_best", "QAT, best epoch on select"),
                      ("qat_last", "QAT, last epoch")):
        rows.append((name, s.get(key), "" if key in s else not_run))
    if "final" in s:
        stages = ", ".join(r["final"]["stage"] + (f" {r['final']['epoch']}" if r["final"]["epoch"] else "")
                           for r in e["qat"].values())
        rows.append((f"**Delivered by the default command** (best on select of PTQ and QAT epochs: {stages})",
                     s["final"], ""))
    if "mixed" in s:
        runs = e["mixed"].values()
        budget = next(iter(runs))["mixed_precision"]["max_loss"]
        kept = ", ".join(str(len(r["mixed_precision"]["float_convs"])) for r in runs)
        rows.append((f"Delivered with --max-loss {budget:g} (convs kept in float per seed: {kept}; INT8 share of "
                     f"conv MACs {fmt(s['mixed_int8_share'])})", s["mixed"], ""))
    for dtype, name in (("fp32", "QAT, FP32 Q/DQ graph in ONNX Runtime"),
                        ("fp16", "QAT, FP16 Q/DQ graph in ONNX Runtime (TensorRT 11's)")):
        rows.append((name, s.get("ort", {}).get(dtype), "" if "ort" in s else not_run))
    for m, v in s.get("modelopt", {}).items():
        chosen = " (chosen on select)" if m == e.get("modelopt_choice") else ""
        rows.append((f"Model Optimizer ONNX PTQ {m}{chosen}", v,
                     fmt(spread([r["select"]["ap"] for r in e["modelopt"][m].values()]))))
    machine_ = e["provenance"]["machine"]
    lines = [f"**{e['model']}** on {e['dataset']} ({e['provenance']['split']['images']['val']} val images, "
             f"imgsz {e['imgsz']}; {seeds} seeds; {machine_['gpu'] or 'CPU: ' + machine_['cpu']}; commit "
             f"{_commit(e['provenance']['commit'])})", "",
             "| Stage | mAP50-95 val, mean ± std (seeds) | mAP50-95 select |", "|---|---|---|"]
    lines += [f"| {name} | {fmt(v)} | {sel} |" for name, v, sel in rows]
    claims = [("Quantization cost (delivered - its FP control)", s.get("quantization_cost")),
              ("Mixed precision - its FP control", s.get("mixed_vs_fp_ft")), ("Mixed precision - FP32", s.get("mixed_vs_fp")),
              ("Delivered - FP32", s.get("user_gain")),
              (f"Delivered - best fixed PTQ on val ({s['best_fixed_on_val']})", s.get("final_vs_best_fixed")),
              (f"PTQ auto - best fixed PTQ on val ({s['best_fixed_on_val']})", s.get("auto_vs_best_fixed")),
              ("QAT best epoch - PTQ chosen on select", s.get("qat_vs_best_ptq")),
              ("PTQ chosen on select - FP32", s.get("best_ptq_vs_fp"))]
    lines += [""] + [f"- {name}: {fmt_difference(d)}" for name, d in claims if d]
    if "ort_vs_pytorch" in s:
        lines.append("- Deployed graphs - PyTorch: " + ", ".join(f"{d} {fmt_difference(v)}"
                                                                  for d, v in s["ort_vs_pytorch"].items()))
    if "modelopt" in s:
        ours = "QAT" if "qat_vs_modelopt" in s else "Best PTQ"
        lint = e["modelopt"][e["modelopt_choice"]][str(e["provenance"]["seeds"][0])]["lint"]
        lines.append(f"- {ours} - Model Optimizer ({e['modelopt_choice']}): "
                     f"{fmt_difference(s.get('qat_vs_modelopt') or s['ptq_vs_modelopt'])}; unshared-scale joins: "
                     f"ours {e['ours_lint']['unshared_joins']}, Model Optimizer {lint['unshared_joins']}")
    return "\n".join(lines)


def _commit(commit: str) -> str:
    """A short commit, marked where the run's working tree held changes beyond it."""
    return commit[:10] + (" with uncommitted changes" if commit.endswith("-dirty") else "")


def training_table(out: Path) -> str:
    """The float models' trainings (scripts/train_float.py): how long, the best select epoch, convergence."""
    rows = []
    for f in sorted(out.glob("*/*/float/train.json")):
        t = json.loads(f.read_text())
        start, end = t["started"], t.get("last_epochs")
        since = f"{t['epochs_since_best']} epoch{'' if t['epochs_since_best'] == 1 else 's'} since the best"
        plateau = "" if not end or end["noise"] is None else \
            f"; last {end['window']}: rise {end['rise']:+.4f}, noise {end['noise']:.4f}"
        gpus = re.search(r"--nproc-per-node (\d+)", start["command"])
        seconds = f"{t['train_seconds'] / 60:.1f} min" if t.get("train_seconds") else "not recorded"
        rows.append(f"| {f.parts[-4]} | {t['model']} | {t['epochs_run']} of {t['max_epochs']} | {t['best_epoch']} | "
                    f"{t['best_select_map']:.4f} | {'yes' if t['converged'] else 'no'} ({since}{plateau}) | "
                    f"{seconds} | {gpus[1] if gpus else 1} x {start['machine']['gpu']} | "
                    f"[curve](../{f.parent.relative_to(out.parent)}/curve.png) |")
    if not rows:
        return "No float training recorded yet."
    return "\n".join(["| Data | Model | Epochs run | Best epoch | Best select mAP50-95 | Converged | Time | GPUs | "
                      "Curve |", "|---|---|---|---|---|---|---|---|---|", *rows])


def costs_table(out: Path) -> str:
    """QAT step vs its float control's step (scripts/benchmark_costs.py)."""
    rows = []
    for f in sorted((out / "costs").glob("*.json")):
        c = json.loads(f.read_text())
        rows.append(f"| {c['model']} | {c['batch_size']} x {c['imgsz']} | {c['machine']['gpu'] or 'CPU'} | "
                    f"{c['control_step_s']['median']:.4f} | {c['qat_step_s']['median']:.4f} | "
                    f"{c['ratio']:.2f}x | {c['steps']} each, interleaved |")
    if not rows:
        return "No cost measurement recorded yet."
    return "\n".join(["| Model | Batch x size | GPU | FP control step (s, median) | QAT step (s, median) | QAT / FP | "
                      "Steps |", "|---|---|---|---|---|---|---|", *rows])


def demo_table(out: Path) -> str:
    """The demo's last recorded run (scripts/demo.sh with RECORD=1)."""
    f = out / "demo" / "demo.json"
    if not f.is_file():
        return "No demo run recorded yet."
    d = json.loads(f.read_text())
    return (f"{d['table']}\n\n({d['where']}, {d['date']}, commit {d['commit'][:10]}: {d['minutes']:.1f} min in all; "
            f"{d['data']}. A single run: the calibration method and the delivered stage were chosen on "
            f"{d['report']['select']['images']} held-out training images (the select rows), the other rows are "
            f"measured on the val images; it shows the workflow runs, not an accuracy claim (the table below is "
            f"that); on another CPU a few INT8 roundings flip and these figures move a little.)")


def ablation_table(out: Path) -> str:
    """Recipe variants on the select split (scripts/benchmark_accuracy.py --ablation): each dataset's latest
    (ablation.json) first, then earlier ones kept under another name (ablation-COMMIT.json)."""
    parts = []
    for f in sorted(out.glob("*/*/ablation*.json"), key=lambda f: (f.parent, f.name != "ablation.json", f.name)):
        a = json.loads(f.read_text())
        select = a["provenance"]["split"]["images"]["select"]
        lines = [f"**{a['model']}** on {a['dataset']}, select split ({select} images), from PTQ {a['calibration']} "
                 f"({len(a['provenance']['seeds'])} seeds, commit {_commit(a['provenance']['commit'])})", "",
                 "| Variant | What | Best-epoch mAP50-95 on select | vs default | Last epoch | vs default | "
                 "Delivered (best of PTQ and epochs) | vs default |",
                 "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {v} | {r['what']} | {fmt(r['select_best'])} | {fmt_difference(r['vs_default'])} | "
                  + " | ".join(f"{fmt(r[column])} | {fmt_difference(r[vs])}" if column in r else "not recorded | "
                               for column, vs in (("select_last", "last_vs_default"),
                                                  ("select_delivered", "delivered_vs_default"))) + " |"
                  for v, r in a["variants"].items()]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else "No ablation recorded yet."


PARTS = {"": "weights and activations (QAT, the default command)", "weights": "activations only (weights float)",
         "activations": "weights only (activations float)", "all": "nothing (the float control)"}


def _run_settings(run: dict) -> dict:
    """What must match for a kept run to sit beside an entry's runs: select images, size, batch, schedule."""
    if "config" in run:  # a qat.py report.json
        c = run["config"]
        return {"select": run["select"]["fingerprint"], "imgsz": c["imgsz"], "batch_size": c["batch_size"],
                "epochs": c["epochs"], "iters": c["iters"], "calib_batches": c["quant"]["calib_batches"]}
    s = run["settings"]
    return {"select": run["provenance"]["split"]["fingerprint"]["select"], "imgsz": s["imgsz"],
            "batch_size": s["batch_size"], "epochs": s["qat_epochs"], "iters": s["iters"],
            "calib_batches": s["calib_batches"]}


def _delivered_on_select(run: dict) -> float:
    """An entry's default run: the delivered model's select mAP, the best of its PTQ (auto) and every QAT epoch."""
    return max(run["auto"]["candidates"][run["auto"]["chosen"]], *run["select_by_epoch"])


def _entry_beside(folder: Path) -> dict:
    """The entry an experiment's runs are set beside: `folder/entry.json` where the experiment names one (the entry
    made on the machine its runs ran on: hosts of one kind differ by more than these differences), else the
    model's current entry."""
    own = folder / "entry.json"
    return json.loads((own if own.is_file() else folder.parent / "entry.json").read_text())


def _comparable_reports(folder: Path, entry: dict, ignore: tuple[str, ...] = ()) -> list[dict]:
    """The qat.py report.json files kept in `folder`, each a finished run with the entry's settings (`ignore`
    aside); anything else is refused: its numbers would not be comparable."""
    want = {k: v for k, v in _run_settings(entry).items() if k not in ignore}
    reports = []
    for f in sorted(p for p in folder.glob("*.json") if p.name != "entry.json"):
        r = json.loads(f.read_text())
        got = {k: v for k, v in _run_settings(r).items() if k not in ignore}
        if got != want or not r.get("finished"):
            raise ValueError(f"{f}: an unfinished run or one made with other settings than the entry's ({got} vs "
                             f"{want}): its numbers are not comparable")
        reports.append(r)
    return reports


def partial_control_table(out: Path) -> str:
    """Which quantizers keep QAT from following its float control: `qat.py quantize --float-control PART` runs
    (OUT/<dataset>/<model>/partial-control/*.json, their report.json files) beside the entry's QAT and float
    control of the same seeds, select split and settings, each judged on select (best and last epoch)."""
    parts = []
    for folder in sorted(out.glob("*/*/partial-control")):
        e = _entry_beside(folder)
        reports = _comparable_reports(folder, e)
        runs = {"": {str(k): r["select_by_epoch"] for k, r in e["qat"].items()},
                "all": {str(k): r["select_by_epoch"] for k, r in e["fp_ft"].items()}}
        val = {"": [r["val_best"]["ap"] for r in e["qat"].values()],
               "all": [r["val_best"]["ap"] for r in e["fp_ft"].values()]}
        for r in reports:
            runs.setdefault(r["config"]["control"], {})[str(r["config"]["seed"])] = [q["ap"] for q in r["qat"]]
            val.setdefault(r["config"]["control"], []).append(r["val"]["final"]["ap"])
        best = {part: spread([max(v) for v in r.values()]) for part, r in runs.items()}
        last = {part: spread([v[-1] for v in r.values()]) for part, r in runs.items()}
        lines = [f"**{e['model']}** on {e['dataset']}, select split ({e['provenance']['split']['images']['select']} "
                 f"images), {e['settings']['qat_epochs']} x {e['settings']['iters']} iterations, seeds "
                 f"{', '.join(sorted(runs['']))}", "",
                 "| INT8 during the fine-tune | Best epoch on select | vs QAT | Last epoch | vs QAT | "
                 "Best epoch on val |", "|---|---|---|---|---|---|"]
        lines += [f"| {PARTS[p]} | {fmt(best[p])} | {fmt_difference(difference(best[p], best['']))} | {fmt(last[p])} | "
                  f"{fmt_difference(difference(last[p], last['']))} | {fmt(spread(val[p]))} |"
                  for p in sorted(runs, key=list(PARTS).index)]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else "No partial control recorded yet."


def float_first_table(out: Path) -> str:
    """Whether a float fine-tune's gain survives INT8: `qat.py quantize --float-epochs F` runs
    (OUT/<dataset>/<model>/float-first/*.json, their report.json files): the float model after F epochs (the float
    control's first F), PTQ of it (auto), the QAT epochs after it and the delivered model, beside the entry's default
    runs (F = 0: PTQ of the float model as trained) of the same select split and settings."""
    parts = []
    for folder in sorted(out.glob("*/*/float-first")):
        e = _entry_beside(folder)
        rows: dict[int, dict[str, list[float]]] = {0: {
            "float": [e["fp"]["select"]["ap"]] * len(e["qat"]),
            "ptq": [r["auto"]["candidates"][r["auto"]["chosen"]] for r in e["qat"].values()],
            "qat": [max(r["select_by_epoch"]) for r in e["qat"].values()],
            "delivered": [_delivered_on_select(r)
                          for r in e["qat"].values()],
            "val": [r["val_final"]["ap"] for r in e["qat"].values()]}}
        for r in _comparable_reports(folder, e):
            k, epochs = r["config"]["float_epochs"], r["qat"]
            row = rows.setdefault(k, {})
            for column, value in (("float", epochs[k - 1]["ap"]), ("ptq", r["recalibrated"]["metrics"]["ap"]),
                                  ("qat", max(x["ap"] for x in epochs if x["stage"] == "qat")),
                                  ("delivered", r["final"]["ap"]), ("val", r["val"]["final"]["ap"])):
                row.setdefault(column, []).append(value)
        lines = [f"**{e['model']}** on {e['dataset']}, select split ({e['provenance']['split']['images']['select']} "
                 f"images), {e['settings']['qat_epochs']} x {e['settings']['iters']} iterations, 3 seeds", "",
                 "| Float epochs before PTQ | Float model, select | PTQ (auto), select | PTQ - float | "
                 "QAT after it, best epoch | Delivered, select | Delivered, val |", "|---|---|---|---|---|---|---|"]
        for k, row in sorted(rows.items()):
            c = {column: spread(values) for column, values in row.items()}
            lines.append(f"| {k}{' (the default command)' if not k else ''} | {fmt(c['float'])} | {fmt(c['ptq'])} | "
                         f"{fmt_difference(difference(c['ptq'], c['float']))} | {fmt(c['qat'])} | "
                         f"{fmt(c['delivered'])} | {fmt(c['val'])} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else "No float-first run recorded yet."


def longer_table(out: Path) -> str:
    """QAT and its float control over more epochs: `qat.py quantize --epochs N` runs, with and without
    `--float-control` (OUT/<dataset>/<model>/longer/*.json, their report.json files), beside the entry's runs of the
    same select split and settings but its number of epochs; delivered models (best on select) on select and val."""
    parts = []
    for folder in sorted(out.glob("*/*/longer")):
        e = _entry_beside(folder)
        runs: dict[int, dict[str, dict[str, list[float]]]] = {e["settings"]["qat_epochs"]: {
            "qat": {"select": [_delivered_on_select(r)
                               for r in e["qat"].values()],
                    "val": [r["val_final"]["ap"] for r in e["qat"].values()]},
            "control": {"select": [max(r["select_by_epoch"]) for r in e["fp_ft"].values()],
                        "val": [r["val_best"]["ap"] for r in e["fp_ft"].values()]}}}
        for r in _comparable_reports(folder, e, ignore=("epochs",)):
            arm_name = "control" if r["config"]["control"] else "qat"
            arm = runs.setdefault(r["config"]["epochs"], {}).setdefault(arm_name, {})
            arm.setdefault("select", []).append(r["final"]["ap"])
            arm.setdefault("val", []).append(r["val"]["final"]["ap"])
        fp = {"mean": e["fp"]["val"]["ap"], "std": 0.0, "n": 1, "values": [e["fp"]["val"]["ap"]], "fixed": True}
        lines = [f"**{e['model']}** on {e['dataset']}, select split ({e['provenance']['split']['images']['select']} "
                 f"images), {e['settings']['iters']} iterations per epoch, delivered models (best on select)", "",
                 "| Epochs | QAT, select | Float control, select | QAT - control, select | QAT, val | "
                 "Float control, val | QAT - control, val | QAT - float model, val |",
                 "|---|---|---|---|---|---|---|---|"]
        for epochs, arms in sorted(runs.items()):
            q, c = ({k: spread(v) for k, v in arms[a].items()} for a in ("qat", "control"))
            cells = [f"{epochs}{' (the entry)' if epochs == e['settings']['qat_epochs'] else ''}", fmt(q["select"]),
                     fmt(c["select"]), fmt_difference(difference(q["select"], c["select"])), fmt(q["val"]),
                     fmt(c["val"]), fmt_difference(difference(q["val"], c["val"])),
                     fmt_difference(difference(q["val"], fp))]
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else "No longer run recorded yet."


def rendered(out: Path, docs: bool) -> dict[Path, dict[str, str]]:
    """Every rendered block, by file: OUT/accuracy.md, and with `docs` this repository's docs/RESULTS.md and
    README.md (nothing outside --out otherwise)."""
    tables = [model_table(e) for e in entries(out)]
    accuracy = "\n\n".join(tables) if tables else "No benchmark entry yet."
    files = {out / "accuracy.md": {"accuracy": accuracy}}
    if docs:
        files[REPO / "docs" / "RESULTS.md"] = {"accuracy": accuracy, "float-training": training_table(out),
                                               "ablation": ablation_table(out), "costs": costs_table(out),
                                               "partial-control": partial_control_table(out),
                                               "float-first": float_first_table(out),
                                               "longer": longer_table(out)}
        files[REPO / "README.md"] = {"accuracy": accuracy, "demo": demo_table(out)}
    return files


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="helmet", help="label of the data (entries are grouped by it)")
    p.add_argument("--data", help="dataset.yaml (train and val); the select split is carved from train")
    p.add_argument("--models", nargs="*", default=[], help="NAME=weights.pt (trained, converted float models)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", choices=sorted(CALIBRATIONS), default=list(CALIBRATIONS))
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--device", default="0")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--qat-epochs", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--qat-args", default="", help="extra qat.py quantize flags for QAT and its control")
    p.add_argument("--workers", type=int, default=8, help="dataloader workers per run")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time in each of two phases side by side")
    p.add_argument("--ort-seeds", type=int, default=None,
                   help="the first N seeds' delivered graphs measured in ONNX Runtime (default: every seed)")
    p.add_argument("--modelopt", action="store_true", help="also run NVIDIA Model Optimizer's ONNX PTQ")
    p.add_argument("--max-loss", type=float, default=None,
                   help="also run the default command with this mixed-precision budget (qat.py quantize --max-loss)")
    p.add_argument("--ablation", nargs="*", choices=sorted(ABLATION), default=None, metavar="VARIANT",
                   help=f"also run these QAT recipe variants beside the default, judged on select (none named: all "
                        f"of {', '.join(ABLATION)})")
    p.add_argument("--skip", nargs="*", choices=("qat", "fp_ft", "ort"), default=[],
                   help="stages left out (e.g. on a CPU, where fine-tuning takes hours); the entry says so")
    p.add_argument("--work", type=Path, default=Path("runs/benchmark"), help="run folders, logs, models")
    p.add_argument("--out", type=Path, default=REPO / "results", help="entries and rendered tables")
    p.add_argument("--render", action="store_true", help="only render the tables from the entries")
    p.add_argument("--check", action="store_true", help="with --render: fail if a rendered file is out of date")
    p.add_argument("--docs", action="store_true",
                   help="also render this repository's README.md and docs/RESULTS.md from --out (default: only --out)")
    opt = p.parse_args(argv)
    opt.models = dict(_pairs(p, opt.models))
    for name, weights in opt.models.items():
        if not Path(weights).is_file():
            p.error(f"--models {name}={weights}: file not found")
    if opt.models and not (opt.data and Path(opt.data).is_file()):
        p.error(f"--data {opt.data}: file not found")
    if len(set(opt.seeds)) < len(opt.seeds):
        p.error(f"--seeds {' '.join(map(str, opt.seeds))}: repeated")
    if opt.modelopt and importlib.util.find_spec("modelopt") is None:
        p.error("--modelopt: nvidia-modelopt is not installed (./install_dependencies.sh --modelopt)")
    if opt.check and not opt.render:
        p.error("--check goes with --render")
    return opt


def _pairs(parser, items):
    for item in items:
        name, _, value = item.partition("=")
        if not name or not value:
            parser.error(f"--models {item}: expected NAME=weights.pt")
        yield name, value


def render(out: Path, check: bool, docs: bool) -> int:
    try:
        files = rendered(out, docs)
        diffs = render_files(files, check)
    except ValueError as e:  # a file whose markers were removed, results that do not fit: name it, write nothing
        print(f"benchmark_accuracy: error: {e}", file=sys.stderr)
        return 1
    if check and diffs:
        print("\n".join(diffs))
        print("benchmark_accuracy: the files above are not what the results JSON renders to; run "
              "`python scripts/benchmark_accuracy.py --render`", file=sys.stderr)
        return 1
    print(f"benchmark_accuracy: {'checked' if check else 'rendered'} {len(files)} files")
    return 0


def main(argv=None) -> int:
    opt = parse_opt(argv)
    if opt.render:
        return render(opt.out, opt.check, opt.docs)
    bench = Bench(opt.dataset, str(Path(opt.data).resolve()), opt.imgsz, opt.device, opt.batch_size, opt.workers,
                  tuple(opt.seeds), tuple(opt.methods), opt.qat_epochs, opt.iters, opt.calib_batches,
                  tuple(shlex.split(opt.qat_args)), opt.modelopt, tuple(opt.skip), opt.jobs,
                  opt.ort_seeds or len(opt.seeds), opt.work.resolve(), opt.out.resolve(), opt.max_loss)
    ablation = () if opt.ablation is None else tuple(opt.ablation) or tuple(ABLATION)
    for name, weights in opt.models.items():
        try:
            entry = ModelBench(bench, name, Path(weights)).run(ablation)
        except RuntimeError as e:  # a step that failed (its log's tail), or a folder of another run: no traceback
            print(f"benchmark_accuracy: error: {e}", file=sys.stderr)
            return 1
        print(model_table(entry), flush=True)
    return render(opt.out, check=False, docs=opt.docs)


if __name__ == "__main__":
    sys.exit(main())
