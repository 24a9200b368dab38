"""TensorRT scale-sharing rules, derived from the model itself.

TensorRT fuses an explicitly quantized graph without reformat layers only where every quantizer that
reads one INT8 tensor uses one scale. Such tensors are joined by data-movement ops (Concat inputs and
output, MaxPool and Upsample input/output, the two halves of ADown's chunk) and, by choice, by the
residual Add of RepNBottleneck.

Rather than a hand-written table per block, the rules are read off the graph the model actually
exports: every per-tensor quantizer gets a distinct marker amax, the model is exported to ONNX in
memory, each QuantizeLinear is traced back to its quantizer through its scale, and quantizers whose
inputs fall in one INT8 tensor class (`utils.onnx_utils.int8_tensor_classes`) become one shared
object. New blocks are covered without new rules, and the lint checks the very same property.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from models.quantization.backends import Quantizer
from models.quantization.held_state import held
from utils.onnx_utils import constant_values, model_to_onnx, quantized_classes, scale_of

_MARKER_STEP = 1.0 / 1024  # distinct markers survive float32 scale = amax / 127 exactly enough


def _marker(k: int) -> float:
    return 1.0 + k * _MARKER_STEP


def _marker_index(scale: float, bound: int) -> int:
    return int(round((scale * bound - 1.0) / _MARKER_STEP))


def derive_shared_groups(model: nn.Module, imgsz: int = 64,
                         share_add_inputs: bool = True) -> list[list[Quantizer]]:
    """Groups (size >= 2) of distinct per-tensor quantizers that must share one amax."""
    quantizers: list[Quantizer] = []
    for m in model.modules():  # distinct objects, in module order
        if isinstance(m, Quantizer) and m.axis is None and not m._disabled:
            quantizers.append(m)
    # weights are quantized per channel and never join: without their Q/DQ pairs the trace is half the work
    weights = [m for m in model.modules() if isinstance(m, Quantizer) and m.axis is not None and not m._disabled]
    device = next(model.parameters()).device
    saved = [None if q.amax is None else q.amax.clone() for q in quantizers]
    try:
        for q in weights:
            q.disable()
        for k, q in enumerate(quantizers):
            q.set_amax(torch.tensor(_marker(k), device=device))
        with held(model):  # the markers traced as constants (models/quantization/held_state.py)
            graph = model_to_onnx(model, imgsz).graph
    finally:
        for q in weights:
            q.enable()
        for q, amax in zip(quantizers, saved):
            if amax is None:
                q.clear_amax()
            else:
                q.set_amax(amax)

    consts = constant_values(graph)
    groups = []
    for nodes in quantized_classes(graph, share_add_inputs).values():
        members = {}
        for node in nodes:
            k = _marker_index(float(scale_of(node, consts).reshape(-1)[0]), 2 ** (quantizers[0].num_bits - 1) - 1)
            if not 0 <= k < len(quantizers):
                raise RuntimeError(f"cannot map QuantizeLinear {node.name} back to a quantizer")
            members[k] = quantizers[k]
        if len(members) > 1:
            groups.append([members[k] for k in sorted(members)])
    return groups


def share_quantizers(model: nn.Module, imgsz: int = 64, share_add_inputs: bool = True) -> int:
    """Make each group's quantizers one object (the first of the group). Returns the number of groups."""
    groups = derive_shared_groups(model, imgsz, share_add_inputs)
    replacement = {id(q): group[0] for group in groups for q in group[1:]}
    for parent in model.modules():
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in replacement:
                parent._modules[name] = replacement[id(child)]
    return len(groups)
