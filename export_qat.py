"""Export a (quantized) YOLOv9 / GELAN detection or segmentation model to ONNX for TensorRT.

    python export_qat.py --weights runs/qat/exp/weights/qat_best_yolov9-c-converted.pt --include onnx --dynamic --simplify
    python export_qat.py --weights runs/qat/exp/weights/qat_best_yolov9-c-converted.pt --include onnx_end2end
    python export_qat.py --weights ... --include onnx --verify --data data/coco.yaml   # ONNX Runtime parity

Quantized weights give QuantizeLinear/DequantizeLinear pairs (per-channel weights, axis 0, int8 zero points)
that TensorRT builds into INT8 kernels; float weights give a plain FP ONNX. Every export is linted for
TensorRT readiness (utils/qdq_lint.py). Segmentation models export two outputs: output0 (boxes, class scores
and mask coefficients per anchor) and output1 (the mask prototypes).
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

from models.quantize import is_quantized  # noqa: E402
from utils.general import LOGGER, colorstr  # noqa: E402
from utils.io_utils import cli_main  # noqa: E402
from utils.io_utils import write_json  # noqa: E402
from models.export import (DTYPES, PREFIX, add_efficient_nms, count_qdq, export_graph,  # noqa: E402
                           load_for_export, report_lint, save_onnx, verify_parity)
from models.task import task_of  # noqa: E402
from utils.torch_utils import select_device  # noqa: E402

INCLUDE = ("onnx", "onnx_end2end")


def output_path(weights: Path, include: str) -> Path:
    return weights.with_name(weights.stem + ("-end2end" if include == "onnx_end2end" else "") + ".onnx")


def verification_images(data: str, imgsz: int, batch_size: int, n_batches: int) -> list[torch.Tensor]:
    """Letterboxed validation images, as float 0-1 batches of a fixed shape."""
    from utils.dataloaders import LoadImages
    from utils.batches import load_data
    data_dict = load_data(data)
    val = data_dict["val"]
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


def run(weights, include, imgsz, batch_size, dynamic, simplify_, inplace, opset, device, conf_thres, iou_thres,
        topk_all, verify, data, verify_batches, exist_ok, json=None, trust_checkpoint=False, dtype="fp16",
        io_dtype="fp32", **_) -> dict:
    weights = Path(weights)
    device = select_device(device)
    model = load_for_export(weights, device, inplace, trust_checkpoint)
    names = task_of(model).output_names
    if include == "onnx_end2end" and len(names) > 1:
        raise ValueError(f"--include onnx_end2end: {weights} is a segmentation model, and EfficientNMS_TRT does not "
                         "output which anchors it kept, so their mask coefficients cannot be gathered; export "
                         "--include onnx (predictions + prototypes) and run NMS and mask assembly after the engine")
    quantized = is_quantized(model)
    im = torch.zeros(batch_size, 3, imgsz, imgsz, device=device)
    t0 = time.perf_counter()
    plain = export_graph(model, im, opset, dynamic, simplify_, dtype, io_dtype, output_names=names)
    lint_report = report_lint(plain)
    proto = plain
    if include == "onnx_end2end":
        proto = add_efficient_nms(plain, int(model.model[-1].nc), conf_thres, iou_thres, topk_all)
    path = save_onnx(proto, output_path(weights, include), exist_ok)
    q, dq = count_qdq(proto)
    result = {"weights": str(weights), "onnx": str(path), "include": include, "quantized": quantized,
              "dtype": dtype, "io_dtype": io_dtype, "opset": max(o.version for o in proto.opset_import),
              "dynamic": dynamic, "imgsz": imgsz, "batch_size": batch_size, "qdq_pairs": min(q, dq),
              "quantize_nodes": q, "dequantize_nodes": dq, "lint": lint_report.to_dict(),
              "outputs": [o.name for o in proto.graph.output], "export_s": round(time.perf_counter() - t0, 2)}
    LOGGER.info(f"{PREFIX}saved {colorstr('bold', path)} ({path.stat().st_size / 1e6:.1f} MB, {min(q, dq)} Q/DQ pairs, "
                f"{result['export_s']}s)")
    if verify:
        checked = path
        if include == "onnx_end2end":  # ONNX Runtime has no EfficientNMS_TRT: verify the same graph without it
            checked = path.with_name(path.stem + "-verify.onnx")
            save_onnx(plain, checked, exist_ok=True)
        images = verification_images(data, imgsz, batch_size, verify_batches)
        try:
            result["parity"] = verify_parity(model, checked, images, conf_thres, iou_thres)
        finally:
            if checked != path:
                checked.unlink(missing_ok=True)
        p = result["parity"]
        LOGGER.info(f"{PREFIX}ONNX Runtime vs PyTorch on {p['images']} images: max abs err {p['max_abs_err']:.3g}, "
                    f"rel err " + ", ".join(f"{k} {v:.3g}" for k, v in p["rel_err"].items()) +
                    (f", detections matched {p['detections_matched']:.1%} of {p['detections_counted']}"
                     if p["detections_counted"] else ", no detection above the threshold to match"))
    if json:
        write_json(Path(json), result)
    return result


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=str, required=True, help="model.pt path (quantized or float)")
    p.add_argument("--include", choices=INCLUDE, default="onnx", help="onnx, or onnx_end2end (+ EfficientNMS_TRT)")
    p.add_argument("--imgsz", "--img", "--img-size", type=int, default=640, help="image size (pixels)")
    p.add_argument("--batch-size", type=int, default=1, help="batch size (the largest with --dynamic is set at engine build)")
    p.add_argument("--dynamic", action="store_true", help="dynamic batch axis")
    p.add_argument("--simplify", dest="simplify_", action="store_true", help="simplify with onnxslim (Q/DQ kept)")
    p.add_argument("--inplace", action="store_true", help="set the detection head's inplace flag (as upstream export.py)")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (>= 13 for per-channel Q/DQ; 19 with --dtype fp16)")
    p.add_argument("--dtype", choices=DTYPES, default="fp16",
                   help="type of everything that is not INT8: fp16 for strongly typed builds (TensorRT 11, or 10.x "
                        "--stronglyTyped); fp32 for TensorRT 10 weakly typed builds (--int8 --fp16)")
    p.add_argument("--io-dtype", choices=DTYPES, default="fp32", help="type of the graph's input and outputs")
    p.add_argument("--device", default="cpu", help="cuda device, i.e. 0 or cpu")
    p.add_argument("--conf-thres", type=float, default=0.25,
                   help="score threshold of end-to-end NMS, and of the detections --verify compares")
    p.add_argument("--iou-thres", type=float, default=0.45, help="EfficientNMS IoU threshold")
    p.add_argument("--topk-all", type=int, default=100, help="EfficientNMS max detections per image")
    p.add_argument("--verify", action="store_true", help="compare ONNX Runtime with PyTorch on --data images")
    p.add_argument("--data", type=str, default=str(ROOT / "data/coco.yaml"), help="dataset.yaml for --verify")
    p.add_argument("--verify-batches", type=int, default=2, help="batches of images for --verify")
    p.add_argument("--exist-ok", action="store_true", help="overwrite an existing .onnx")
    p.add_argument("--trust-checkpoint", action="store_true", help="unpickle --weights fully (can run code)")
    p.add_argument("--json", type=str, default=None, help="also write the export summary to this JSON file")
    opt = p.parse_args(argv)
    if opt.opset < 13:
        p.error(f"--opset must be >= 13 (per-channel QuantizeLinear), got {opt.opset}")
    if opt.imgsz < 32 or opt.imgsz % 32:
        p.error(f"--imgsz must be a multiple of 32, got {opt.imgsz}")
    if opt.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {opt.batch_size}")
    if not (0 <= opt.conf_thres <= 1 and 0 <= opt.iou_thres <= 1):
        p.error("--conf-thres and --iou-thres must be in [0, 1]")
    return opt


def main(argv=None) -> int:
    return cli_main("export_qat.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
