"""ONNX export of YOLO models and the Q/DQ graph analysis shared by the scale-sharing rules and the lint."""
from __future__ import annotations

import contextlib
import io
import warnings
from collections import defaultdict
from pathlib import Path
from typing import BinaryIO, Iterator

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


def model_to_onnx(model: nn.Module, imgsz: int = 64, opset: int = 17) -> onnx.ModelProto:
    """In-memory export (no files): the graph TensorRT would see."""
    device = next(model.parameters()).device
    buf = io.BytesIO()
    export_onnx(model, torch.zeros(1, 3, imgsz, imgsz, device=device), buf, opset=opset)
    return onnx.load_from_string(buf.getvalue())


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
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
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
