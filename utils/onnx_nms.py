"""NMS inside the exported graph: end-to-end ONNX models with fixed-size outputs.

`add_nms(kind="onnx")` appends standard ONNX operators only: NonMaxSuppression (per class, as upstream's NMS with
multi_label), then the best `max_det` kept (anchor, class) pairs per image by score. TensorRT's ONNX parser maps
NonMaxSuppression to its INMSLayer (onnx-tensorrt's operator table: FP32 and FP16), ONNX Runtime runs it as is,
and `onnx.checker` accepts it. Its outputs are those of TensorRT's EfficientNMS_TRT plugin, so one reader serves
both: num_dets [B, 1] int32, det_boxes [B, K, 4] (x1, y1, x2, y2, input pixels), det_scores [B, K],
det_classes [B, K] int32, and for segmentation det_masks [B, K, H/4, W/4] (the kept boxes' masks at the
prototypes' resolution, cropped to the box and thresholded at 0.5, as upstream's `process_mask`). Entries past
num_dets are zero. The post-processing runs in FP32 (also in FP16 graphs: ONNX Runtime's NonMaxSuppression takes
FP32 only); its nodes are named "nms/..." so the typing lint can tell them from the network.

`add_nms(kind="efficient")` appends the EfficientNMS_TRT plugin (TensorRT <= 10.x and DeepStream setups that
expect it; deprecated since TensorRT 10.12), in the "trt.plugins" domain that NVIDIA's tools use for plugin
nodes, so the graph stays checker-clean. Detection only, and TensorRT alone runs it.

The thresholds go into the graph's metadata (conf_thres, iou_thres, max_det, nms), which `val_trt.py` reports.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NMS_KINDS = ("onnx", "efficient")
OUTPUTS = ("num_dets", "det_boxes", "det_scores", "det_classes")
MASKS = "det_masks"
PREFIX = "nms/"
PLUGIN_DOMAIN = "trt.plugins"


@dataclass(frozen=True)
class NMSSettings:
    conf_thres: float = 0.25
    iou_thres: float = 0.45
    max_det: int = 100
    kind: str = "onnx"

    def __post_init__(self):
        if self.kind not in NMS_KINDS:
            raise ValueError(f"--nms must be one of {NMS_KINDS}, got {self.kind!r}")
        if not (0 <= self.conf_thres <= 1 and 0 <= self.iou_thres <= 1) or self.max_det < 1:
            raise ValueError("--conf-thres and --iou-thres must be in [0, 1], --topk-all >= 1")

    def metadata(self) -> dict[str, str]:
        return {"nms": self.kind, "conf_thres": str(self.conf_thres), "iou_thres": str(self.iou_thres),
                "max_det": str(self.max_det)}


class _Graph:
    """Appends named nodes and constants to a graph."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph, self.n = graph, 0

    def const(self, name: str, value) -> str:
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), PREFIX + name))
        return PREFIX + name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> list[str] | str:
        self.n += 1
        outs = [f"{PREFIX}{op_type.lower()}_{self.n}_{i}" for i in range(n_out)]
        self.graph.node.append(helper.make_node(op_type, inputs, outs, name=f"{PREFIX}{op_type}_{self.n}", **attrs))
        return outs[0] if n_out == 1 else outs


def _dims(value_info: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def add_nms(proto: onnx.ModelProto, nc: int, shapes: dict[str, tuple[int, ...]], settings: NMSSettings
            ) -> onnx.ModelProto:
    """`proto` (outputs output0 [B, 4 + nc (+ nm), A] and, for segmentation, output1 [B, nm, H, W], whose static
    sizes `shapes` gives: an exporter may leave them symbolic) with NMS appended; its outputs replaced by the
    end-to-end ones."""
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    outputs = {o.name: o for o in proto.graph.output}
    segment = "output1" in outputs
    if settings.kind == "efficient":
        if segment:
            raise ValueError("--nms efficient: EfficientNMS_TRT does not say which anchors it kept, so the kept "
                             "boxes' masks cannot follow; use --nms onnx for segmentation models")
        proto = _efficient_nms(proto, nc, settings)
    else:
        proto = _onnx_nms(proto, nc, shapes, settings)
    for key, value in settings.metadata().items():
        proto.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    onnx.checker.check_model(proto)
    return proto


def _onnx_nms(proto: onnx.ModelProto, nc: int, shapes: dict[str, tuple[int, ...]], s: NMSSettings
              ) -> onnx.ModelProto:
    g = _Graph(proto.graph)
    batch = _dims(proto.graph.output[0])[0]
    _, channels, anchors = shapes["output0"]
    nm = channels - 4 - nc
    segment = "output1" in shapes
    k = min(s.max_det, nc * anchors)  # TopK's K must be a constant (TensorRT)
    preds = g.op("Cast", ["output0"], to=TensorProto.FLOAT)
    preds = g.op("Transpose", [preds], perm=[0, 2, 1])                                 # [B, A, 4 + nc + nm]
    xy, wh, scores, *coef = g.op("Split", [preds, g.const("split", np.array([2, 2, nc] + ([nm] if nm else []),
                                                                            np.int64))], n_out=4 if nm else 3, axis=2)
    half = g.op("Mul", [wh, g.const("half", np.array(0.5, np.float32))])
    boxes = g.op("Concat", [g.op("Sub", [xy, half]), g.op("Add", [xy, half])], axis=2)  # [B, A, 4] x1 y1 x2 y2
    scores = g.op("Transpose", [scores], perm=[0, 2, 1])                               # [B, nc, A]
    selected = g.op("NonMaxSuppression", [boxes, scores, g.const("max_per_class", np.array([s.max_det], np.int64)),
                                          g.const("iou", np.array([s.iou_thres], np.float32)),
                                          g.const("conf", np.array([s.conf_thres], np.float32))],
                    center_point_box=0)                                                 # [n, 3] (b, class, anchor)
    kept = g.op("ScatterND", [g.op("Mul", [scores, g.const("zero", np.array(0, np.float32))]), selected,
                              g.op("GatherND", [scores, selected])])                   # kept scores, 0 elsewhere
    flat = g.op("Reshape", [kept, g.const("flat", np.array([0, -1], np.int64))])        # [B, nc * A]
    top_scores, top_index = g.op("TopK", [flat, g.const("k", np.array([k], np.int64))], n_out=2, axis=1)
    a = g.const("anchors", np.array(anchors, np.int64))
    cls = g.op("Div", [top_index, a])
    anchor = g.op("Sub", [top_index, g.op("Mul", [cls, a])])
    valid = g.op("Greater", [top_scores, g.const("nonzero", np.array(0, np.float32))])
    validf = g.op("Cast", [valid], to=TensorProto.FLOAT)
    at_anchor = g.op("Unsqueeze", [anchor, g.const("last", np.array([2], np.int64))])  # [B, K, 1]

    def take(rows: str, width: int) -> str:  # [B, A, width] -> [B, K, width] at the kept anchors
        index = g.op("Expand", [at_anchor, g.const(f"width{width}", np.array([1, 1, width], np.int64))])
        return g.op("GatherElements", [rows, index], axis=1)

    det_boxes = g.op("Mul", [take(boxes, 4), g.op("Unsqueeze", [validf, g.const("last2", np.array([2], np.int64))])])
    num = g.op("ReduceSum", [g.op("Cast", [valid], to=TensorProto.INT32), g.const("axis1", np.array([1], np.int64))],
               keepdims=1)
    classes = g.op("Where", [valid, g.op("Cast", [cls], to=TensorProto.INT32),
                             g.const("minus1", np.array(-1, np.int32))])
    results = {"num_dets": num, "det_boxes": det_boxes, "det_scores": top_scores, "det_classes": classes}
    out_shapes = {"num_dets": [batch, 1], "det_boxes": [batch, k, 4], "det_scores": [batch, k],
                  "det_classes": [batch, k]}
    types = {"num_dets": TensorProto.INT32, "det_classes": TensorProto.INT32}
    if segment:
        _, _, mh, mw = shapes["output1"]
        results[MASKS] = _masks(g, take(coef[0], nm), det_boxes, nm, (mh, mw), pred_input_hw(proto))
        out_shapes[MASKS], types[MASKS] = [batch, k, mh, mw], TensorProto.FLOAT
    del proto.graph.output[:]
    for name, tensor in results.items():
        proto.graph.node.append(helper.make_node("Identity", [tensor], [name], name=f"{PREFIX}{name}"))
        proto.graph.output.append(helper.make_tensor_value_info(name, types.get(name, TensorProto.FLOAT),
                                                                out_shapes[name]))
    return proto


def pred_input_hw(proto: onnx.ModelProto) -> tuple[int, int]:
    dims = _dims(proto.graph.input[0])
    return int(dims[2]), int(dims[3])


def _masks(g: _Graph, coef: str, boxes: str, nm: int, proto_hw: tuple[int, int], input_hw: tuple[int, int]) -> str:
    """sigmoid(coefficients @ prototypes), cropped to the box (scaled to the prototypes' grid), > 0.5."""
    mh, mw = proto_hw
    protos = g.op("Cast", ["output1"], to=TensorProto.FLOAT)
    flat = g.op("Reshape", [protos, g.const("proto_flat", np.array([0, nm, mh * mw], np.int64))])
    masks = g.op("Sigmoid", [g.op("MatMul", [coef, flat])])                             # [B, K, mh * mw]
    masks = g.op("Reshape", [masks, g.const("mask_shape", np.array([0, 0, mh, mw], np.int64))])
    scale = np.array([mw / input_hw[1], mh / input_hw[0], mw / input_hw[1], mh / input_hw[0]], np.float32)
    grid_boxes = g.op("Mul", [boxes, g.const("to_grid", scale)])
    x1, y1, x2, y2 = g.op("Split", [grid_boxes, g.const("split4", np.array([1, 1, 1, 1], np.int64))], n_out=4, axis=2)
    x1, y1, x2, y2 = (g.op("Unsqueeze", [t, g.const(f"hw{i}", np.array([3], np.int64))])  # [B, K, 1, 1]
                      for i, t in enumerate((x1, y1, x2, y2)))
    cols = g.const("cols", np.arange(mw, dtype=np.float32).reshape(1, 1, 1, mw))
    rows = g.const("rows", np.arange(mh, dtype=np.float32).reshape(1, 1, mh, 1))
    inside = g.op("And", [g.op("And", [g.op("GreaterOrEqual", [cols, x1]), g.op("Less", [cols, x2])]),
                          g.op("And", [g.op("GreaterOrEqual", [rows, y1]), g.op("Less", [rows, y2])])])
    cropped = g.op("Mul", [masks, g.op("Cast", [inside], to=TensorProto.FLOAT)])
    return g.op("Cast", [g.op("Greater", [cropped, g.const("half_mask", np.array(0.5, np.float32))])],
                to=TensorProto.FLOAT)


def _efficient_nms(proto: onnx.ModelProto, nc: int, s: NMSSettings) -> onnx.ModelProto:
    """EfficientNMS_TRT on the predictions in their own type (an FP16 graph's NMS runs in FP16; its boxes and scores
    are cast back to the type of the graph's outputs)."""
    graph = proto.graph
    out = graph.output[0]
    dtype = out.type.tensor_type.elem_type
    preds = out.name
    cast = next((n for n in graph.node if n.output[0] == out.name and n.op_type == "Cast"), None)
    if cast is not None:  # FP16 graph with FP32 outputs: NMS on the FP16 predictions
        graph.node.remove(cast)
        preds = cast.input[0]
    batch = _dims(out)[0]
    g = _Graph(graph)
    boxes, scores = g.op("Split", [g.op("Transpose", [preds], perm=[0, 2, 1]),
                                   g.const("split", np.array([4, nc], np.int64))], n_out=2, axis=2)
    plugin_outputs = list(OUTPUTS)
    if cast is not None:
        plugin_outputs[1:3] = [f"{PREFIX}det_boxes_fp16", f"{PREFIX}det_scores_fp16"]
    graph.node.append(helper.make_node(
        "EfficientNMS_TRT", [boxes, scores], plugin_outputs, name=f"{PREFIX}EfficientNMS_TRT", domain=PLUGIN_DOMAIN,
        background_class=-1, box_coding=1, iou_threshold=float(s.iou_thres), max_output_boxes=int(s.max_det),
        plugin_version="1", score_activation=0, score_threshold=float(s.conf_thres)))
    if cast is not None:
        graph.node.extend(helper.make_node("Cast", [f"{PREFIX}{n}_fp16"], [n], to=dtype, name=f"{PREFIX}{n}_cast")
                          for n in ("det_boxes", "det_scores"))
    del graph.output[:]
    graph.output.extend([helper.make_tensor_value_info("num_dets", TensorProto.INT32, [batch, 1]),
                         helper.make_tensor_value_info("det_boxes", dtype, [batch, s.max_det, 4]),
                         helper.make_tensor_value_info("det_scores", dtype, [batch, s.max_det]),
                         helper.make_tensor_value_info("det_classes", TensorProto.INT32, [batch, s.max_det])])
    proto.opset_import.append(helper.make_opsetid(PLUGIN_DOMAIN, 1))
    return proto
