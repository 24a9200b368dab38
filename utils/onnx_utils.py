"""ONNX export of YOLO models and the Q/DQ graph analysis shared by the scale-sharing rules and the lint."""
from __future__ import annotations

import contextlib
import io
import warnings
from collections import defaultdict
from pathlib import Path
from typing import BinaryIO, Hashable, Iterator

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import numpy_helper

# Ops that move or select int8 values without changing them: TensorRT runs them on the INT8 tensor
# as is, so every quantizer reading their inputs or outputs must use one scale.
DATA_MOVEMENT_OPS = {"Concat", "MaxPool", "Resize", "Split", "Slice", "Identity", "Reshape", "Flatten",
                     "Transpose", "Squeeze", "Unsqueeze", "Upsample"}


@contextlib.contextmanager
def detect_export_mode(model: nn.Module) -> Iterator[None]:
    """Put YOLO detection heads in export mode (return decoded predictions only), restoring after. The anchor
    grid is built once per input shape (not `dynamic`): exports only make the batch dynamic, and a grid built
    while tracing would become shape arithmetic in the graph (ONNX Range has no FP16)."""
    heads = [m for m in model.modules() if hasattr(m, "export") and hasattr(m, "stride") and hasattr(m, "nc")]
    saved = [(m, m.export, getattr(m, "dynamic", False)) for m in heads]
    try:
        for m in heads:
            m.export, m.dynamic = True, False
        yield
    finally:
        for m, export, dyn in saved:
            m.export, m.dynamic = export, dyn


def export_onnx(model: nn.Module, im: torch.Tensor, f: str | Path | BinaryIO, *, opset: int = 17,
                dynamic: bool = False, output_names: tuple[str, ...] = ("output0",)) -> None:
    """TorchScript-based export (pytorch-quantization's fake-quant ops map to QuantizeLinear/DequantizeLinear).
    `dynamic` makes the batch axis dynamic; height and width stay those of `im`."""
    dynamic_axes = None
    if dynamic:
        dynamic_axes = {"images": {0: "batch"}, **{n: {0: "batch"} for n in output_names}}
    with detect_export_mode(model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape-dependent Python in upstream heads
        model(im)  # builds the anchor grid for this shape, so the trace holds it as a constant
        torch.onnx.export(model, im, f, opset_version=opset, input_names=["images"],
                          output_names=list(output_names), dynamic_axes=dynamic_axes,
                          do_constant_folding=True, dynamo=False)
    _tidy_exported(f)


def _tidy_exported(f: str | Path | BinaryIO) -> None:
    """The exported file without the two things Model Optimizer's INT8 symbolic adds to what torch's own
    fake-quant symbolic writes (rewritten only if it has any): casts of a QuantizeLinear's input to float where the
    tracer lost its type (after a Slice, an Add; a float already in an FP32 trace), and a Q/DQ pair per call with its
    own constants where torch's gives one per tensor and scale (its common-subexpression pass merges them). Both
    would stand between a tensor and its Q/DQ pair, which TensorRT's fusions and the scale-sharing analysis read."""
    proto = onnx.load_from_string(f.getvalue()) if isinstance(f, io.BytesIO) else onnx.load(str(f))
    if not drop_identity_casts(proto) + merge_duplicate_qdq(proto):
        return
    if isinstance(f, io.BytesIO):
        f.seek(0)
        f.truncate()
        f.write(proto.SerializeToString())
    else:
        onnx.save(proto, str(f))


def drop_identity_casts(proto: onnx.ModelProto) -> int:
    """Removes, in place, every Cast whose input already has the target type (types from ONNX shape inference);
    returns how many."""
    graph = proto.graph
    casts = [n for n in graph.node if n.op_type == "Cast"]
    if not casts:
        return 0
    inferred = onnx.shape_inference.infer_shapes(proto).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.value_info, *inferred.input, *inferred.output)}
    types.update({t.name: t.data_type for t in graph.initializer})
    outputs = {o.name for o in graph.output}
    dropped = 0
    for node in casts:
        to = next(a.i for a in node.attribute if a.name == "to")
        if types.get(node.input[0]) != to or node.output[0] in outputs:
            continue
        for consumer in graph.node:
            consumer.input[:] = [node.input[0] if i == node.output[0] else i for i in consumer.input]
        graph.node.remove(node)
        dropped += 1
    return dropped


def model_to_onnx(model: nn.Module, imgsz: int = 64, opset: int = 17) -> onnx.ModelProto:
    """In-memory export (no files): the graph TensorRT would see."""
    device = next(model.parameters()).device
    buf = io.BytesIO()
    export_onnx(model, torch.zeros(1, 3, imgsz, imgsz, device=device), buf, opset=opset)
    return onnx.load_from_string(buf.getvalue())


def merge_duplicate_qdq(proto: onnx.ModelProto) -> int:
    """Merges, in place, QuantizeLinear nodes that read the same tensor with the same scale, zero point and axis
    (each with its DequantizeLinear consumers) into the first; drops the constants nothing reads any more. Returns
    how many QuantizeLinear nodes went."""
    graph = proto.graph
    consts = constant_values(graph)

    def params(node: onnx.NodeProto) -> tuple:
        axis = next((a.i for a in node.attribute if a.name == "axis"), None)
        return (*(consts[i].tobytes() if i in consts else i for i in node.input[1:]), axis)

    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for i in node.input:
            consumers[i].append(node)
    outputs = {o.name for o in graph.output}
    first: dict[tuple, onnx.NodeProto] = {}
    renamed: dict[str, str] = {}
    removed: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "QuantizeLinear":
            continue
        kept = first.setdefault((node.input[0], params(node)), node)
        if kept is node:
            continue
        kept_dq = {params(d): d for d in consumers[kept.output[0]] if d.op_type == "DequantizeLinear"}
        dqs = consumers[node.output[0]]
        if not all(d.op_type == "DequantizeLinear" and params(d) in kept_dq and d.output[0] not in outputs
                   for d in dqs):
            continue
        renamed.update({d.output[0]: kept_dq[params(d)].output[0] for d in dqs})
        removed += [node, *dqs]
    for node in removed:
        graph.node.remove(node)
    for node in graph.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
    read = {i for node in graph.node for i in node.input}
    for node in [n for n in graph.node if n.op_type == "Constant" and n.output[0] not in read | outputs]:
        graph.node.remove(node)
    return sum(n.op_type == "QuantizeLinear" for n in removed)


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node outputs by tensor name."""
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


class UnionFind:
    def __init__(self):
        self.parent: dict[Hashable, Hashable] = {}

    def find(self, x: Hashable) -> Hashable:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: Hashable, b: Hashable) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output}


def int8_tensor_classes(graph: onnx.GraphProto, share_add_inputs: bool = True) -> UnionFind:
    """Group tensors that TensorRT must hold as one INT8 tensor with one scale.

    Tensors joined: the input and output of Q and DQ (the same values), of data-movement ops (Concat,
    MaxPool, Resize, Split, ...), and with `share_add_inputs` the two dequantized inputs of an Add.
    """
    uf = UnionFind()
    consts = constant_values(graph)
    prod = producers(graph)
    for node in graph.node:
        data_inputs = [i for i in node.input if i and i not in consts]
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or node.op_type in DATA_MOVEMENT_OPS:
            joined = data_inputs if node.op_type == "Concat" else data_inputs[:1]
            for t in joined:
                for out in node.output:
                    uf.union(t, out)
        elif node.op_type == "Add" and share_add_inputs and len(data_inputs) == 2:
            if all(prod.get(i) is not None and prod[i].op_type == "DequantizeLinear" for i in data_inputs):
                uf.union(*data_inputs)
    return uf


def activation_quantize_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """QuantizeLinear nodes on activations (not on weight initializers)."""
    consts = constant_values(graph)
    prod = producers(graph)

    def is_weight(name: str) -> bool:
        while name not in consts:
            node = prod.get(name)
            if node is None or node.op_type not in ("Identity", "Cast"):
                return False
            name = node.input[0]
        return True

    return [n for n in graph.node if n.op_type == "QuantizeLinear" and not is_weight(n.input[0])]


def scale_of(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(consts[node.input[1]], dtype=np.float32)


def quantized_classes(graph: onnx.GraphProto, share_add_inputs: bool = True) -> dict[str, list[onnx.NodeProto]]:
    """Activation QuantizeLinear nodes grouped by the INT8 tensor class they write."""
    uf = int8_tensor_classes(graph, share_add_inputs)
    groups: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in activation_quantize_nodes(graph):
        groups[uf.find(node.input[0])].append(node)
    return dict(groups)


def unshared_joins(graph, share_add_inputs: bool = True) -> list[dict]:
    """INT8 tensor classes whose quantizers carry more than one scale (each costs TensorRT a reformat)."""
    consts = constant_values(graph)
    problems = []
    for nodes in quantized_classes(graph, share_add_inputs).values():
        scales = sorted({float(scale_of(n, consts).reshape(-1)[0]) for n in nodes})
        if len(scales) > 1 and not np.allclose(scales, scales[0], rtol=1e-6, atol=0):
            problems.append({"quantize_nodes": [n.name for n in nodes], "scales": scales})
    return problems
