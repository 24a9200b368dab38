"""Values derived from a quantized model's ranges and weights, computed once inside a block that holds them fixed.

The rule: a derived value lives only inside the `with` block that computed it. Whoever opens the block changes
nothing the values were derived from until it ends, and on exit every value is dropped. No value outlives its block
and none is keyed on tensor version counters: fused optimizers (Adam's fused kernel) and compiled or CUDA-graph
code write tensors in place without bumping `_version`, so a version-keyed entry can serve old weights unseen (it
did: every QAT epoch was judged on the weights of the first evaluation).

- `held(*models)`: each calibrated quantizer's fake-quantization parameters (a host float per tensor, or per-channel
  tensors) computed from its amax at entry, where its backend reads them (pytorch-quantization's; Model Optimizer's op
  computes its scale at every call: models/quantization/backends/). A training step reads them instead of reading amax
  back to the host (a GPU sync per quantizer and step), and a compiled forward reads them as constants: it traces
  again when a later block holds other values (its guards compare them). Opened by each fine-tuning epoch
  (models/finetuning/finetune.py), each evaluation, the scale-sharing rules' recorded forward
  (models/quantization/rules.py) and each ONNX export of a quantized model (models/deployment/export.py, mixed
  precision's in-memory traces): the trace then records each scale as a constant instead of the ops that compute it
  from amax at every call, which took half of a gelan-t trace's time (the same graph). A learned amax (a trained
  parameter) is not held: its grad-enabled forward computes its own scale, and no-grad calls outside a block compute
  it from the current value. Changing a held range inside the block (`set_amax`, loading a state dict, calibrating)
  raises instead of going unseen.
- `held(..., weights=True)`: in addition each weight's fake-quantized value, computed at its first use in the block
  and reused for every later batch (on a CPU quantizing a weight costs about as much as its convolution on a small
  batch). For evaluation only (`models/deployment/runners.py` TorchRunner.held): nothing steps an optimizer there. Never used
  while grad is enabled (training needs the rounding in the graph) or in an ONNX export (the weight's Q/DQ must be
  traced).
- `held(..., fusable=True)`: the quantizers compute as elementwise ops that inductor fuses with their neighbours
  (models/quantization/fake_quant.py), for a fine-tuning epoch whose step inductor compiles
  (models/finetuning/fast_step.py StepPlan.fused_quantizers); the same values and gradients as the native kernels.

Outside any block nothing is cached: each call computes the parameters from amax as it is.

One storage outlives its block, never its values: a per-channel quantizer's scale tensors (`Quantizer._held_storage`).
Each block writes its values into the tensors the last block held, where shape, dtype and device still fit, and
nothing reads them outside a block. A compiled step's CUDA graphs read them at their address (torch.compile takes a
tensor reached through a module for a static input, like a weight), and a new address re-records every graph at the
next block's first step: 0.6-1.3 s at the first step of each QAT epoch with inductor on one H200 (gelan-c, gelan-s
at 640 px: results/scaling/h200x2/2026-11-29-b/), where the control had none. A quantizer's copy (pickle, deepcopy)
starts without storage.

Other derived values, and what invalidates them:
- the per-quantizer range search (models/quantization/ranges.py) holds each weight at its INT8 value for the duration of
  one `search` call and restores the float weights at its end; it changes no weight meanwhile;
- the compiled forwards (models/finetuning/fast_step.py) are traced again by torch.compile when a guarded value changes: the
  held scales above (by value), tensor shapes, module attributes;
- upstream's detection head keeps its anchors and strides on the module, recomputed when the input shape changes:
  they depend on nothing else (the compiled teacher runs in training mode, without them, models/finetuning/fast_step.py).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from models.quantization.backends import Quantizer
from models.quantization.fake_quant import QuantParams, fake_quant_with, quant_params


class Held:
    """One quantizer's values inside a block: its parameters, and with `weights` its fake-quantized weight; with
    `fusable` it quantizes with elementwise ops (models/quantization/fake_quant.py)."""

    def __init__(self, params: QuantParams, weights: bool, fusable: bool = False):
        self.params, self.weights, self.fusable = params, weights, fusable
        self._weight: tuple[torch.Tensor, torch.Tensor] | None = None

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.weights and isinstance(x, nn.Parameter) and not torch.is_grad_enabled()
                and not torch.onnx.is_in_onnx_export()):
            return fake_quant_with(x, self.params, self.fusable)
        if self._weight is None or self._weight[0] is not x:
            self._weight = (x, fake_quant_with(x, self.params))
        return self._weight[1]


def _holdable(models: tuple[nn.Module, ...]) -> list[Quantizer]:
    """Each calibrated quantizer once (a shared quantizer is one object) whose backend reads held scales, learned
    ranges excepted."""
    found = {id(m): m for model in models for m in model.modules() if isinstance(m, Quantizer)}
    return [q for q in found.values() if q.holdable()]


def _into_storage(q: Quantizer, params: QuantParams) -> QuantParams:
    """`params` with its per-channel tensors written into the quantizer's storage (module docstring), which they
    become when it has none that fits."""
    if isinstance(params.scale, float):
        return params
    tensors, storage = params[:3], q._held_storage
    if storage is not None and all(s.shape == t.shape and s.dtype == t.dtype and s.device == t.device
                                   for s, t in zip(storage, tensors)):
        for s, t in zip(storage, tensors):
            s.copy_(t)
        return QuantParams(*storage, params.bound)
    q._held_storage = tensors
    return params


@contextlib.contextmanager
def held(*models: nn.Module, weights: bool = False, fusable: bool = False) -> Iterator[None]:
    """The block described in the module docstring. Nested blocks over the same quantizers keep the outer values."""
    opened = [q for q in _holdable(models) if q._held is None]
    for q in opened:
        q._held = Held(_into_storage(q, quant_params(q._amax, q._num_bits)), weights, fusable)
    try:
        yield
    finally:
        for q in opened:
            q._held = None
