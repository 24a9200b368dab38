"""A weight's fake-quantized value computed once per model state in no-grad evaluation.

pytorch-quantization's QuantConv2d fake-quantizes its weight at every forward. In evaluation (select evaluations of
auto's candidates and of every QAT epoch, sensitivity, --max-loss, val) neither the weight nor its range changes
between batches, and on a CPU that rounding costs about as much as the convolution on a small batch. The cached
value is keyed on the weight and the range, each by its storage and its in-place version count: an optimizer step,
load_state_dict, an EMA update, set_amax, `.to()` and `param.data = ...` all change one of them. (A write through
`param.data` in place is not seen, as autograd does not see it; nothing here writes weights that way.)

Never used while grad is enabled (training needs the rounding in the graph; the entry is dropped then, so training
holds no stale copy) nor in ONNX export (the weight's QuantizeLinear/DequantizeLinear must be traced).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn as nn


class _Key(NamedTuple):
    weight: torch.Tensor  # detached aliases: they keep the storages alive, so an address is never reused meanwhile
    weight_version: int
    amax: torch.Tensor
    amax_version: int


def _key(weight: torch.Tensor, amax: torch.Tensor) -> _Key:
    return _Key(weight.detach(), weight._version, amax.detach(), amax._version)


def _same(a: _Key, b: _Key) -> bool:
    return (a.weight.data_ptr() == b.weight.data_ptr() and a.weight_version == b.weight_version
            and a.weight.dtype == b.weight.dtype and a.weight.shape == b.weight.shape
            and a.amax.data_ptr() == b.amax.data_ptr() and a.amax_version == b.amax_version)


def applies(weight: torch.Tensor) -> bool:
    """A module's own weight, in no-grad evaluation outside an ONNX export."""
    return isinstance(weight, nn.Parameter) and not torch.is_grad_enabled() and not torch.onnx.is_in_onnx_export()


class WeightCache:
    """One quantizer's entry: the fake-quantized weight and what it was computed from."""

    def __init__(self):
        self._entry: tuple[_Key, torch.Tensor] | None = None

    def get(self, weight: torch.Tensor, amax: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """compute() where the cache does not apply or its entry is stale, else the value it returned last."""
        if not applies(weight):
            self._entry = None
            return compute()
        key = _key(weight, amax)
        if self._entry is None or not _same(self._entry[0], key):
            self._entry = (key, compute())
        return self._entry[1]
