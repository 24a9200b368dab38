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


def clamp_scales(graph: onnx.GraphProto) -> dict:
    """Raise Q/DQ scales under FP16's smallest normal number to it, in place (in FP16 they would turn subnormal,
    losing their precision, or zero, and QuantizeLinear would divide by zero). Such a quantizer has a range under
    127 * 6.1e-5 = 0.0078 (a dead channel, a near-silent layer): with the raised scale every value it passes
    still lies inside its range, and a dequantized value moves by at most (old + new scale) / 2 < 6.1e-5, FP16's
    own spacing at 0.06. Refused: a scale that is zero, negative or not finite, which no clamp makes meaningful.
    Returns the count of scale tensors and values raised and the largest change to a dequantized value."""
    scales = {node.input[1] for node in graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear")}
    tensors = [t for t in graph.initializer if t.name in scales]
    tensors += [attr.t for node in graph.node if node.op_type == "Constant" and node.output[0] in scales
                for attr in node.attribute if attr.name == "value"]
    tensors_raised, values_raised, largest_change = 0, 0, 0.0
    for t in tensors:
        scale = numpy_helper.to_array(t)
        bad = ~np.isfinite(scale) | (scale <= 0)
        if bad.any():
            raise ValueError(f"Q/DQ scale {t.name} holds {int(bad.sum())} value(s) that are zero, negative or not "
                             f"finite ({scale[bad].reshape(-1)[0]}): check that quantizer's calibration")
        low = scale < FP16_MIN_NORMAL
        if low.any():
            tensors_raised, values_raised = tensors_raised + 1, values_raised + int(low.sum())
            largest_change = max(largest_change, float((scale[low].max() + FP16_MIN_NORMAL) / 2))
            t.CopyFrom(numpy_helper.from_array(np.where(low, FP16_MIN_NORMAL, scale).astype(scale.dtype), t.name))
    return {"scales": tensors_raised, "values": values_raised, "largest_change": largest_change}


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
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    raised = clamp_scales(graph)
    if raised["scales"]:
        from utils.general import LOGGER
        LOGGER.warning(f"FP16 graph: {raised['scales']} Q/DQ scale tensor(s) ({raised['values']} value(s)) under "
                       f"FP16's smallest normal number {FP16_MIN_NORMAL:.3g} raised to it (ranges under 0.0078); a "
                       f"dequantized value moves by at most {raised['largest_change']:.3g}")
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
