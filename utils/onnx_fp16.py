"""FP16 ONNX graphs for strongly typed TensorRT builds.

TensorRT 11 builds every network strongly typed: each layer runs in the type the ONNX gives its tensors, and
trtexec has no --fp16/--int8 any more. A Q/DQ graph exported in FP32 would therefore build INT8 convolutions
with FP32 everywhere else, slower than the FP16 baseline. `to_fp16` rewrites a float32 graph so that all
floating-point compute is FP16: initializers and constants, Q/DQ scales (so DequantizeLinear yields FP16),
casts to float, and every intermediate tensor. What an operator's schema only accepts as float32 stays float32
(Resize's roi and scales, shape-like inputs). The graph's inputs and outputs stay float32 behind Cast nodes
(`io_dtype="fp32"`, deployment code unchanged) or become FP16. QuantizeLinear with FP16 scales needs opset 19.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

FP16_OPSET = 19
# (op, input index) that the ONNX schema types as float32 only, whatever the data type
_FLOAT32_ONLY_INPUTS = {("Resize", 1), ("Resize", 2)}


def float32_only_inputs(graph: onnx.GraphProto) -> set[str]:
    """Tensor names read by a float32-only operator input."""
    return {node.input[i] for node in graph.node for op, i in _FLOAT32_ONLY_INPUTS
            if node.op_type == op and len(node.input) > i and node.input[i]}


FP16_MIN_NORMAL = float(np.finfo(np.float16).tiny)  # 6.1e-05: below it FP16 loses precision, then turns to 0


def check_scales(graph: onnx.GraphProto) -> None:
    """Refuse Q/DQ scales that FP16 cannot hold as normal numbers: a subnormal scale loses its precision and a
    zero one makes QuantizeLinear divide by zero."""
    from utils.onnx_utils import constant_values
    values = constant_values(graph)
    low = []
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and node.input[1] in values:
            scale = np.asarray(values[node.input[1]], dtype=np.float64)
            if (scale < FP16_MIN_NORMAL).any():
                low.append((float(scale.min()), node.name or node.output[0]))
    if low:
        smallest, name = min(low)
        raise ValueError(f"{len(low)} Q/DQ node(s) have scales below FP16's smallest normal number "
                         f"{FP16_MIN_NORMAL:.3g} (smallest {smallest:.3g}, at {name}): in an FP16 graph they would "
                         "turn subnormal or zero. Export with --dtype fp32 (TensorRT 10 weakly typed build), or check "
                         "that quantizer's calibration (a range under 0.008)")


def _fp16_tensor(t: TensorProto) -> TensorProto:
    arr = numpy_helper.to_array(t)
    if np.isfinite(arr).all() and np.abs(arr).max(initial=0) > 65504:
        raise ValueError(f"{t.name}: values beyond the FP16 range (max |x| {np.abs(arr).max():.3g})")
    return numpy_helper.from_array(arr.astype(np.float16), t.name)


def to_fp16(model: onnx.ModelProto, io_dtype: str = "fp32") -> onnx.ModelProto:
    """A copy of a float32 (Q/DQ) graph whose floating-point compute is FP16."""
    if io_dtype not in ("fp32", "fp16"):
        raise ValueError(f"--io-dtype must be fp32 or fp16, got {io_dtype!r}")
    if any(o.domain in ("", "ai.onnx") and o.version < FP16_OPSET for o in model.opset_import):
        raise ValueError(f"FP16 Q/DQ scales need opset >= {FP16_OPSET}: export the graph at that opset")
    check_scales(model.graph)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    keep = float32_only_inputs(graph)
    for i, t in enumerate(graph.initializer):
        if t.data_type == TensorProto.FLOAT and t.name not in keep:
            graph.initializer[i].CopyFrom(_fp16_tensor(t))
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] not in keep:
            for attr in node.attribute:
                if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                    attr.t.CopyFrom(_fp16_tensor(attr.t))
        elif node.op_type == "ConstantOfShape":
            for attr in node.attribute:
                if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                    attr.t.CopyFrom(_fp16_tensor(attr.t))
        elif node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to" and attr.i == TensorProto.FLOAT and node.output[0] not in keep:
                    attr.i = TensorProto.FLOAT16
    del graph.value_info[:]  # re-inferred below, from the new types
    _retype_io(graph, io_dtype)
    inferred = shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    onnx.checker.check_model(inferred)
    return inferred


def _retype_io(graph: onnx.GraphProto, io_dtype: str) -> None:
    """FP16 I/O, or FP32 I/O with a Cast right after each input and right before each output."""
    float_inputs = [v for v in graph.input if v.type.tensor_type.elem_type == TensorProto.FLOAT]
    float_outputs = [v for v in graph.output if v.type.tensor_type.elem_type == TensorProto.FLOAT]
    if io_dtype == "fp16":
        for v in float_inputs + float_outputs:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
        return
    casts = []
    for v in float_inputs:
        inner = f"{v.name}_fp16"
        for node in graph.node:
            node.input[:] = [inner if i == v.name else i for i in node.input]
        casts.append(helper.make_node("Cast", [v.name], [inner], to=TensorProto.FLOAT16, name=f"{v.name}_to_fp16"))
    for v in float_outputs:
        inner = f"{v.name}_fp16"
        for node in graph.node:
            node.output[:] = [inner if o == v.name else o for o in node.output]
            node.input[:] = [inner if i == v.name else i for i in node.input]
        casts.append(helper.make_node("Cast", [inner], [v.name], to=TensorProto.FLOAT, name=f"{v.name}_to_fp32"))
    nodes = casts[:len(float_inputs)] + list(graph.node) + casts[len(float_inputs):]
    del graph.node[:]
    graph.node.extend(nodes)


def float_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every typed tensor (inputs, outputs, initializers, inferred intermediates). Strict, except
    that TensorRT plugins (EfficientNMS_TRT), which ONNX cannot infer, are passed over."""
    plugins = any(n.op_type.endswith("_TRT") for n in model.graph.node)
    inferred = shape_inference.infer_shapes(model, check_type=True, strict_mode=not plugins, data_prop=True)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.output) + list(g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def fp32_compute_nodes(model: onnx.ModelProto) -> list[dict]:
    """Nodes that compute in float32: a float32 output, other than the FP32 I/O casts, shape-only values and the
    post-processing that end-to-end graphs append after the network ("nms/..." nodes, FP32 by design)."""
    from utils.onnx_nms import PREFIX as NMS_PREFIX
    types = float_types(model)
    out = []
    for node in model.graph.node:
        if node.op_type in ("Cast", "Constant", "Shape") and node.name.endswith(("_to_fp32", "_to_fp16")):
            continue
        if node.name.startswith(NMS_PREFIX):
            continue
        f32 = [o for o in node.output if types.get(o) == TensorProto.FLOAT]
        if f32 and node.op_type not in ("Constant", "Shape"):
            out.append({"node": node.name or node.output[0], "op": node.op_type, "outputs": f32})
    return out
