#!/usr/bin/env python3
"""Accuracy of FP vs PTQ (each calibration method) vs QAT on trained models, plus the ONNX Runtime mAP of the
exported QAT model. Resumable: a step whose output exists is not run again.

    python scripts/benchmark_accuracy.py --models gelan-t=weights/gelan-t-demo.pt --data datasets/demo/data.yaml \
        --imgsz 320 --device cuda:0 --out results
Run from the patched YOLOv9 checkout. Writes OUT/accuracy.json and OUT/accuracy.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

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
        out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows, results = [], {}
    for name, weights in models.items():
        common = ["--weights", str(weights), "--data", data, "--imgsz", str(imgsz), "--device", device,
                  "--batch-size", str(batch_size), "--calib-batches", "25"]
        entry = {"weights": str(weights), "ptq": {}}
        for method, extra in CALIBRATIONS.items():
            calib = method.split("-")[0]
            rep = _qat([*common, "--calib-method", calib, *extra, "--epochs", "0",
                        *([] if method == "max" else ["--no-eval-origin"])], out / name / f"ptq-{method}")
            if method == "max":
                entry["fp"] = rep["origin"]
            entry["ptq"][method] = {**rep["ptq"], "calib_s": rep["timing"]["calib_collect_s"] + rep["timing"]["calib_amax_s"]}
        best_method = max(entry["ptq"], key=lambda m: entry["ptq"][m]["ap"])
        calib = best_method.split("-")[0]
        rep = _qat([*common, "--calib-method", calib, *CALIBRATIONS[best_method], "--epochs", str(qat_epochs),
                    "--iters", str(iters), "--no-eval-origin"], out / name / f"qat-{best_method}")
        entry["qat_calibration"] = best_method
        entry["qat"] = {k: rep["qat_best"][k] for k in ("ap", "ap50", "precision", "recall", "epoch")}
        entry["qat_epochs"] = rep["qat"]
        entry["ort"] = _ort_map(Path(rep["qat_best_file"]), data, imgsz, out / name / "ort")
        results[name] = entry
        fp = entry["fp"]

        def row(label, m):
            rows.append(f"| {name} | {label} | {m['ap']:.4f} | {m['ap50']:.4f} | {m['precision']:.4f} | "
                        f"{m['recall']:.4f} | {m['ap'] - fp['ap']:+.4f} |")
        row("FP32 (PyTorch)", fp)
        for method, m in entry["ptq"].items():
            row(f"PTQ {method}", m)
        row(f"QAT ({best_method}), best epoch", entry["qat"])
        row("QAT, ONNX Runtime (Q/DQ ONNX)", entry["ort"])
    table = "\n".join(["| Model | Stage | mAP50-95 | mAP50 | P | R | delta mAP50-95 vs FP |",
                       "|---|---|---|---|---|---|---|", *rows])
    (out / "accuracy.json").write_text(json.dumps({"imgsz": imgsz, "data": data, "models": results, "table": table},
                                                  indent=2))
    (out / "accuracy.md").write_text(table + "\n")
    print(table)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", required=True, help="NAME=weights.pt (trained, converted float models)")
    p.add_argument("--data", required=True)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--qat-epochs", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", type=Path, default=Path("results"))
    opt = p.parse_args(argv)
    models = {}
    for item in opt.models:
        name, _, path = item.partition("=")
        if not path or not Path(path).is_file():
            print(f"benchmark_accuracy: error: --models {item}: expected NAME=existing.pt", file=sys.stderr)
            return 2
        models[name] = Path(path)
    run(models, opt.data, opt.imgsz, opt.device, opt.batch_size, opt.qat_epochs, opt.iters, opt.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
