#!/usr/bin/env python3
"""Accuracy of FP vs PTQ (each calibration method) vs QAT on trained models, plus the ONNX Runtime mAP of the
exported QAT model. Resumable: a step whose output exists is not run again.

    python scripts/benchmark_accuracy.py --models gelan-t=weights/gelan-t-demo.pt --data datasets/demo/data.yaml \
        --imgsz 320 --device cuda:0 --out results [--train-epochs 40]
Run from the patched YOLOv9 checkout. A model whose weights do not exist is first trained from scratch with
upstream train.py (seeded, models/detect/NAME.yaml) when --train-epochs is given. Writes OUT/accuracy.json and
OUT/accuracy.md; models already in OUT/accuracy.json from earlier runs are kept.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from utils.io_utils import atomic_write  # noqa: E402
from utils.qat_utils import write_json  # noqa: E402

CALIBRATIONS = {"max": [], "mse": [], "percentile-99.99": ["--percentile", "99.99"],
                "percentile-99.999": ["--percentile", "99.999"], "entropy": []}


def _qat(args: list[str], save_dir: Path) -> dict:
    report = save_dir / "report.json"
    if not report.is_file():
        cmd = [sys.executable, "qat.py", "quantize", *args, "--project", str(save_dir.parent), "--name", save_dir.name,
               "--exist-ok"]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return json.loads(report.read_text())


def _train(name: str, weights: Path, data: str, imgsz: int, epochs: int, batch_size: int, device: str,
           workers: int, out: Path) -> None:
    """Train models/detect/NAME.yaml from scratch with upstream train.py (seeded) and keep its best weights."""
    save_dir = out / name / "train"
    cmd = [sys.executable, "train.py", "--data", data, "--cfg", f"models/detect/{name}.yaml", "--weights", "",
           "--hyp", "data/hyps/hyp.scratch-high.yaml", "--img", str(imgsz), "--batch", str(batch_size),
           "--epochs", str(epochs), "--device", device.replace("cuda:", ""), "--seed", "0", "--workers", str(workers),
           "--project", str(save_dir.parent), "--name", save_dir.name, "--exist-ok"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    weights.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(save_dir / "weights" / "best_striped.pt", weights)  # EMA, FP16, no optimizer


def _ort_map(weights: Path, data: str, imgsz: int, out: Path) -> dict:
    result = out / "val_trt.json"
    if not result.is_file():
        subprocess.run([sys.executable, "export_qat.py", "--weights", str(weights), "--include", "onnx", "--dynamic",
                        "--imgsz", str(imgsz), "--exist-ok"], check=True)
        subprocess.run([sys.executable, "val_trt.py", "--onnx-file", str(weights.with_suffix(".onnx")), "--data", data,
                        "--imgsz", str(imgsz), "--batch-size", "8", "--project", str(out.parent), "--name", out.name,
                        "--exist-ok"], check=True)
    return json.loads(result.read_text())


def run(models: dict[str, Path], data: str, imgsz: int, device: str, batch_size: int, qat_epochs: int, iters: int,
        out: Path, lr: float = 1e-5, skip_layers: tuple[str, ...] = (), train_epochs: int = 0,
        calib_batches: int = 25, workers: int = 8) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "accuracy.json"
    for name, weights in models.items():
        if not weights.is_file():
            _train(name, weights, data, imgsz, train_epochs, batch_size, device, workers, out)
        common = ["--weights", str(weights), "--data", data, "--imgsz", str(imgsz), "--device", device,
                  "--batch-size", str(batch_size), "--calib-batches", str(calib_batches), "--workers", str(workers)]
        entry = {"weights": str(weights), "imgsz": imgsz, "data": data, "ptq": {}}
        if train_epochs:
            entry["train_epochs"] = train_epochs
        for method, extra in CALIBRATIONS.items():
            calib = method.split("-")[0]
            rep = _qat([*common, "--calib-method", calib, *extra, "--epochs", "0",
                        *([] if method == "max" else ["--no-eval-origin"])], out / name / f"ptq-{method}")
            if method == "max":
                entry["fp"] = rep["origin"]
            timing = rep["timing"]
            entry["ptq"][method] = {**rep["ptq"], "calib_s": timing["calib_collect_s"] + timing["calib_amax_s"]}
        best_method = max(entry["ptq"], key=lambda m: entry["ptq"][m]["ap"])
        calib = best_method.split("-")[0]
        skip = ["--skip-layers", *skip_layers] if skip_layers else []
        rep = _qat([*common, "--calib-method", calib, *CALIBRATIONS[best_method], "--epochs", str(qat_epochs),
                    "--iters", str(iters), "--lr", str(lr), *skip, "--no-eval-origin"],
                   out / name / f"qat-{best_method}")
        entry["qat_calibration"] = best_method
        # what the (possibly earlier) run used, which is what its figures measure
        entry["qat_settings"] = {k: rep[k] for k in ("epochs", "iters", "lr", "skip_layers")}
        asked = {"epochs": qat_epochs, "iters": iters, "lr": lr, "skip_layers": list(skip_layers)}
        if entry["qat_settings"] != asked:
            print(f"benchmark_accuracy: note: {name}: reusing the QAT run in {rep['save_dir']} made with "
                  f"{entry['qat_settings']}, not {asked}; delete that folder to run it again", flush=True)
        entry["qat"] = {k: rep["qat_best"][k] for k in ("ap", "ap50", "precision", "recall", "epoch")}
        entry["qat_epochs"] = rep["qat"]
        # inside the QAT run's folder: a result is only reused together with the model it measured
        entry["ort"] = _ort_map(Path(rep["qat_best_file"]), data, imgsz, Path(rep["save_dir"]) / "ort")
        results = json.loads(summary.read_text())["models"] if summary.is_file() else {}  # other runs' models
        results[name] = entry
        table = accuracy_table(results)
        write_json(summary, {"models": results, "table": table})  # after each model: a later failure keeps it
        atomic_write(out / "accuracy.md", lambda tmp: Path(tmp).write_text(table + "\n"))
    results = json.loads(summary.read_text())["models"]
    print(accuracy_table(results))
    return results


def accuracy_table(results: dict) -> str:
    """Markdown: one row per model and stage, with the delta to the float model."""
    rows = []
    for name, entry in results.items():
        fp = entry["fp"]

        def row(label, m):
            rows.append(f"| {name} | {label} | {m['ap']:.4f} | {m['ap50']:.4f} | {m['precision']:.4f} | "
                        f"{m['recall']:.4f} | {m['ap'] - fp['ap']:+.4f} |")
        row("FP32 (PyTorch)", fp)
        for method, m in entry["ptq"].items():
            row(f"PTQ {method}", m)
        settings = entry.get("qat_settings", {})
        skipped = f", layers {' '.join(settings['skip_layers'])} float" if settings.get("skip_layers") else ""
        lr = f", lr {settings['lr']:g}" if "lr" in settings else ""
        row(f"QAT ({entry['qat_calibration']}{lr}{skipped}), best epoch", entry["qat"])
        row("QAT, ONNX Runtime (Q/DQ ONNX)", entry["ort"])
    return "\n".join(["| Model | Stage | mAP50-95 | mAP50 | P | R | delta mAP50-95 vs FP |",
                      "|---|---|---|---|---|---|---|", *rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", required=True, help="NAME=weights.pt (trained, converted float models)")
    p.add_argument("--data", required=True)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--qat-epochs", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-5, help="peak QAT learning rate")
    p.add_argument("--skip-layers", nargs="*", default=[], help="layers kept in float during QAT")
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--workers", type=int, default=8, help="dataloader workers")
    p.add_argument("--train-epochs", type=int, default=0, help="train models whose weights are missing (0: error)")
    p.add_argument("--out", type=Path, default=Path("results"))
    opt = p.parse_args(argv)
    models = {}
    for item in opt.models:
        name, _, path = item.partition("=")
        if not path or not (Path(path).is_file() or opt.train_epochs > 0):
            print(f"benchmark_accuracy: error: --models {item}: expected NAME=existing.pt (or --train-epochs N)",
                  file=sys.stderr)
            return 2
        models[name] = Path(path)
    run(models, opt.data, opt.imgsz, opt.device, opt.batch_size, opt.qat_epochs, opt.iters, opt.out, opt.lr,
        tuple(opt.skip_layers), opt.train_epochs, opt.calib_batches, opt.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
