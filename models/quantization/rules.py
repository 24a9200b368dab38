"""TensorRT scale-sharing rules, derived from the model itself.

TensorRT fuses an explicitly quantized graph without reformat layers only where every quantizer that
reads one INT8 tensor uses one scale. Such tensors are joined by data-movement ops (Concat inputs and
output, MaxPool and Upsample input/output, the two halves of ADown's chunk) and, by choice, by the
residual Add of RepNBottleneck.

Rather than a hand-written table per block, the rules are read off the model as it runs: one forward of
a blank image, in export mode, records which tensors each data-movement op joins (`_Joins`: the ops and
joins of `utils.onnx_utils.int8_tensor_classes` on the exported ONNX graph, as the torch calls that export
to them) and which tensor each quantizer reads; quantizers reading one class of joined tensors become one
shared object. New blocks are covered without new rules, and the lint checks the very same property on
every exported graph (tests/test_quantize.py: both derivations give the same groups). Recorded eagerly, not
by an export: an in-memory ONNX export cost ~0.7 s of every gelan-t quantization, the forward ~0.05 s.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from models.quantization.backends import Quantizer
from models.quantization.held_state import held
from utils.onnx_utils import UnionFind, detect_export_mode

# torch calls whose export is a data-movement op of utils.onnx_utils.DATA_MOVEMENT_OPS: their tensor inputs (all of
# them for a concatenation, else the first) and outputs are one INT8 tensor
_CONCATENATIONS = {"cat", "concat", "concatenate", "stack"}
_MOVES = _CONCATENATIONS | {
    "max_pool2d", "_max_pool2d", "max_pool2d_with_indices", "interpolate", "upsample", "chunk", "split",
    "split_with_sizes", "tensor_split", "unbind", "view", "view_as", "reshape", "reshape_as", "flatten", "transpose",
    "permute", "squeeze", "unsqueeze", "__getitem__"}
_ADDS = {"add", "__add__", "__radd__"}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _slices_only(index) -> bool:
    """Whether a tensor index exports as Slice/Unsqueeze (data movement) rather than Gather."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, slice) for p in parts)


class _Joins(TorchFunctionMode):
    """The INT8 tensor classes of one forward: tensors joined by data movement, a quantizer's input with its output,
    and (`share_add_inputs`) the two inputs of an Add that are both quantizers' outputs. Tensors are told apart by
    identity; every tensor seen is kept alive for the forward, so no identity is reused."""

    def __init__(self, share_add_inputs: bool):
        super().__init__()
        self.share_add_inputs = share_add_inputs
        self.classes = UnionFind()
        self.reads: list[tuple[Quantizer, int]] = []  # (quantizer, id of the tensor it read), in call order
        self._quantized: set[int] = set()
        self._alive: list[torch.Tensor] = []

    def _join(self, tensors: list[torch.Tensor]) -> None:
        self._alive += tensors
        for t in tensors[1:]:
            self.classes.union(id(tensors[0]), id(t))

    def quantizer_called(self, quantizer: Quantizer, inputs: tuple, output: torch.Tensor) -> None:
        self._join([inputs[0], output])
        self.reads.append((quantizer, id(inputs[0])))
        self._quantized.add(id(output))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        source = args[0] if args else kwargs.get("input", kwargs.get("tensors"))  # a call may name its input
        if name in _MOVES and (name != "__getitem__" or _slices_only(args[1])):
            inputs = _tensors(source) if name in _CONCATENATIONS else _tensors(source)[:1]
            self._join(inputs + _tensors(out))
        elif name in _ADDS and self.share_add_inputs:
            operands = _tensors(args[:2])
            if len(operands) == 2 and all(id(t) in self._quantized for t in operands):
                self._join(operands)
        return out


def derive_shared_groups(model: nn.Module, imgsz: int = 64,
                         share_add_inputs: bool = True) -> list[list[Quantizer]]:
    """Groups (size >= 2) of distinct per-tensor quantizers that must share one amax, in module order."""
    quantizers = [m for m in model.modules() if isinstance(m, Quantizer) and m.axis is None and not m._disabled]
    # weights are quantized per channel and never join: the forward skips their work
    weights = [m for m in model.modules() if isinstance(m, Quantizer) and m.axis is not None and not m._disabled]
    joins = _Joins(share_add_inputs)
    hooks = [q.register_forward_hook(lambda q, inputs, output: joins.quantizer_called(q, inputs, output))
             for q in quantizers]
    saved = [None if q.amax is None else q.amax.clone() for q in quantizers]
    device = next(model.parameters()).device
    try:
        for q in weights:
            q.disable()
        for q in quantizers:  # a range, so that every quantizer quantizes (its value is never read), held: one op
            q.set_amax(torch.tensor(1.0, device=device))
        with held(model), detect_export_mode(model), torch.no_grad(), joins:
            model(torch.zeros(1, 3, imgsz, imgsz, device=device))
    finally:
        for h in hooks:
            h.remove()
        for q in weights:
            q.enable()
        for q, amax in zip(quantizers, saved):
            if amax is None:
                q.clear_amax()
            else:
                q.set_amax(amax)
    members: dict[int, dict[int, Quantizer]] = {}
    for q, read in joins.reads:
        members.setdefault(joins.classes.find(read), {})[id(q)] = q
    order = {id(q): i for i, q in enumerate(quantizers)}
    groups = [sorted(m.values(), key=lambda q: order[id(q)]) for m in members.values() if len(m) > 1]
    return sorted(groups, key=lambda g: order[id(g[0])])


def share_quantizers(model: nn.Module, imgsz: int = 64, share_add_inputs: bool = True) -> int:
    """Make each group's quantizers one object (the first of the group). Returns the number of groups."""
    groups = derive_shared_groups(model, imgsz, share_add_inputs)
    replacement = {id(q): group[0] for group in groups for q in group[1:]}
    for parent in model.modules():
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in replacement:
                parent._modules[name] = replacement[id(child)]
    return len(groups)
