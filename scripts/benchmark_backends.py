#!/usr/bin/env python3
"""The two quantization backends (pytorch-quantization, NVIDIA Model Optimizer) on one model and dataset, side by
side: the same recipe inserted by each, calibrated on the same training images with one statistics pass, then
compared quantizer by quantizer (weight ranges, activation ranges of `max` and of `mse`), by PTQ mAP on the val
images in PyTorch and, exported as FP32 Q/DQ graphs, in ONNX Runtime, and by the lint of both graphs.

    python scripts/benchmark_backends.py --weights assets/gelan-t-demo.pt --data DEMO/data.yaml --imgsz 320 \\
        --out results/backends/gelan-t-demo.json

Run from the patched YOLOv9 checkout, with nvidia-modelopt installed (./install_dependencies.sh --modelopt). Writes
OUT (JSON) and prints its table; `python scripts/benchmark_accuracy.py --render --docs` puts the table in README.md.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import torch  # noqa: E402

from utils.io_utils import cli_main, write_json  # noqa: E402
from utils.provenance import command_line, machine, sha256, toolkit_commit  # noqa: E402

BACKENDS = ("pytorch-quantization", "modelopt")


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True, help="a converted (reparameterized) float checkpoint")
    p.add_argument("--data", required=True, help="dataset.yaml: the first training images calibrate, val measures")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--calib-images", type=int, default=8, help="training images calibrating both backends")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", type=Path, required=True, help="the JSON written (results/backends/NAME.json)")
    return p.parse_args(argv)


def images(files: list[str], imgsz: int, batch_size: int) -> list[torch.Tensor]:
    """Letterboxed 0-1 batches of `files`, as calibration sees them."""
    from utils.dataloaders import LoadImages
    loaded = [torch.from_numpy(im).float() / 255 for _, im, *_ in LoadImages(files, img_size=imgsz, stride=32,
                                                                              auto=False)]
    return [torch.stack(loaded[i:i + batch_size]) for i in range(0, len(loaded), batch_size)]


def training_files(data: dict, n: int) -> list[str]:
    from utils.dataloaders import IMG_FORMATS
    train = Path(data["train"][0] if isinstance(data["train"], list) else data["train"])
    files = sorted(str(f) for f in train.rglob("*") if f.suffix[1:].lower() in IMG_FORMATS)
    if len(files) < n:
        raise ValueError(f"--data: {len(files)} training images, fewer than --calib-images {n}")
    return files[:n]


def measure_backend(backend: str, opt, calibration: list[torch.Tensor], loader, data: dict, tmp: Path) -> dict:
    """One backend: inserted, calibrated (`max`, and `mse` from the same statistics), measured, exported, linted."""
    from models.core.task import DETECT
    from models.deployment.evaluate import evaluate
    from models.deployment.export import GraphSpec, export_graph
    from models.deployment.runners import OnnxRuntimeRunner, TorchRunner
    from models.quantization.checkpoint import load_float_model
    from models.quantization.quantize import (QuantRecipe, collect_statistics, named_quantizers, quantize_model,
                                              quantizer_counts)
    from utils.qdq_lint import lint
    recipe = QuantRecipe(backend=backend, calib_method="max")
    t0 = time.perf_counter()
    model = quantize_model(load_float_model(opt.weights), recipe)
    insert_s = time.perf_counter() - t0
    stats = collect_statistics(model, recipe, calibration)
    ranges = {m: [float(a) for a in stats.ranges(m)] for m in ("max", "mse")}
    stats.apply("max")
    weights = {n: q.amax.detach().float().reshape(-1).tolist() for n, q in named_quantizers(model)
               if q.axis is not None and q.amax is not None}
    pytorch = evaluate(TorchRunner(model), loader, DETECT, data["nc"], desc=f"{backend}: PTQ max, PyTorch")
    t0 = time.perf_counter()
    graph = export_graph(model, GraphSpec(imgsz=(opt.imgsz, opt.imgsz), batch_size=opt.batch_size, dynamic=True,
                                          dtype="fp32"), torch.device("cpu"))
    export_s = time.perf_counter() - t0
    path = tmp / f"{backend}.onnx"
    onnx.save(graph, str(path))
    ort = evaluate(OnnxRuntimeRunner(path), loader, DETECT, data["nc"], desc=f"{backend}: PTQ max, ONNX Runtime")
    report = lint(graph)
    keep = ("images", "ap", "ap50", "precision", "recall")
    return {"quantizers": quantizer_counts(model), "names": stats.names, "ranges": ranges,
            "weights": weights,
            "pytorch": {k: pytorch[k] for k in keep}, "onnxruntime": {k: ort[k] for k in keep},
            "lint": {"qdq_pairs": report.quantize_nodes, "quantized_convs": report.quantized_convs,
                     "unshared_joins": len(report.unshared_joins), "unquantized_convs": len(report.unquantized_convs)},
            "seconds": {"insert": round(insert_s, 2), "collect": round(stats.collect_s, 2),
                        "export": round(export_s, 2)}}


def compare(a: dict, b: dict) -> dict:
    """b against a, quantizer by quantizer."""
    assert a["names"] == b["names"], "the backends placed different activation quantizers"
    out = {"weights_equal": sum(a["weights"][n] == b["weights"][n] for n in a["weights"]),
           "weights": len(a["weights"])}
    for method in ("max", "mse"):
        rel = np.abs(np.array(b["ranges"][method]) / np.array(a["ranges"][method]) - 1)
        out[method] = {"same": int((rel == 0).sum()), "of": len(rel), "median_rel": float(np.median(rel)),
                       "largest_rel": float(rel.max())}
    return out


def table(result: dict) -> str:
    lines = ["| PTQ (max) on the val images | mAP50-95 | mAP50 | Q/DQ pairs | INT8 convs | joins with two scales |",
             "|---|---|---|---|---|---|"]
    for backend in BACKENDS:
        r = result["backends"][backend]
        for runtime, name in (("pytorch", "PyTorch"), ("onnxruntime", "ONNX Runtime, FP32 Q/DQ graph")):
            lint_cells = "| - | - | - |" if runtime == "pytorch" else \
                f"| {r['lint']['qdq_pairs']} | {r['lint']['quantized_convs']} | {r['lint']['unshared_joins']} |"
            lines.append(f"| {backend}, {name} | {r[runtime]['ap']:.4f} | {r[runtime]['ap50']:.4f} {lint_cells}")
    return "\n".join(lines)


def run(weights: str, data: str, imgsz: int, calib_images: int, batch_size: int, out: Path) -> dict:
    from models.core.task import DETECT
    from models.deployment.evaluate import val_loader
    from utils.batches import load_data
    if not Path(weights).is_file():
        raise FileNotFoundError(f"--weights {weights}: file not found")
    opt = argparse.Namespace(weights=weights, imgsz=imgsz, batch_size=batch_size)
    data_dict = load_data(data)
    calibration = images(training_files(data_dict, calib_images), imgsz, batch_size)
    loader = val_loader(DETECT, data_dict, imgsz, batch_size, 0)
    with tempfile.TemporaryDirectory() as tmp:
        measured = {b: measure_backend(b, opt, calibration, loader, data_dict, Path(tmp)) for b in BACKENDS}
    comparison = compare(*measured.values())
    for r in measured.values():  # the comparison keeps what the ranges say; the arrays stay out of the record
        del r["names"], r["ranges"], r["weights"]
    result = {"weights": str(weights), "weights_sha256": sha256(weights), "data": str(data), "imgsz": imgsz,
              "calibration_images": calib_images, "val_images": measured[BACKENDS[0]]["pytorch"]["images"], "backends": measured,
              "ranges": comparison, "commit": toolkit_commit(), "command": command_line(), "machine": machine()}
    result["table"] = table(result)
    write_json(out, result)
    print(result["table"])
    return result


def main(argv=None) -> int:
    return cli_main("benchmark_backends.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
