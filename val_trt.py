"""COCO-style mAP of a deployed model: a TensorRT engine, the same ONNX run by ONNX Runtime, or the .pt in PyTorch,
all through one evaluation loop (models/deployment/evaluate.py). Detection, or instance segmentation (box and mask mAP),
recognised from the model's outputs.

    python val_trt.py --engine-file model.engine --data data/coco.yaml --imgsz 640 --batch-size 8
    python val_trt.py --onnx-file model.onnx --data data/coco.yaml
    python val_trt.py --weights model.pt --data data/coco.yaml --device 0

Preprocessing is a square letterbox of --imgsz (the input of an engine of fixed size); the last partial batch is
padded up to the engine's batch where that batch is fixed. Metrics come from upstream's `ap_per_class`; with a
COCO dataset (annotations json present) pycocotools' numbers are reported too. Graphs with NMS inside are read
through their num_dets/det_boxes/det_scores/det_classes outputs; the thresholds they were built with (stored in
the ONNX metadata) are reported, with a warning where they differ from --conf-thres/--iou-thres/--max-det.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

FILE = Path(__file__).resolve()
ROOT = FILE.parents[0]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from models.deployment.evaluate import (NMSConfig, check_outputs, coco_map, evaluate, metrics_table,  # noqa: E402
                                        val_loader)
from models.deployment.runners import open_runner  # noqa: E402
from utils.batches import load_data  # noqa: E402
from utils.general import LOGGER  # noqa: E402
from utils.io_utils import OutputDir, cli_main, write_json  # noqa: E402

BACKEND_OF_FLAG = {"engine_file": "tensorrt", "onnx_file": "onnxruntime", "weights": "pytorch"}
LABELS = {"tensorrt": "TensorRT", "onnxruntime": "ONNX Runtime", "pytorch": "PyTorch (same letterbox)"}


@dataclass(frozen=True)
class ValConfig:
    model: str
    backend: str
    data: str = "data/coco.yaml"
    imgsz: int = 640
    batch_size: int = 1
    nms: NMSConfig = NMSConfig()
    device: str = "cuda:0"
    workers: int = 8
    trust_checkpoint: bool = False


def validate(cfg: ValConfig) -> dict:
    """Metrics of one model file; the result dict val_trt.json holds."""
    data_dict = load_data(cfg.data)
    runner = open_runner(cfg.model, cfg.device, cfg.trust_checkpoint, flag=f"--{_flag(cfg.backend)}")
    nc = int(data_dict["nc"])
    check_outputs(runner, runner.task, nc, cfg.model)
    if runner.task.has_masks and cfg.nms.nms_free:
        raise ValueError("--no-nms: segmentation models are evaluated with NMS (their masks follow the kept boxes)")
    batch, _, height, width = runner.input_shape
    if height is not None and (height, width) != (cfg.imgsz, cfg.imgsz):
        raise ValueError(f"the model's input is {height}x{width} but --imgsz is {cfg.imgsz}")
    if batch is not None and cfg.batch_size != batch:
        raise ValueError(f"the model has a fixed batch of {batch} but --batch-size is {cfg.batch_size}")
    if runner.max_batch and cfg.batch_size > runner.max_batch:
        raise ValueError(f"--batch-size {cfg.batch_size} exceeds the engine's largest batch {runner.max_batch}")
    built_with = _built_in_nms(runner, cfg.nms)
    loader = val_loader(runner.task, data_dict, cfg.imgsz, cfg.batch_size, cfg.workers, data=cfg.data)
    metrics = evaluate(runner, loader, runner.task, nc, cfg.nms, keep_predictions=True)
    coco = coco_map(metrics.pop("predictions"), data_dict)
    result = {"backend": cfg.backend, "model": str(cfg.model), "data": str(cfg.data), "task": runner.task.name,
              "imgsz": cfg.imgsz, "batch_size": cfg.batch_size, **metrics, **(coco or {}),
              **({"nms_in_graph": built_with} if built_with else {})}
    result["table"] = metrics_table([(LABELS[cfg.backend], metrics)])
    LOGGER.info("\n" + result["table"] + f"\n{metrics['ms_per_image']} ms/image ({cfg.backend}, "
                f"batch {cfg.batch_size})")
    return result


def _built_in_nms(runner, nms: NMSConfig) -> dict | None:
    """The thresholds an end-to-end graph was exported with, and a warning where this evaluation's differ: its
    mAP then measures the deployed post-processing, not the model at mAP settings."""
    if "num_dets" not in runner.output_names:
        return None
    meta = getattr(runner, "metadata", {})
    built = {k: float(meta[k]) for k in ("conf_thres", "iou_thres", "max_det") if k in meta}
    asked = {"conf_thres": nms.conf_thres, "iou_thres": nms.iou_thres, "max_det": nms.max_det}
    differ = {k: (v, asked[k]) for k, v in built.items() if abs(v - asked[k]) > 1e-9}
    if differ:
        LOGGER.warning("WARNING: NMS runs inside this graph with " + ", ".join(
            f"{k} {v[0]:g} (--{k.replace('_', '-')} {v[1]:g})" for k, v in differ.items()) +
            ": the mAP below uses the graph's settings, so it is not comparable with a plain graph's")
    return built or {"unknown": "no thresholds in the ONNX metadata"}


def _flag(backend: str) -> str:
    return {v: k for k, v in BACKEND_OF_FLAG.items()}[backend].replace("_", "-")


def build(flags: dict) -> tuple[ValConfig, OutputDir]:
    """The frozen configuration and output folder from the parsed flags; every flag must be consumed."""
    sources = {k: flags.pop(k) for k in BACKEND_OF_FLAG}
    backend, model = next((BACKEND_OF_FLAG[k], v) for k, v in sources.items() if v)
    out = OutputDir(flags.pop("project"), flags.pop("name"), flags.pop("exist_ok"))
    nms = NMSConfig(flags.pop("conf_thres"), flags.pop("iou_thres"), flags.pop("max_det"), flags.pop("no_nms"))
    return ValConfig(model, backend, nms=nms, **flags), out


def run(**flags) -> dict:
    cfg, out = build(flags)
    result = validate(cfg)
    path = out.create() / "val_trt.json"
    write_json(path, result)
    LOGGER.info(f"results saved to {path}")
    return result


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine-file", type=str, help="TensorRT engine")
    src.add_argument("--onnx-file", type=str, help="ONNX model (ONNX Runtime)")
    src.add_argument("--weights", type=str, help="a .pt model (PyTorch): the reference for the deployed runtimes")
    p.add_argument("--data", type=str, default=str(ROOT / "data/coco.yaml"), help="dataset.yaml path")
    p.add_argument("--imgsz", "--img", "--img-size", type=int, default=640, help="inference size (pixels)")
    p.add_argument("--batch-size", type=int, default=1, help="batch size")
    p.add_argument("--conf-thres", type=float, default=0.001, help="confidence threshold")
    p.add_argument("--iou-thres", type=float, default=0.7, help="NMS IoU threshold")
    p.add_argument("--max-det", type=int, default=300, help="maximum detections per image")
    p.add_argument("--trust-checkpoint", action="store_true", help="unpickle --weights fully (can run code)")
    p.add_argument("--no-nms", action="store_true", help="NMS-free model: no NMS on its outputs")
    p.add_argument("--device", default="cuda:0", help="CUDA device for TensorRT and PyTorch (cpu for PyTorch on CPU)")
    p.add_argument("--workers", type=int, default=8, help="dataloader workers")
    p.add_argument("--project", default=str(ROOT / "runs/val_trt"), help="save to project/name")
    p.add_argument("--name", default="exp", help="save to project/name")
    p.add_argument("--exist-ok", action="store_true", help="existing project/name ok, do not increment")
    opt = p.parse_args(argv)
    if opt.batch_size < 1 or opt.imgsz % 32:
        p.error("--batch-size must be >= 1 and --imgsz a multiple of 32")
    return opt


def main(argv=None) -> int:
    return cli_main("val_trt.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
