"""One batch's forward kept layer by layer, so that a forward with a change inside top-level layer k reruns
layers k.. only. The per-quantizer range search (models/quantization/ranges.py: a pass per quantizer and candidate
range) and mixed precision's ranking (models/mixed_precision.py: a pass per INT8 tensor class) run this way.

The rule: `run(start)` computes on the kept outputs of the layers before `start`; they are valid while nothing
those layers compute with (weights, quantizers, their ranges or on/off state) has changed since the pass that kept
them. The caller changes only what layer `start` or a later one uses, or reruns from an earlier layer. A pass with
`keep=False` leaves the kept outputs as they were (a change tried and undone); otherwise its outputs replace those
of its layers. The outputs live in the object, which lives for one search or ranking.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn


class LayerOutputs:
    """`images` through a YOLO model's layers (`model.model`, each reading the previous output or the ones its
    `f` names) as upstream's forward runs them, in the model's current mode."""

    def __init__(self, model: nn.Module, images: torch.Tensor):
        self.layers, self.images = list(model.model), images
        self.outputs: list = []
        self.layer_of: dict[int, int] = {}  # a module (a shared quantizer: in several layers) -> the first layer
        for i, layer in enumerate(self.layers):
            for m in layer.modules():
                self.layer_of.setdefault(id(m), i)

    def first_layer(self, modules: Iterable[nn.Module]) -> int:
        """The first layer that holds any of `modules` (the number of layers if none does)."""
        return min((self.layer_of[id(m)] for m in modules if id(m) in self.layer_of), default=len(self.layers))

    def run(self, start: int = 0, stop: int | None = None, keep: bool = True):
        """Layers [start, stop) on the kept outputs before `start`; the last output (the model's, run to the end)."""
        if start > len(self.outputs):
            raise RuntimeError(f"no kept outputs up to layer {start}: run from layer {len(self.outputs)} first")
        outputs = self.outputs[:start]
        with torch.no_grad():
            for i in range(start, len(self.layers) if stop is None else stop):
                outputs.append(self.layers[i](self._input(i, outputs)))
        if keep:
            self.outputs = outputs
        return outputs[-1] if outputs else None

    def _input(self, i: int, outputs: list):
        f = self.layers[i].f
        previous = outputs[i - 1] if i else self.images
        if isinstance(f, int):
            return previous if f == -1 else outputs[f]
        return [previous if j == -1 else outputs[j] for j in f]
