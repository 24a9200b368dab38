"""COCO-style mAP of a deployed model: a TensorRT engine, or the same ONNX run by ONNX Runtime. Detection, or
instance segmentation (box and mask mAP; recognised by the prototype output `output1`, or `--task segment`).

    python val_trt.py --engine-file model.engine --data data/coco.yaml --imgsz 640 --batch-size 8
    python val_trt.py --onnx-file model.onnx --data data/coco.yaml --backend onnxruntime

Preprocessing is upstream val's letterbox (square --imgsz, pad 0.5 of a stride); the last partial batch is
padded up to the engine's batch where the engine's batch is fixed. Metrics come from upstream's
`ap_per_class`; with a COCO dataset (annotations json present) pycocotools' numbers are reported too.
Engines built with EfficientNMS_TRT (export_qat.py --include onnx_end2end) are read through their
num_dets/det_boxes/det_scores/det_classes outputs; --no-nms takes NMS-free outputs as they are.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from utils.general import (LOGGER, TQDM_BAR_FORMAT, colorstr, increment_path, non_max_suppression,  # noqa: E402
                           scale_boxes, xywh2xyxy)
from utils.io_utils import cli_main  # noqa: E402
from utils.metrics import ap_per_class  # noqa: E402
from utils.qat_utils import TASKS, load_data, metrics_table, task_dataloader, write_json  # noqa: E402

PREFIX = colorstr("val_trt: ")
BACKENDS = ("tensorrt", "onnxruntime", "pytorch")


# --------------------------------------------------------------------------------------------------
# Runners: a batch of float 0-1 NCHW images in, a dict of named outputs out
# --------------------------------------------------------------------------------------------------
class OnnxRuntimeRunner:
    def __init__(self, path: str | Path):
        from models.export import ort_session
        if "EfficientNMS_TRT" in _onnx_ops(path):
            raise ValueError(f"{path}: has an EfficientNMS_TRT node, which only TensorRT runs; "
                             "evaluate the plain export (--include onnx) with ONNX Runtime")
        self.session = ort_session(path)
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.input_dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
        self.input_shape = [d if isinstance(d, int) else None for d in inp.shape]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.output_shapes = {o.name: list(o.shape) for o in self.session.get_outputs()}

    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        outs = self.session.run(None, {self.input_name: images.cpu().numpy().astype(self.input_dtype)})
        return {n: torch.from_numpy(o).float() if o.dtype == np.float16 else torch.from_numpy(o)
                for n, o in zip(self.output_names, outs)}


def _onnx_ops(path) -> set[str]:
    import onnx
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


class TensorRTRunner:
    """TensorRT 10/11: named I/O tensors, set_input_shape + set_tensor_address + execute_async_v3, with torch
    CUDA tensors as the device buffers (no pycuda)."""

    def __init__(self, path: str | Path, device: str = "cuda:0"):
        import tensorrt as trt
        self.trt = trt
        self.device = torch.device(device)
        logger = trt.Logger(trt.Logger.WARNING)
        trt.init_libnvinfer_plugins(logger, "")  # EfficientNMS_TRT
        with open(path, "rb") as f, trt.Runtime(logger) as runtime:
            self.engine = runtime.deserialize_cuda_engine(f.read())
        if self.engine is None:
            raise ValueError(f"{path}: TensorRT could not deserialize this engine (built by another TensorRT version "
                             "or for another GPU?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.output_shapes = {n: [d if d >= 0 else None for d in self.engine.get_tensor_shape(n)]
                              for n in self.output_names}
        self.input_name = self.inputs[0]
        shape = list(self.engine.get_tensor_shape(self.input_name))
        self.input_shape = [None if d < 0 else d for d in shape]
        self.max_shape = list(self.engine.get_tensor_profile_shape(self.input_name, 0)[2]) if None in self.input_shape \
            else shape
        self.stream = torch.cuda.Stream(device=self.device)

    def _torch_dtype(self, name):
        return {self.trt.DataType.FLOAT: torch.float32, self.trt.DataType.HALF: torch.float16,
                self.trt.DataType.INT32: torch.int32, self.trt.DataType.INT64: torch.int64,
                self.trt.DataType.INT8: torch.int8, self.trt.DataType.BOOL: torch.bool}[self.engine.get_tensor_dtype(name)]

    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        x = images.to(self.device, self._torch_dtype(self.input_name)).contiguous()
        self.context.set_input_shape(self.input_name, tuple(x.shape))
        self.context.set_tensor_address(self.input_name, x.data_ptr())
        outputs = {}
        for name in self.output_names:
            out = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=self._torch_dtype(name),
                              device=self.device)
            self.context.set_tensor_address(name, out.data_ptr())
            outputs[name] = out
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        self.stream.synchronize()
        return {k: v.float().cpu() if v.is_floating_point() else v.cpu() for k, v in outputs.items()}


class PyTorchRunner:
    """The .pt model itself through the same loop (same letterbox, same NMS): the reference the deployed
    runtimes are compared with, image for image."""

    def __init__(self, path: str | Path, device: str, trust: bool = False):
        from models.export import load_for_export, output_names
        from utils.onnx_utils import detect_export_mode
        self.device = torch.device(device)
        self.model = load_for_export(path, self.device, trust=trust)
        self._export_mode = detect_export_mode
        self.input_shape = [None, 3, None, None]
        self.output_names = list(output_names(self.model))

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        with self._export_mode(self.model):
            out = self.model(images.to(self.device))
        return {n: t.float().cpu() for n, t in zip(self.output_names, out if isinstance(out, tuple) else (out,))}


def make_runner(backend: str, engine_file: str | None, onnx_file: str | None, weights: str | None, device: str,
                trust: bool = False):
    path, flag = {"tensorrt": (engine_file, "--engine-file"), "onnxruntime": (onnx_file, "--onnx-file"),
                  "pytorch": (weights, "--weights")}[backend]
    if not path:
        raise ValueError(f"--backend {backend} needs {flag}")
    if not Path(path).is_file():  # before any import: a typo is named as a typo
        raise FileNotFoundError(f"{flag} {path}: file not found")
    if backend == "tensorrt":
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            raise ValueError("TensorRT is not installed here (./install_dependencies.sh --tensorrt says why); "
                             "evaluate the ONNX with --backend onnxruntime --onnx-file instead") from None
        return TensorRTRunner(path, f"cuda:{device}" if device.isdigit() else
                              device if device.startswith("cuda") else "cuda:0")
    if backend == "pytorch":
        cuda = f"cuda:{device}" if device.isdigit() else device
        return PyTorchRunner(path, cuda if cuda.startswith("cuda") and torch.cuda.is_available() else "cpu", trust)
    return OnnxRuntimeRunner(path)


def model_task(runner) -> str:
    """"segment" when the model also outputs mask prototypes (a 4-D second output), else "detect"."""
    shapes = getattr(runner, "output_shapes", {})
    names = list(runner.output_names)
    if len(names) == 2 and (shapes.get(names[1]) is None or len(shapes[names[1]]) == 4):
        return "segment"
    return "detect"


def check_outputs(runner, nc: int, model: str, task: str = "detect") -> None:
    """Refuse models whose outputs are not what this loop evaluates: EfficientNMS_TRT's four tensors, or
    one [batch, 4 + nc, anchors] prediction tensor (e.g. export_yoloV9.py's DeepStream [batch, anchors, 6]);
    for segmentation [batch, 4 + nc + nm, anchors] and the prototypes [batch, nm, h, w]."""
    names = list(runner.output_names)
    if "num_dets" in names:
        if task == "segment":
            raise ValueError(f"{model}: an end-to-end (EfficientNMS_TRT) model has no masks; evaluate the plain export")
        return
    shapes = getattr(runner, "output_shapes", {})
    if task == "segment":
        proto = shapes.get(names[1]) if len(names) == 2 else None
        if len(names) != 2 or (proto is not None and len(proto) != 4):
            raise ValueError(f"{model}: --task segment needs two outputs (predictions, prototypes [batch, nm, h, w]); "
                             f"this model has {names}")
        nm = proto[1] if proto is not None and isinstance(proto[1], int) else None
        pred = shapes.get(names[0])
        if nm and pred is not None and isinstance(pred[1], int) and pred[1] != 4 + nc + nm:
            raise ValueError(f"{model}: output {names[0]} has shape {pred}, expected [batch, {4 + nc + nm} "
                             f"(4 + nc + {nm} mask coefficients), anchors] for the --data's {nc} classes")
        return
    shape = shapes.get(names[0])
    if shape is None or len(shape) != 3:
        if shape is not None:
            raise ValueError(f"{model}: output {names[0]} has shape {shape}; expected [batch, 4 + {nc}, anchors]")
        return
    channels = shape[1]
    if isinstance(channels, int) and channels != 4 + nc:
        hint = (" (DeepStream's [batch, anchors, 6] layout: evaluate export_qat.py's ONNX instead)"
                if shape[2] == 6 else "")
        raise ValueError(f"{model}: output {names[0]} has shape {shape}, expected [batch, {4 + nc} (4 + nc), anchors] "
                         f"for the --data's {nc} classes{hint}")


# --------------------------------------------------------------------------------------------------
# Detections and metrics
# --------------------------------------------------------------------------------------------------
def detections(outputs: dict[str, torch.Tensor], conf_thres: float, iou_thres: float, no_nms: bool,
               max_det: int = 300, nm: int = 0) -> list[torch.Tensor]:
    """Per image (n, 6 + nm) tensors [x1, y1, x2, y2, conf, cls, nm mask coefficients] in network-input pixels."""
    if "num_dets" in outputs:  # EfficientNMS_TRT
        n, boxes, scores, classes = (outputs[k] for k in ("num_dets", "det_boxes", "det_scores", "det_classes"))
        return [torch.cat([boxes[i, :int(n[i])], scores[i, :int(n[i]), None], classes[i, :int(n[i]), None].float()], 1)
                for i in range(len(n))]
    pred = next(iter(outputs.values()))
    if not no_nms:
        return non_max_suppression(pred, conf_thres, iou_thres, multi_label=True, max_det=max_det, nm=nm)
    out = []
    for x in pred.transpose(1, 2):  # NMS-free: best class per anchor, confidence filter, top max_det
        conf, cls = x[:, 4:].max(1)
        keep = conf > conf_thres
        det = torch.cat([xywh2xyxy(x[keep, :4]), conf[keep, None], cls[keep, None].float()], 1)
        out.append(det[det[:, 4].argsort(descending=True)[:max_det]])
    return out


def _match(pred: torch.Tensor, labels: torch.Tensor, iouv: torch.Tensor) -> torch.Tensor:
    from val import process_batch
    return process_batch(pred, labels, iouv)


def evaluate_runner(runner, loader, nc: int, conf_thres: float, iou_thres: float, no_nms: bool,
                    fixed_batch: int | None, task: str = "detect") -> tuple[dict, list]:
    """Upstream val's metric loop over any runner; for segmentation also upstream segment/val.py's mask
    assembly and matching (instance masks overlapped into one per image, at the prototypes' resolution).
    Returns metrics and COCO-json style box predictions."""
    segment = task == "segment"
    if segment:
        from segment.val import process_batch as match_masks
        from utils.segment.general import process_mask
    iouv = torch.linspace(0.5, 0.95, 10)
    stats, jdict = [], []
    seen, t_infer = 0, 0.0
    for batch in tqdm(loader, desc=f"{PREFIX}evaluating", bar_format=TQDM_BAR_FORMAT):
        im, targets, paths, shapes = batch[:4]
        images = im.float() / 255
        nb, _, height, width = images.shape
        if fixed_batch and nb < fixed_batch:  # a static engine takes full batches only
            images = torch.cat([images, images.new_zeros(fixed_batch - nb, *images.shape[1:])])
        t0 = time.perf_counter()
        outputs = runner(images)
        t_infer += time.perf_counter() - t0
        outputs = {k: v[:nb] for k, v in outputs.items()}
        protos = outputs.pop(next(n for n, v in outputs.items() if v.dim() == 4)) if segment else None  # by shape
        preds = detections(outputs, conf_thres, iou_thres, no_nms, nm=0 if protos is None else protos.shape[1])
        targets[:, 2:] *= torch.tensor((width, height, width, height))
        for si, pred in enumerate(preds):
            labels = targets[targets[:, 0] == si, 1:]
            seen += 1
            correct = correct_masks = torch.zeros(len(pred), len(iouv), dtype=torch.bool)
            if len(pred) == 0:
                if len(labels):
                    stats.append((correct, correct_masks, torch.zeros(0), torch.zeros(0), labels[:, 0]))
                continue
            predn = pred.clone()
            scale_boxes(images[si].shape[1:], predn[:, :4], shapes[si][0], shapes[si][1])
            if len(labels):
                tbox = xywh2xyxy(labels[:, 1:5])
                scale_boxes(images[si].shape[1:], tbox, shapes[si][0], shapes[si][1])
                labelsn = torch.cat((labels[:, 0:1], tbox), 1)
                correct = _match(predn, labelsn, iouv)
                if segment:
                    pred_masks = process_mask(protos[si], pred[:, 6:], pred[:, :4], shape=images[si].shape[1:])
                    correct_masks = match_masks(predn, labelsn, iouv, pred_masks, batch[4][[si]].float(),
                                                overlap=True, masks=True)
            stats.append((correct, correct_masks, pred[:, 4], pred[:, 5], labels[:, 0]))
            stem = Path(paths[si]).stem
            for p in predn.tolist():
                jdict.append({"image_id": int(stem) if stem.isnumeric() else stem, "category_id": int(p[5]),
                              "bbox": [round(p[0], 3), round(p[1], 3), round(p[2] - p[0], 3), round(p[3] - p[1], 3)],
                              "score": round(p[4], 5)})
    stats = [torch.cat(x, 0).numpy() for x in zip(*stats)] if stats else []
    metrics = _summary(stats, 0, nc, "")
    if segment:
        metrics.update(_summary(stats, 1, nc, "mask_"))
    metrics.update({"images": seen, "ms_per_image": round(1000 * t_infer / max(seen, 1), 3)})
    return metrics, jdict


def _summary(stats: list, column: int, nc: int, prefix: str) -> dict:
    """Mean P, R, mAP50, mAP50-95 of the true-positive column `column` (0: boxes, 1: masks) of `stats`."""
    mp = mr = map50 = map_ = 0.0
    if len(stats) and stats[column].any():
        _, _, p, r, _, ap, _ = ap_per_class(stats[column], *stats[2:], plot=False, names={i: str(i) for i in range(nc)})
        mp, mr, map50, map_ = p.mean(), r.mean(), ap[:, 0].mean(), ap.mean(1).mean()
    return {f"{prefix}ap": round(float(map_), 5), f"{prefix}ap50": round(float(map50), 5),
            f"{prefix}precision": round(float(mp), 5), f"{prefix}recall": round(float(mr), 5)}


def coco_eval(jdict: list, data_dict: dict) -> dict | None:
    """pycocotools mAP when the dataset ships COCO annotations (instances_val2017.json)."""
    anno = Path(data_dict.get("path", "")) / "annotations" / "instances_val2017.json"
    if not anno.is_file() or not jdict:
        return None
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from utils.general import coco80_to_coco91_class
    c91 = coco80_to_coco91_class()
    preds = [{**d, "category_id": c91[d["category_id"]]} for d in jdict]
    gt = COCO(str(anno))
    ev = COCOeval(gt, gt.loadRes(preds), "bbox")
    ev.params.imgIds = sorted({d["image_id"] for d in preds})
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return {"coco_ap": round(float(ev.stats[0]), 5), "coco_ap50": round(float(ev.stats[1]), 5)}


def run(engine_file, onnx_file, weights, data, imgsz, batch_size, conf_thres, iou_thres, backend, no_nms, device,
        workers, project, name, exist_ok, trust_checkpoint=False, task=None, **_) -> dict:
    data_dict = load_data(data)
    runner = make_runner(backend, engine_file, onnx_file, weights, device, trust_checkpoint)
    model_file = engine_file or onnx_file or weights
    task = task or model_task(runner)
    check_outputs(runner, int(data_dict["nc"]), model_file, task)
    if task == "segment" and no_nms:
        raise ValueError("--no-nms: segmentation models are evaluated with NMS (their masks follow the kept boxes)")
    fixed = runner.input_shape
    if fixed[2] is not None and (fixed[2], fixed[3]) != (imgsz, imgsz):
        raise ValueError(f"the model's input is {fixed[2]}x{fixed[3]} but --imgsz is {imgsz}")
    fixed_batch = fixed[0]
    if fixed_batch is not None and batch_size != fixed_batch:
        raise ValueError(f"the model has a fixed batch of {fixed_batch} but --batch-size is {batch_size}")
    max_batch = getattr(runner, "max_shape", [None])[0]
    if max_batch and batch_size > max_batch:
        raise ValueError(f"--batch-size {batch_size} exceeds the engine's largest batch {max_batch}")
    loader = _val_loader(task, data_dict, imgsz, batch_size, workers)
    metrics, jdict = evaluate_runner(runner, loader, int(data_dict["nc"]), conf_thres, iou_thres, no_nms, fixed_batch,
                                     task)
    result = {"backend": backend, "model": str(model_file), "data": str(data), "task": task, "imgsz": imgsz,
              "batch_size": batch_size, **metrics}
    coco = coco_eval(jdict, data_dict)
    if coco:
        result.update(coco)
    label = {"tensorrt": "TensorRT", "onnxruntime": "ONNX Runtime", "pytorch": "PyTorch (same letterbox)"}[backend]
    result["table"] = metrics_table([(label, metrics)])
    LOGGER.info("\n" + result["table"] + f"\n{metrics['ms_per_image']} ms/image ({backend}, batch {batch_size})")
    save_dir = Path(increment_path(Path(project) / name, exist_ok=exist_ok))
    save_dir.mkdir(parents=True, exist_ok=True)
    write_json(save_dir / "val_trt.json", result)
    return result


def _val_loader(task: str, data_dict: dict, imgsz: int, batch_size: int, workers: int):
    """Square letterboxed validation batches; segmentation batches carry the instance masks."""
    return task_dataloader(task, data_dict["val"], imgsz, batch_size, 32, pad=0.5, rect=False, workers=workers,
                           prefix=colorstr("val: "))[0]


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
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="tensorrt (with --engine-file), onnxruntime (with --onnx-file) or pytorch (with --weights)")
    p.add_argument("--trust-checkpoint", action="store_true", help="unpickle --weights fully (can run code)")
    p.add_argument("--no-nms", action="store_true", help="NMS-free model: no NMS on its outputs")
    p.add_argument("--task", choices=TASKS, default=None,
                   help="what the model predicts (default: from its outputs; a prototype output means segment)")
    p.add_argument("--device", default="cuda:0", help="CUDA device for TensorRT")
    p.add_argument("--workers", type=int, default=8, help="dataloader workers")
    p.add_argument("--project", default=str(ROOT / "runs/val_trt"), help="save to project/name")
    p.add_argument("--name", default="exp", help="save to project/name")
    p.add_argument("--exist-ok", action="store_true", help="existing project/name ok, do not increment")
    opt = p.parse_args(argv)
    given = "tensorrt" if opt.engine_file else "onnxruntime" if opt.onnx_file else "pytorch"
    opt.backend = opt.backend or given
    if opt.backend != given:
        p.error(f"--backend {opt.backend} does not run the file given: use --engine-file (tensorrt), "
                "--onnx-file (onnxruntime) or --weights (pytorch)")
    if opt.batch_size < 1 or opt.imgsz % 32:
        p.error("--batch-size must be >= 1 and --imgsz a multiple of 32")
    return opt


def main(argv=None) -> int:
    return cli_main("val_trt.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
