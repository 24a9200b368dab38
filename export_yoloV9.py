"""Export a YOLOv9 / GELAN model (quantized or float, single or dual head) to ONNX for DeepStream.

    python export_yoloV9.py --weights runs/qat/exp/weights/qat_best_yolov9-c-converted.pt --simplify --dynamic

Writes WEIGHTS-deepstream.onnx whose one output `output` is [batch, anchors, 6] = x1, y1, x2, y2, score, class
(the layout DeepStream-Yolo's custom bounding-box parser reads), and WEIGHTS-deepstream-labels.txt with one class
name per line (the TensorRT graph of export_qat.py is WEIGHTS.onnx: the two never overwrite each other).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

FILE = Path(__file__).resolve()
ROOT = FILE.parents[0]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from models.quantization.checkpoint import fuse, load_for_export, read_checkpoint  # noqa: E402
from models.quantization.quantize import is_quantized  # noqa: E402
from utils.general import LOGGER, colorstr  # noqa: E402
from utils.io_utils import atomic_write, cli_main  # noqa: E402
from models.deployment.export import (DTYPES, PREFIX, GraphSpec, artefact, class_names, count_qdq,  # noqa: E402
                                      export_graph, recorded_settings, report_lint, save_onnx, stamp)


class DeepStreamHead(nn.Module):
    """Model + conversion of (batch, 4+nc, anchors) xywh/scores into (batch, anchors, 6) boxes/score/class.
    For dual-head models the main (second) branch is used."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        y = self.model(x)
        if isinstance(y, (list, tuple)):
            y = y[-1]
        y = y.transpose(1, 2)
        xy, wh, scores = y[..., :2], y[..., 2:4], y[..., 4:]
        score, cls = scores.max(-1, keepdim=True)
        return torch.cat([xy - wh / 2, xy + wh / 2, score, cls.to(score.dtype)], -1)


def run(**flags) -> dict:
    weights = Path(flags.pop("weights"))
    size = flags.pop("size")
    spec = GraphSpec(tuple((size * 2)[:2]), flags.pop("batch"), flags.pop("dynamic"), flags.pop("simplify_"),
                     flags.pop("opset"), flags.pop("dtype"), flags.pop("io_dtype"))
    device, exist_ok, trust = torch.device(flags.pop("device")), flags.pop("exist_ok"), flags.pop("trust_checkpoint")
    ckpt = read_checkpoint(weights, trust)
    quantized = is_quantized(ckpt["model"])
    model = _load_any_head(weights, ckpt, device)
    head = type(model.model[-1]).__name__
    proto = export_graph(model, spec, device, wrapper=DeepStreamHead(model).eval(), output_names=("output",))
    lint = report_lint(proto)
    proto = stamp(proto, recorded_settings(weights, "deepstream", spec, None))
    path = save_onnx(proto, artefact(weights, "deepstream"), exist_ok)
    names = class_names(model)
    labels = atomic_write(path.with_name(path.stem + "-labels.txt"),
                          lambda tmp: Path(tmp).write_text("\n".join(names) + "\n"), exist_ok)
    q, dq = count_qdq(proto)
    LOGGER.info(f"{PREFIX}{'QAT (INT8 Q/DQ)' if quantized else 'standard (float)'} model, {head} head -> "
                f"{colorstr('bold', path)}, {len(names)} labels -> {labels}")
    return {"onnx": str(path), "labels": str(labels), "quantized": quantized, "head": head, "qdq_pairs": min(q, dq),
            "dtype": spec.dtype, "io_dtype": spec.io_dtype, "lint": lint.to_dict()}


def _load_any_head(weights: Path, ckpt: dict, device):
    """Dual-head (training) checkpoints are exported as they are; DeepStream reads the main branch."""
    try:
        return load_for_export(weights, device, ckpt=ckpt)
    except ValueError as e:
        if "reparameterization.py" not in str(e):
            raise
        return fuse((ckpt.get("ema") or ckpt["model"]).float()).to(device).eval()


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-w", "--weights", required=True, help="model.pt path")
    p.add_argument("-s", "--size", nargs="+", type=int, default=[640], help="inference size [H, W]")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset")
    p.add_argument("--simplify", dest="simplify_", action="store_true", help="simplify with onnxslim")
    p.add_argument("--dynamic", action="store_true", help="dynamic batch size")
    p.add_argument("--batch", type=int, default=1, help="static batch size")
    p.add_argument("--device", default="cpu", help="cpu or cuda device")
    p.add_argument("--exist-ok", action="store_true", help="overwrite an existing .onnx")
    p.add_argument("--dtype", choices=DTYPES, default="fp16",
                   help="non-INT8 type: fp16 (strongly typed TensorRT 11 / 10.x --stronglyTyped) or fp32 (weak typing)")
    p.add_argument("--io-dtype", choices=DTYPES, default="fp32", help="type of the input and the output")
    p.add_argument("--trust-checkpoint", action="store_true", help="unpickle --weights fully (can run code)")
    opt = p.parse_args(argv)
    problems = [message for wrong, message in (
        (opt.dynamic and opt.batch > 1, "--dynamic and --batch > 1 cannot be used together: pick a dynamic or a "
                                        "static batch"),
        (len(opt.size) > 2 or any(s < 32 or s % 32 for s in opt.size),
         f"--size takes one or two multiples of 32, got {opt.size}"),
        (opt.opset < 13, f"--opset must be >= 13, got {opt.opset}")) if wrong]
    if problems:
        p.error(problems[0])
    return opt


def main(argv=None) -> int:
    return cli_main("export_yoloV9.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
