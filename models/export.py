"""ONNX export steps shared by export_qat.py and export_yoloV9.py: loading, export, EfficientNMS_TRT,
onnxslim, atomic save, lint, and the ONNX Runtime parity check."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import TensorProto, helper

from models.checkpoint import load_float_model, load_quantized_model, read_checkpoint
from models.quantize import is_quantized
from models.task import task_of
from utils.general import LOGGER, colorstr
from utils.io_utils import atomic_write
from utils.onnx_fp16 import FP16_OPSET, to_fp16
from utils.onnx_utils import export_onnx
from utils.qdq_lint import LintReport, lint

PREFIX = colorstr("export: ")
NMS_OUTPUTS = ("num_dets", "det_boxes", "det_scores", "det_classes")
DTYPES = ("fp16", "fp32")  # the type of everything in a graph that is not INT8


def load_for_export(weights: str | Path, device: str | torch.device = "cpu", inplace: bool = False,
                    trust: bool = False) -> nn.Module:
    """Quantized checkpoints as they are; float ones fused. Heads set to (not) modify tensors in place."""
    ckpt = read_checkpoint(weights, trust)
    load = load_quantized_model if is_quantized(ckpt["model"]) else load_float_model
    model = load(weights, device, trust)
    for m in model.modules():
        if hasattr(m, "inplace"):
            m.inplace = inplace
    return model


def class_names(model: nn.Module) -> list[str]:
    names = getattr(model, "names", None)
    if isinstance(names, dict):
        return [names[k] for k in sorted(names)]
    if names:
        return list(names)
    return [f"class{i}" for i in range(int(model.model[-1].nc))]


def count_qdq(model: onnx.ModelProto) -> tuple[int, int]:
    ops = [n.op_type for n in model.graph.node]
    return ops.count("QuantizeLinear"), ops.count("DequantizeLinear")


def export_to_proto(model: nn.Module, im: torch.Tensor, opset: int, dynamic: bool,
                    wrapper: nn.Module | None = None, output_names=("output0",)) -> onnx.ModelProto:
    """Export through a temp file (large models exceed protobuf's in-memory limits) and load it back."""
    module = model if wrapper is None else wrapper
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "model.onnx"
        export_onnx(module, im, f, opset=opset, dynamic=dynamic, output_names=output_names)
        proto = onnx.load(str(f))
    onnx.checker.check_model(proto)
    return proto


def export_graph(model: nn.Module, im: torch.Tensor, opset: int, dynamic: bool, simplify_: bool, dtype: str,
                 io_dtype: str, wrapper: nn.Module | None = None, output_names=("output0",)) -> onnx.ModelProto:
    """The deployable graph: traced in FP32, optionally simplified, then (dtype fp16) with every non-INT8
    part in FP16 for strongly typed TensorRT builds (utils/onnx_fp16.py)."""
    if dtype == "fp16":  # FP16 Q/DQ scales need opset 19; traced there, not bumped (Reduce ops changed at 18)
        opset = max(opset, FP16_OPSET)
    proto = export_to_proto(model, im, opset, dynamic, wrapper, output_names)
    if simplify_:
        proto = simplify(proto)
    if dtype == "fp16":
        proto = to_fp16(proto, io_dtype)
    elif io_dtype != "fp32":
        raise ValueError("--io-dtype fp16 needs --dtype fp16")
    return proto


def simplify(proto: onnx.ModelProto) -> onnx.ModelProto:
    """onnxslim, refusing any result that lost Q/DQ pairs (TensorRT would then run those layers in FP16)."""
    import onnxslim
    before = count_qdq(proto)
    slim = onnxslim.slim(proto)
    after = count_qdq(slim)
    if after != before:
        LOGGER.warning(f"{PREFIX}onnxslim changed Q/DQ counts {before} -> {after}; keeping the unsimplified graph")
        return proto
    return slim


def add_efficient_nms(proto: onnx.ModelProto, num_classes: int, conf_thres: float, iou_thres: float, max_det: int,
                      class_agnostic: bool = False) -> onnx.ModelProto:
    """Append TensorRT's EfficientNMS_TRT plugin to a (batch, 4+nc, anchors) xywh + scores output.

    Outputs: num_dets [B,1] int32, det_boxes [B,max_det,4] float (x1,y1,x2,y2), det_scores [B,max_det] float,
    det_classes [B,max_det] int32.
    """
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    graph = proto.graph
    out = graph.output[0]
    dtype = out.type.tensor_type.elem_type  # the plugin's boxes and scores keep the predictions' type
    preds = out.name
    cast = next((n for n in graph.node if n.output[0] == out.name and n.op_type == "Cast"), None)
    if cast is not None:  # an FP16 graph with FP32 outputs: NMS runs on the FP16 predictions, its outputs are cast
        graph.node.remove(cast)
        preds = cast.input[0]
    nc = num_classes
    batch_dim = out.type.tensor_type.shape.dim[0]
    batch = batch_dim.dim_param or batch_dim.dim_value or "batch"
    const = [helper.make_tensor("nms_split", TensorProto.INT64, [2], [4, nc])]
    graph.initializer.extend(const)
    plugin_outputs = list(NMS_OUTPUTS)
    if cast is not None:
        plugin_outputs[1:3] = ["det_boxes_fp16", "det_scores_fp16"]
    graph.node.extend([
        helper.make_node("Transpose", [preds], ["nms_preds"], perm=[0, 2, 1], name="nms_transpose"),
        helper.make_node("Split", ["nms_preds", "nms_split"], ["nms_boxes", "nms_scores"], axis=2, name="nms_split"),
        helper.make_node("EfficientNMS_TRT", ["nms_boxes", "nms_scores"], plugin_outputs, name="EfficientNMS_TRT",
                         background_class=-1, box_coding=1, iou_threshold=float(iou_thres),
                         max_output_boxes=int(max_det), plugin_version="1", score_activation=0,
                         score_threshold=float(conf_thres), **({"class_agnostic": 1} if class_agnostic else {})),
    ])
    if cast is not None:
        graph.node.extend(helper.make_node("Cast", [f"{n}_fp16"], [n], to=dtype, name=f"{n}_to_fp32")
                          for n in ("det_boxes", "det_scores"))
    del graph.output[:]
    graph.output.extend([
        helper.make_tensor_value_info("num_dets", TensorProto.INT32, [batch, 1]),
        helper.make_tensor_value_info("det_boxes", dtype, [batch, max_det, 4]),
        helper.make_tensor_value_info("det_scores", dtype, [batch, max_det]),
        helper.make_tensor_value_info("det_classes", TensorProto.INT32, [batch, max_det]),
    ])
    LOGGER.info(f"{PREFIX}EfficientNMS_TRT appended ({nc} classes, max {max_det} detections per image)")
    return proto


def save_onnx(proto: onnx.ModelProto, path: Path, exist_ok: bool) -> Path:
    """Atomic write; an existing file is only replaced with exist_ok."""
    return atomic_write(path, lambda tmp: onnx.save(proto, tmp), exist_ok)


def report_lint(proto: onnx.ModelProto) -> LintReport:
    report = lint(proto)
    (LOGGER.warning if report.problems else LOGGER.info)(report.summary())
    return report


# --------------------------------------------------------------------------------------------------
# Parity with ONNX Runtime
# --------------------------------------------------------------------------------------------------
ORT_FP16_QUANTIZE_FIXED = (1, 32)  # earlier CPU kernels truncate FP16 QuantizeLinear (onnxruntime PR 32452)


def ort_session(path: str | Path, optimize: bool = False):
    """CPU session. Without `optimize`, ONNX Runtime executes the Q/DQ graph as written (DQ then float ops),
    which is the arithmetic the PyTorch fake-quant model does; with it, ORT fuses into its own int8 kernels.
    An FP16 Q/DQ graph needs onnxruntime >= 1.32: older CPU kernels round FP16 QuantizeLinear toward zero."""
    import onnxruntime as ort
    version = tuple(int(v) for v in ort.__version__.split(".")[:2])
    if version < ORT_FP16_QUANTIZE_FIXED and _has_fp16_quantize(path):
        raise ValueError(f"{path}: an FP16 Q/DQ graph, which onnxruntime {ort.__version__} evaluates wrongly (its CPU "
                         "QuantizeLinear truncates FP16 instead of rounding); use onnxruntime >= 1.32, or export "
                         "with --dtype fp32 to check it here")
    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _has_fp16_quantize(path: str | Path) -> bool:
    graph = onnx.load(str(path), load_external_data=False).graph
    consts = {t.name: t.data_type for t in graph.initializer}
    consts.update({n.output[0]: a.t.data_type for n in graph.node if n.op_type == "Constant" for a in n.attribute
                   if a.name == "value"})
    return any(n.op_type == "QuantizeLinear" and consts.get(n.input[1]) == TensorProto.FLOAT16 for n in graph.node)


# Parity tolerances for detections. ONNX Runtime and PyTorch compute the same Q/DQ arithmetic but sum each
# convolution in another order, so a value sitting on an INT8 rounding boundary can land one step (1/127 of the
# quantizer's range) apart and carry that step downstream. In the head a step of a class conv's input moves a
# logit by |w| x scale and the score by at most a quarter of that; a few such flips move a box edge by a pixel or
# two and a score by a few hundredths (seen on the trained demo model: IoU >= 0.95, scores within 0.064 for the
# FP32 graph and 0.12 for the FP16 graph, whose activations are also rounded to FP16). A wrong scale, a missing
# quantizer or a transposed axis moves them far more.
SCORE_TOL = 0.1
MATCH_IOU = 0.8


def candidates(pred: torch.Tensor, conf_thres: float, nc: int) -> list[torch.Tensor]:
    """Every (anchor, class) pair scoring above `conf_thres`, before NMS: per image (n, 6) x1, y1, x2, y2, score,
    class."""
    from utils.general import xywh2xyxy
    out = []
    for x in pred.transpose(1, 2):  # (anchors, 4 + nc + nm)
        anchor, cls = torch.where(x[:, 4:4 + nc] > conf_thres)
        out.append(torch.cat([xywh2xyxy(x[anchor, :4]), x[anchor, 4 + cls, None], cls[:, None].float()], 1))
    return out


def matched_detections(ref: list[torch.Tensor], pred: torch.Tensor, conf_thres: float, nc: int) -> tuple[int, int]:
    """(matched, counted): reference detections after NMS scoring at least conf_thres + SCORE_TOL (nearer the
    threshold a rounding step decides whether a box exists at all) for which the other runtime's raw predictions
    `pred` hold a candidate of the same class, IoU >= MATCH_IOU and score within SCORE_TOL. Matching against the
    candidates before NMS, not the boxes after it: near-equal scores make NMS keep either of two boxes."""
    from utils.metrics import box_iou
    counted = matched = 0
    for r, g in zip(ref, candidates(pred, conf_thres - SCORE_TOL, nc)):
        r = r[r[:, 4] >= conf_thres + SCORE_TOL]
        counted += len(r)
        if len(r) and len(g):
            close = ((box_iou(r[:, :4], g[:, :4]) >= MATCH_IOU) & (r[:, 5:6] == g[:, 5].unsqueeze(0))
                     & ((r[:, 4:5] - g[:, 4].unsqueeze(0)).abs() <= SCORE_TOL))
            matched += int(close.any(1).sum())
    return matched, counted


def verify_parity(model: nn.Module, onnx_path: str | Path, images: list[torch.Tensor],
                  conf_thres: float = 0.25, iou_thres: float = 0.45) -> dict:
    """The ONNX run by ONNX Runtime against the PyTorch model on real images: the norm-relative error of every
    output (a segmentation model's prototypes too), and the detections after NMS (`matched_detections`)."""
    from models.evaluate import NMSConfig, detections
    from models.runners import OnnxRuntimeRunner, TorchRunner
    torch_runner, ort_runner = TorchRunner(model), OnnxRuntimeRunner(onnx_path)
    nms = NMSConfig(conf_thres, iou_thres)
    nm = int(model.model[-1].nm) if torch_runner.task.has_masks else 0
    nc = int(model.model[-1].nc)
    rel_err = dict.fromkeys(torch_runner.output_names, 0.0)
    max_abs, matched, counted = 0.0, 0, 0
    t0 = time.perf_counter()
    for im in images:
        refs, gots = torch_runner(im), ort_runner(im)
        for name, r in refs.items():
            diff = (gots[name].float() - r).abs()
            max_abs = max(max_abs, float(diff.max()))
            rel_err[name] = max(rel_err[name], float(diff.norm() / r.norm().clamp_min(1e-12)))
        first = torch_runner.output_names[0]
        m, c = matched_detections(detections({first: refs[first]}, nms, nm), gots[first], conf_thres, nc)
        matched, counted = matched + m, counted + c
    return {"images": sum(len(im) for im in images), "rel_err": rel_err, "max_abs_err": max_abs,
            "detections_counted": counted, "detections_matched": matched / counted if counted else None,
            "seconds": round(time.perf_counter() - t0, 2)}
