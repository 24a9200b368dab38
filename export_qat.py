"""Export a (quantized) YOLOv9 / GELAN detection or segmentation model to ONNX for TensorRT.

    python export_qat.py --weights W.pt --dynamic --simplify                 # W.onnx: the graph TensorRT builds
    python export_qat.py --weights W.pt --include onnx_end2end --dynamic     # W-end2end.onnx: + NMS (standard ONNX)
    python export_qat.py --weights W.pt --include onnx_end2end --nms efficient   # W-end2end-efficientnms.onnx
    python export_qat.py --weights W.pt --verify --data data/coco.yaml       # ONNX Runtime parity on real images

Quantized weights give QuantizeLinear/DequantizeLinear pairs (per-channel weights, axis 0, int8 zero points)
that TensorRT builds into INT8 kernels; float weights give a plain FP ONNX. Every export is linted for TensorRT
readiness (utils/qdq_lint.py) and records in its metadata what it was made from and how (the weights' sha256, the
graph settings, the NMS thresholds), so scripts/val_trt.sh can tell whether an existing file fits. Segmentation
models export output0 (boxes, class scores, mask coefficients) and output1 (prototypes); their end-to-end graph
also outputs det_masks.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

FILE = Path(__file__).resolve()
ROOT = FILE.parents[0]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402

from models.deployment.export import (DTYPES, PREFIX, ExportConfig, GraphSpec, artefact, count_qdq,  # noqa: E402
                                      export_model, output_kind, read_settings, recorded_settings, report_lint,
                                      save_onnx, verify_parity)
from models.quantization.quantize import is_quantized  # noqa: E402
from utils.general import LOGGER, colorstr  # noqa: E402
from utils.io_utils import cli_main, write_json  # noqa: E402
from utils.onnx_nms import NMS_KINDS, NMSSettings  # noqa: E402

INCLUDE = ("onnx", "onnx_end2end")


def verification_images(data: str, imgsz: int, batch_size: int, n_batches: int) -> list[torch.Tensor]:
    """Letterboxed validation images, as float 0-1 batches of a fixed shape."""
    from utils.batches import load_data
    from utils.dataloaders import LoadImages
    val = load_data(data)["val"]
    files = LoadImages(val[0] if isinstance(val, list) else val, img_size=imgsz, stride=32, auto=False)
    batches, current = [], []
    for _, im, *_ in files:
        current.append(torch.from_numpy(im).float() / 255)
        if len(current) == batch_size:
            batches.append(torch.stack(current))
            current = []
            if len(batches) == n_batches:
                break
    if not batches:
        raise ValueError(f"--data {data}: fewer than --batch-size {batch_size} validation images to verify with")
    return batches


def build(flags: dict) -> tuple[ExportConfig, dict]:
    """The export configuration and the run options (verify, reuse, json, exist_ok); every flag consumed."""
    spec = GraphSpec((flags.pop("imgsz"),) * 2, flags.pop("batch_size"), flags.pop("dynamic"), flags.pop("simplify_"),
                     flags.pop("opset"), flags.pop("dtype"), flags.pop("io_dtype"))
    nms = NMSSettings(flags.pop("conf_thres"), flags.pop("iou_thres"), flags.pop("topk_all"), flags.pop("nms"))
    end2end = nms if flags.pop("include") == "onnx_end2end" else None
    options = {k: flags.pop(k) for k in ("verify", "data", "verify_batches", "exist_ok", "reuse", "json")}
    options["nms"] = nms  # verification counts detections at these thresholds, end-to-end graph or not
    return ExportConfig(spec=spec, end2end=end2end, **flags), options


def run(**flags) -> dict:
    cfg, opt = build(flags)
    path = artefact(cfg.weights, output_kind(cfg.end2end))
    wanted = recorded_settings(cfg.weights, output_kind(cfg.end2end), cfg.spec, cfg.end2end)
    if opt["reuse"] and path.is_file():
        if read_settings(path) == wanted:
            LOGGER.info(f"{PREFIX}reusing {path}: exported from these weights with these settings")
            return {"onnx": str(path), "reused": True}
        LOGGER.info(f"{PREFIX}{path} was exported from other weights or with other settings; exporting again")
    t0 = time.perf_counter()
    model, plain, proto = export_model(cfg)
    lint_report = report_lint(plain)
    path = save_onnx(proto, path, opt["exist_ok"] or opt["reuse"])
    q, dq = count_qdq(proto)
    result = {"weights": str(cfg.weights), "onnx": str(path), "quantized": is_quantized(model), **wanted,
              "opset": max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
              "qdq_pairs": min(q, dq), "quantize_nodes": q, "dequantize_nodes": dq, "lint": lint_report.to_dict(),
              "outputs": [o.name for o in proto.graph.output], "export_s": round(time.perf_counter() - t0, 2)}
    LOGGER.info(f"{PREFIX}saved {colorstr('bold', path)} ({path.stat().st_size / 1e6:.1f} MB, {min(q, dq)} Q/DQ "
                f"pairs, {result['export_s']}s)")
    if opt["verify"]:
        result["parity"] = verify(model, plain, cfg, opt)
    if opt["json"]:
        write_json(Path(opt["json"]), result)
    return result


def parity_line(p: dict) -> str:
    """What decides first: the detections found again and how far the matched pairs moved (a few INT8 roundings
    flipped by another summation order move a box and a score a little; a wrong graph loses the boxes); the raw
    outputs' relative error last, as a diagnostic."""
    if not p["detections_counted"]:
        head = "no detection above the threshold to match"
    else:
        head = (f"detections matched {p['detections_matched']:.1%} of {p['detections_counted']}" +
                (f" (matched pairs: IoU >= {p['matched_min_iou']:.3f}, scores within {p['matched_max_score_diff']:.3f})"
                 if p["matched_min_iou"] is not None else ""))
    return head + "; raw outputs' relative error " + ", ".join(f"{k} {v:.3g}" for k, v in p["rel_err"].items())


def verify(model, plain, cfg: ExportConfig, opt: dict) -> dict:
    """The plain graph (what an end-to-end graph wraps) against PyTorch in ONNX Runtime, on real images."""
    import tempfile

    import onnx
    images = verification_images(opt["data"], cfg.spec.imgsz[0], max(cfg.spec.batch_size, 1), opt["verify_batches"])
    nms = opt["nms"]
    with tempfile.TemporaryDirectory() as d:
        onnx.save(plain, f"{d}/plain.onnx")
        p = verify_parity(model, f"{d}/plain.onnx", images, nms.conf_thres, nms.iou_thres)
    LOGGER.info(f"{PREFIX}ONNX Runtime vs PyTorch on {p['images']} images: " + parity_line(p))
    return p


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=str, required=True, help="model.pt path (quantized or float)")
    p.add_argument("--include", choices=INCLUDE, default="onnx", help="onnx, or onnx_end2end (NMS inside the graph)")
    p.add_argument("--nms", choices=NMS_KINDS, default="onnx",
                   help="end-to-end NMS: onnx (standard NonMaxSuppression: TensorRT's INMSLayer, ONNX Runtime) or "
                        "efficient (TensorRT's EfficientNMS_TRT plugin, detection only, deprecated in TensorRT 10.12)")
    p.add_argument("--imgsz", "--img", "--img-size", type=int, default=640, help="image size (pixels)")
    p.add_argument("--batch-size", type=int, default=1, help="static batch size (with --dynamic: set at engine build)")
    p.add_argument("--dynamic", action="store_true", help="dynamic batch axis")
    p.add_argument("--simplify", dest="simplify_", action="store_true", help="simplify with onnxslim (Q/DQ kept)")
    p.add_argument("--inplace", action="store_true", help="the heads' inplace flag (as upstream export.py)")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (>= 13; 19 with --dtype fp16)")
    p.add_argument("--dtype", choices=DTYPES, default="fp16",
                   help="type of everything that is not INT8: fp16 for strongly typed builds (TensorRT 11, or 10.x "
                        "--stronglyTyped); fp32 for TensorRT 10 weakly typed builds (--int8 --fp16)")
    p.add_argument("--io-dtype", choices=DTYPES, default="fp32", help="type of the graph's input and outputs")
    p.add_argument("--device", default="cpu", help="cpu or cuda device, i.e. cuda:0")
    p.add_argument("--conf-thres", type=float, default=0.25,
                   help="score threshold of the end-to-end NMS, and of the detections --verify compares")
    p.add_argument("--iou-thres", type=float, default=0.45, help="IoU threshold of the end-to-end NMS")
    p.add_argument("--topk-all", type=int, default=100, help="detections per image kept by the end-to-end NMS")
    p.add_argument("--verify", action="store_true", help="compare ONNX Runtime with PyTorch on --data images")
    p.add_argument("--data", type=str, default=str(ROOT / "data/coco.yaml"), help="dataset.yaml for --verify")
    p.add_argument("--verify-batches", type=int, default=2, help="batches of images for --verify")
    p.add_argument("--exist-ok", action="store_true", help="overwrite an existing .onnx")
    p.add_argument("--reuse", action="store_true",
                   help="keep an existing .onnx exported from the same weights with the same settings; export "
                        "again (replacing it) otherwise")
    p.add_argument("--trust-checkpoint", action="store_true", help="unpickle --weights fully (can run code)")
    p.add_argument("--json", type=str, default=None, help="also write the export summary to this JSON file")
    opt = p.parse_args(argv)
    if opt.opset < 13:
        p.error(f"--opset must be >= 13 (per-channel QuantizeLinear), got {opt.opset}")
    if opt.imgsz < 32 or opt.imgsz % 32:
        p.error(f"--imgsz must be a multiple of 32, got {opt.imgsz}")
    if opt.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {opt.batch_size}")
    try:
        build(dict(vars(opt)))
    except ValueError as e:
        p.error(str(e))
    return opt


def main(argv=None) -> int:
    return cli_main("export_qat.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
