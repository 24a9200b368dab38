#!/usr/bin/env python3
"""Accuracy benchmark: float vs our PTQ (each calibration method) vs our QAT vs NVIDIA Model Optimizer's ONNX PTQ,
each in PyTorch and as the deployed Q/DQ ONNX run by ONNX Runtime, plus the TensorRT-readiness lint of each graph.

    python scripts/benchmark_accuracy.py --dataset helmet --data /data/helmet-416/data.yaml --imgsz 416 \\
        --models gelan-s=gelan-s.pt gelan-c=gelan-c.pt --device 0 --jobs 3 [--modelopt] [--ablation gelan-s]
    python scripts/benchmark_accuracy.py --merge            # rebuild OUT/accuracy.json + .md from the finished parts

Run from the patched YOLOv9 checkout. Every step is a run of this toolkit's own commands (qat.py, export_qat.py,
val_trt.py) or of `python -m modelopt.onnx.quantization`, and is skipped when its output exists, so a call that
ran out of time resumes. Results: OUT/<dataset>/<model>/entry.json per model, OUT/<dataset>/<model>/ablation.json
for `--ablation`, merged into OUT/accuracy.json and OUT/accuracy.md (`--merge`, also done after each model).
Model Optimizer (`pip install nvidia-modelopt[onnx]`) is a benchmark dependency only; `--modelopt` says so
when it is missing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from utils.io_utils import atomic_write  # noqa: E402
from utils.qat_utils import write_json  # noqa: E402

DATASETS = ("helmet", "demo")
CALIBRATIONS = {"max": ["--calib-method", "max"], "mse": ["--calib-method", "mse"],
                "percentile-99.99": ["--calib-method", "percentile", "--percentile", "99.99"],
                "percentile-99.999": ["--calib-method", "percentile", "--percentile", "99.999"],
                "entropy": ["--calib-method", "entropy"]}
MODELOPT_METHODS = ("entropy", "max")  # its default first
# One factor at a time from the reference recipe; every variant spells out all recipe fields it relies on.
_REF = ["--recipe", "reference"]
_HEAD = ["--distill", "head", "--lr-schedule", "cosine"]
ABLATION = {
    "lr0": ("sanity: reference loop at lr 0 (must equal PTQ)", [*_REF, "--lr", "0"]),
    "reference": ("per-layer MSE, Adam 1e-5, step schedule", _REF),
    "layers-1e-4": ("per-layer MSE, lr 1e-4 cosine", [*_REF, "--lr", "1e-4", "--lr-schedule", "cosine"]),
    "head-1e-5": ("head outputs (class BCE + box KL), lr 1e-5 cosine", [*_REF, *_HEAD, "--lr", "1e-5"]),
    "head-1e-4": ("head outputs, lr 1e-4 cosine", [*_REF, *_HEAD, "--lr", "1e-4"]),
    "head+det": ("head outputs + detection loss on labels, lr 1e-4", [*_REF, *_HEAD, "--lr", "1e-4", "--det-loss", "1"]),
    "det-only": ("detection loss on labels only, lr 1e-4", [*_REF, "--distill", "none", "--lr-schedule", "cosine",
                                                            "--lr", "1e-4", "--det-loss", "1"]),
    "head+amax": ("head outputs + learned amax, lr 1e-4", [*_REF, *_HEAD, "--lr", "1e-4", "--learn-amax"]),
    "head+ema": ("head outputs + weight EMA 0.995, lr 1e-4", [*_REF, *_HEAD, "--lr", "1e-4", "--ema", "0.995"]),
    "head+det+amax+ema": ("all of the above", [*_REF, *_HEAD, "--lr", "1e-4", "--det-loss", "1", "--learn-amax",
                                               "--ema", "0.995"]),
}


# --------------------------------------------------------------------------------------------------
# Steps (each skipped when its output exists)
# --------------------------------------------------------------------------------------------------
def _run(cmd: list[str], log: Path) -> None:
    print("+ " + shlex.join(cmd), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        tail = log.read_text()[-1500:]
        raise RuntimeError(f"{shlex.join(cmd)} failed (exit {r.returncode}); log {log}:\n{tail}")


def qat_run(args: list[str], save_dir: Path) -> dict:
    report = save_dir / "report.json"
    if not (report.is_file() and json.loads(report.read_text()).get("finished")):
        resume = ["--resume", str(save_dir)] if report.is_file() else \
            [*args, "--project", str(save_dir.parent), "--name", save_dir.name, "--exist-ok"]
        _run([sys.executable, "qat.py", "quantize", *resume], save_dir.with_suffix(".log"))
    return json.loads(report.read_text())


def val_onnx(onnx_file: Path, data: str, imgsz: int, out: Path) -> dict:
    """mAP of an ONNX model in ONNX Runtime (val_trt.py, square letterbox)."""
    return _val_trt(["--onnx-file", str(onnx_file)], data, imgsz, out)


def val_torch(weights: Path, data: str, imgsz: int, out: Path, device: str) -> dict:
    """The same loop and letterbox in PyTorch: what the ONNX Runtime figure is compared with."""
    return _val_trt(["--weights", str(weights), "--device", device], data, imgsz, out)


def _val_trt(source: list[str], data: str, imgsz: int, out: Path) -> dict:
    result = out / "val_trt.json"
    if not result.is_file():
        _run([sys.executable, "val_trt.py", *source, "--data", data, "--imgsz", str(imgsz), "--batch-size", "8",
              "--project", str(out.parent), "--name", out.name, "--exist-ok"], out.with_suffix(".log"))
    return json.loads(result.read_text())


def export_onnx(weights: Path, imgsz: int, precision: str = "fp32") -> Path:
    """FP32 graphs by default: the arithmetic of the PyTorch fake-quant model (what the ONNX Runtime figure is
    compared with) and Model Optimizer's expected input; fp16 for the strongly typed deployment graph."""
    onnx_file = weights.with_name(f"{weights.stem}-{precision}.onnx")
    if not onnx_file.is_file():
        copy = weights.with_name(onnx_file.stem + ".pt")  # export_qat writes beside its input, named after it
        shutil.copyfile(weights, copy)
        _run([sys.executable, "export_qat.py", "--weights", str(copy), "--include", "onnx", "--dynamic",
              "--imgsz", str(imgsz), "--precision", precision, "--exist-ok"], weights.parent / f"{copy.stem}.export.log")
        copy.unlink()
    return onnx_file


def lint_summary(onnx_file: Path, share_add_inputs: bool = True) -> dict:
    from utils.qdq_lint import lint_file
    report = lint_file(onnx_file, share_add_inputs)
    return {"qdq_nodes": report.quantize_nodes, "convs": report.convs, "quantized_convs": report.quantized_convs,
            "unshared_joins": len(report.unshared_joins), "unquantized_convs": len(report.unquantized_convs),
            "precision": report.precision, "fp32_compute": len(report.fp32_compute)}


def calibration_images(data: str, imgsz: int, n: int, path: Path) -> Path:
    """`n` training images, square-letterboxed as val_trt.py feeds them, as one float32 array (Model Optimizer's
    --calibration_data_path)."""
    if path.is_file():
        return path
    import numpy as np
    from utils.dataloaders import LoadImages
    from utils.qat_utils import load_data
    train = load_data(data)["train"]
    images = []
    for _, im, *_ in LoadImages(train[0] if isinstance(train, list) else train, img_size=imgsz, stride=32,
                                auto=False):
        images.append(im.astype(np.float32) / 255)
        if len(images) == n:
            break
    atomic_write(path, lambda tmp: np.save(open(tmp, "wb"), np.stack(images)))
    return path


def modelopt_ptq(fp_onnx: Path, calib: Path, method: str, out: Path) -> Path:
    """NVIDIA Model Optimizer's ONNX INT8 PTQ (CPU calibration, FP32 graph like ours)."""
    if not out.is_file():
        _run([sys.executable, "-m", "modelopt.onnx.quantization", "--onnx_path", str(fp_onnx), "--quantize_mode",
              "int8", "--calibration_method", method, "--calibration_data_path", str(calib), "--calibration_eps",
              "cpu", "--high_precision_dtype", "fp32", "--output_path", str(out)], out.with_suffix(".log"))
    return out


# --------------------------------------------------------------------------------------------------
# One model
# --------------------------------------------------------------------------------------------------
def benchmark_model(name: str, weights: Path, data: str, dataset: str, imgsz: int, device: str, batch_size: int,
                    qat_epochs: int, iters: int, qat_args: list[str], out: Path, jobs: int, workers: int,
                    calib_batches: int, modelopt: bool, calib_images: int, train_epochs: int | None,
                    ort_all_ptq: bool = False) -> dict:
    root = out / dataset / name
    common = ["--weights", str(weights), "--data", data, "--imgsz", str(imgsz), "--device", device,
              "--batch-size", str(batch_size), "--calib-batches", str(calib_batches), "--workers", str(workers)]
    with ThreadPoolExecutor(jobs) as pool:
        ptq = dict(zip(CALIBRATIONS, pool.map(
            lambda m: qat_run([*common, *CALIBRATIONS[m], "--epochs", "0",
                               *([] if m == "max" else ["--no-eval-origin"])], root / f"ptq-{m}"), CALIBRATIONS)))
    best_method = max(ptq, key=lambda m: ptq[m]["ptq"]["ap"])
    qat_args = qat_args() if callable(qat_args) else qat_args
    # Model Optimizer calibrates on the CPU (ONNX Runtime): it runs beside QAT, which holds the GPU
    with ThreadPoolExecutor(1) as peer_pool:
        peer = peer_pool.submit(modelopt_peer, weights, data, imgsz, root, calib_images) if modelopt else None
        qat = qat_run([*common, *CALIBRATIONS[best_method], "--epochs", str(qat_epochs), "--iters", str(iters),
                       "--no-eval-origin", *qat_args], root / "qat")
    entry = {"model": name, "dataset": dataset, "data": data, "weights": str(weights), "imgsz": imgsz,
             "train_epochs": train_epochs, "where": _gpu_name(device), "fp": ptq["max"]["origin"],
             "ptq": {m: {**r["ptq"], "calib_s": r["timing"]["calib_collect_s"] + r["timing"]["calib_amax_s"]}
                     for m, r in ptq.items()},
             "qat_calibration": best_method, "qat_recipe": qat["qat_recipe"], "qat_args": qat_args,
             "qat_epochs": qat["qat"], "qat": {k: qat["qat_best"][k] for k in ("ap", "ap50", "precision", "recall",
                                                                               "epoch")}}
    # deployed graphs in ONNX Runtime (QAT and the best PTQ; --ort-all-ptq: every PTQ method), and the same .pt
    # through the same loop in PyTorch
    qat_best = Path(qat["qat_best_file"])
    deploy = {f"ptq-{m}": Path(r["ptq_file"]) for m, r in ptq.items() if ort_all_ptq or m == best_method}
    deploy["qat"] = qat_best
    with ThreadPoolExecutor(max(1, jobs // 2)) as pool:
        onnx_files = dict(zip(deploy, pool.map(lambda w: export_onnx(w, imgsz), deploy.values())))
    onnx_files["qat-fp16"] = export_onnx(qat_best, imgsz, "fp16")  # the graph TensorRT 11 builds
    entry["ort"] = {k: val_onnx(f, data, imgsz, root / f"ort-{k}") for k, f in onnx_files.items()}
    entry["torch_square"] = {"qat": val_torch(qat_best, data, imgsz, root / "torch-qat", device)}
    entry["lint"] = {k: lint_summary(f) for k, f in onnx_files.items() if k in ("qat", "qat-fp16", f"ptq-{best_method}")}
    if peer is not None:
        entry["modelopt"] = peer.result()
    write_json(root / "entry.json", entry)
    return entry


def modelopt_peer(weights: Path, data: str, imgsz: int, root: Path, calib_images: int) -> dict:
    if importlib.util.find_spec("modelopt") is None:
        raise RuntimeError("--modelopt: nvidia-modelopt is not installed (pip install 'nvidia-modelopt[onnx]'); "
                           "it is a benchmark dependency only")
    fp_copy = root / f"fp-{weights.name}"  # the float ONNX is written beside its .pt: not into the user's folder
    if not fp_copy.is_file():
        shutil.copyfile(weights, fp_copy)
    fp_onnx = export_onnx(fp_copy, imgsz, "fp32")
    calib = calibration_images(data, imgsz, calib_images, root.parent / f"modelopt-calib-{imgsz}-{calib_images}.npy")
    results = {}
    for method in MODELOPT_METHODS:
        q = modelopt_ptq(fp_onnx, calib, method, root / f"modelopt-{method}.onnx")
        results[method] = {**val_onnx(q, data, imgsz, root / f"ort-modelopt-{method}"), "lint": lint_summary(q),
                           "calib_images": calib_images}
    return results


def ablation(name: str, weights: Path, data: str, dataset: str, imgsz: int, device: str, batch_size: int,
             qat_epochs: int, iters: int, out: Path, jobs: int, workers: int, calib_batches: int,
             calib_method: str) -> dict:
    """QAT variants from the same PTQ model (calibration is seeded: every run starts from the same amax), plus
    PTQ without the TensorRT scale-sharing rules (what the rules cost in accuracy)."""
    root = out / dataset / name / "ablation"
    common = ["--weights", str(weights), "--data", data, "--imgsz", str(imgsz), "--device", device,
              "--batch-size", str(batch_size), "--calib-batches", str(calib_batches), "--workers", str(workers),
              *CALIBRATIONS[calib_method], "--no-eval-origin", "--epochs", str(qat_epochs), "--iters", str(iters)]
    with ThreadPoolExecutor(jobs) as pool:
        runs = dict(zip(ABLATION, pool.map(lambda v: qat_run([*common, *ABLATION[v][1]], root / v), ABLATION)))
    rows = {v: {"description": ABLATION[v][0], "args": ABLATION[v][1], "recipe": r["qat_recipe"], "ptq": r["ptq"],
                "epochs": [{k: e[k] for k in ("epoch", "ap", "ap50", "loss", "distill", "det") if k in e}
                           for e in r["qat"]], "best": {k: r["qat_best"][k] for k in ("ap", "ap50", "epoch")}}
            for v, r in runs.items()}
    result = {"model": name, "dataset": dataset, "calib_method": calib_method, "qat_epochs": qat_epochs,
              "iters": iters, "batch_size": batch_size, "variants": rows, "table": ablation_table(rows)}
    write_json(root.parent / "ablation.json", result)
    atomic_write(root.parent / "ablation.md", lambda tmp: Path(tmp).write_text(result["table"] + "\n"))
    print(result["table"], flush=True)
    return result


def best_variant_args(ablation_json: Path, wait_s: float = 0) -> list[str]:
    """The qat.py flags of the ablation's best variant (by best-epoch mAP50-95; the lr-0 sanity run excluded),
    waiting up to `wait_s` for an ablation that another process is running."""
    deadline = time.monotonic() + wait_s
    while not ablation_json.is_file() and time.monotonic() < deadline:
        time.sleep(10)
    if not ablation_json.is_file():
        raise FileNotFoundError(f"--qat-from-ablation: {ablation_json} not found; run --ablation first")
    rows = json.loads(ablation_json.read_text())["variants"]
    best = max((v for v in rows if v != "lr0"), key=lambda v: rows[v]["best"]["ap"])
    print(f"benchmark_accuracy: QAT recipe from the ablation's best variant {best!r}: {rows[best]['description']}",
          flush=True)
    return list(rows[best]["args"])


def _gpu_name(device: str) -> str:
    import torch
    return torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------
def ablation_table(rows: dict) -> str:
    n = max(len(r["epochs"]) for r in rows.values())
    head = ["Variant", "What", "PTQ", *[f"ep {i + 1}" for i in range(n)], "Best (epoch)", "vs PTQ", "Loss first -> last"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v, r in rows.items():
        eps = [f"{e['ap']:.4f}" for e in r["epochs"]] + ["-"] * (n - len(r["epochs"]))
        loss = f"{r['epochs'][0]['loss']:.4g} -> {r['epochs'][-1]['loss']:.4g}" if r["epochs"] else "-"
        lines.append(f"| {v} | {r['description']} | {r['ptq']['ap']:.4f} | " + " | ".join(eps) +
                     f" | {r['best']['ap']:.4f} ({r['best']['epoch']}) | {r['best']['ap'] - r['ptq']['ap']:+.4f} | {loss} |")
    return "\n".join(lines)


def accuracy_table(entries: list[dict]) -> str:
    """Markdown: one row per model and stage, PyTorch and ONNX Runtime side by side, delta to float."""
    lines = ["| Data | Where | Model | Stage | mAP50-95 PyTorch | mAP50-95 ONNX Runtime | mAP50 | delta vs FP | "
             "lint: unshared joins |", "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        fp = e["fp"]["ap"]
        ort, lint = e.get("ort", {}), e.get("lint", {})

        def row(stage, torch_m, ort_m=None, lint_key=None):
            t = f"{torch_m['ap']:.4f}" if torch_m else "-"
            o = f"{ort_m['ap']:.4f}" if ort_m else "-"
            ap50 = (torch_m or ort_m)["ap50"]
            delta = (torch_m or ort_m)["ap"] - fp
            joins = lint.get(lint_key, {}).get("unshared_joins", "-") if lint_key else "-"
            ap50 = f"{ap50:.4f}" if ap50 is not None else "-"
            lines.append(f"| {e['dataset']} | {e['where']} | {e['model']} | {stage} | {t} | {o} | {ap50} | {delta:+.4f} | "
                         f"{joins} |")
        row(f"FP32 ({e.get('train_epochs') or '?'} training epochs)", e["fp"])
        for m, r in e["ptq"].items():
            row(f"PTQ {m}", r, ort.get(f"ptq-{m}"), f"ptq-{m}")
        recipe = e.get("qat_recipe", {})
        what = ", ".join(f"{k} {v}" for k, v in recipe.items() if k in ("distill", "det_loss", "lr") and v)
        row(f"QAT ({e['qat_calibration']}; {what}), best epoch {e['qat']['epoch']}", e["qat"], ort.get("qat"), "qat")
        if ort.get("qat-fp16"):
            row("QAT, FP16 Q/DQ graph (TensorRT 11's)", None, ort["qat-fp16"], "qat-fp16")
        if e.get("torch_square"):
            row("QAT, PyTorch through val_trt.py (the ONNX Runtime row's letterbox)", e["torch_square"]["qat"])
        for m, r in e.get("modelopt", {}).items():
            lines.append(f"| {e['dataset']} | {e['where']} | {e['model']} | Model Optimizer ONNX PTQ ({m}, "
                         f"{r['calib_images']} images) | - | {r['ap']:.4f} | {r['ap50']:.4f} | {r['ap'] - fp:+.4f} | "
                         f"{r['lint']['unshared_joins']} |")
    return "\n".join(lines)


def segmentation_table(entries: list[dict]) -> str:
    """Markdown: box and mask mAP50-95 per stage, and the deployed graph in ONNX Runtime next to PyTorch."""
    lines = ["| Data | Model | FP32 box / mask | PTQ mse | QAT best (epoch) | ONNX Runtime | PyTorch, same loop |",
             "|---|---|---|---|---|---|---|"]
    pair = lambda m: f"{m['ap']:.4f} / {m['mask_ap']:.4f}"  # noqa: E731
    for e in entries:
        lines.append(f"| {e['data']} | {e['model']} ({e['train_epochs']} epochs) | {pair(e['fp'])} | "
                     f"{pair(e['ptq']['mse'])} | {pair(e['qat'])} ({e['qat']['epoch']}) | {pair(e['ort']['qat'])} | "
                     f"{pair(e['torch_square']['qat'])} |")
    return "\n".join(lines)


def merge(out: Path) -> dict:
    """OUT/accuracy.json and .md from the detection entries (OUT/<dataset>/<model>/entry.json) and the
    segmentation entries (OUT/segment/*.json, written from `qat.py quantize` and `val_trt.py` runs)."""
    entries = [json.loads(f.read_text()) for d in DATASETS for f in sorted((out / d).glob("*/entry.json"))]
    entries.sort(key=lambda e: (DATASETS.index(e["dataset"]), e["where"] == "cpu", e["model"]))
    segment = [json.loads(f.read_text()) for f in sorted((out / "segment").glob("*.json"))]
    table = accuracy_table(entries) if entries else ""
    if segment:
        table += "\n\nSegmentation (mAP50-95, box / mask):\n\n" + segmentation_table(segment)
    result = {"entries": entries, "segment": segment, "table": table}
    write_json(out / "accuracy.json", result)
    atomic_write(out / "accuracy.md", lambda tmp: Path(tmp).write_text(result["table"] + "\n"))
    return result


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="helmet", help="label of the data (rows are grouped by it)")
    p.add_argument("--data", help="dataset.yaml")
    p.add_argument("--models", nargs="*", default=[], help="NAME=weights.pt (trained, converted float models)")
    p.add_argument("--train-epochs", nargs="*", default=[], help="NAME=EPOCHS: how long each model was trained")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--device", default="0")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--qat-epochs", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--qat-args", default="", help="extra qat.py quantize flags for the QAT rows, e.g. '--lr 1e-4'")
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--workers", type=int, default=8, help="dataloader workers per run")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (PTQ methods, ablation variants)")
    p.add_argument("--modelopt", action="store_true", help="also run NVIDIA Model Optimizer's ONNX PTQ")
    p.add_argument("--calib-images", type=int, default=512, help="Model Optimizer calibration images")
    p.add_argument("--ablation", nargs="*", default=[], help="models (NAME) to run the QAT ablation on")
    p.add_argument("--ablation-calib", default="mse", choices=sorted(CALIBRATIONS))
    p.add_argument("--qat-from-ablation", default=None, metavar="NAME",
                   help="QAT rows use the recipe of the best variant of NAME's ablation (OUT/DATASET/NAME/ablation.json)")
    p.add_argument("--wait-ablation", type=float, default=0, help="seconds to wait for --qat-from-ablation's result")
    p.add_argument("--ort-all-ptq", action="store_true", help="ONNX Runtime mAP of every PTQ method, not the best only")
    p.add_argument("--merge", action="store_true", help="only rebuild OUT/accuracy.json and .md")
    p.add_argument("--out", type=Path, default=Path("results"))
    opt = p.parse_args(argv)
    opt.models = dict(_pairs(p, "--models", opt.models))
    opt.train_epochs = {k: int(v) for k, v in _pairs(p, "--train-epochs", opt.train_epochs)}
    for name, weights in opt.models.items():
        if not Path(weights).is_file():
            p.error(f"--models {name}={weights}: file not found")
    if (opt.models or opt.ablation) and not (opt.data and Path(opt.data).is_file()):
        p.error(f"--data {opt.data}: file not found")
    unknown = [m for m in opt.ablation if m not in opt.models]
    if unknown:
        p.error(f"--ablation {' '.join(unknown)}: not among --models")
    if opt.modelopt and importlib.util.find_spec("modelopt") is None:
        p.error("--modelopt: nvidia-modelopt is not installed (pip install 'nvidia-modelopt[onnx]')")
    return opt


def _pairs(parser, flag, items):
    for item in items:
        name, _, value = item.partition("=")
        if not name or not value:
            parser.error(f"{flag} {item}: expected NAME=VALUE")
        yield name, value


def main(argv=None) -> int:
    opt = parse_opt(argv)
    for name in opt.ablation:
        ablation(name, Path(opt.models[name]), opt.data, opt.dataset, opt.imgsz, opt.device, opt.batch_size,
                 opt.qat_epochs, opt.iters, opt.out, opt.jobs, opt.workers, opt.calib_batches, opt.ablation_calib)
    for name, weights in opt.models.items():
        qat_args = shlex.split(opt.qat_args)
        if opt.qat_from_ablation:  # resolved when the QAT step starts: the ablation may still be running
            ablation_json = opt.out / opt.dataset / opt.qat_from_ablation / "ablation.json"
            qat_args = (lambda extra=qat_args, f=ablation_json: best_variant_args(f, opt.wait_ablation) + extra)
        benchmark_model(name, Path(weights), opt.data, opt.dataset, opt.imgsz, opt.device, opt.batch_size,
                        opt.qat_epochs, opt.iters, qat_args, opt.out, opt.jobs, opt.workers,
                        opt.calib_batches, opt.modelopt, opt.calib_images, opt.train_epochs.get(name), opt.ort_all_ptq)
        merge(opt.out)
    result = merge(opt.out)
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
