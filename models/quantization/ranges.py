"""Activation ranges chosen per quantizer by what they do to the detector's outputs (`--calib-method
per-quantizer`; not one of `auto`'s candidates: models/quantization/calibration.py says why).

The other calibration methods give every activation quantizer a range by one rule (max, mse, entropy, a
percentile), each judged on the histogram of its own input. Here each quantizer takes whichever of those ranges
does least harm to what the model outputs, measured as QAT's distillation loss against the float model
(models/core/losses.py: class scores, and box distributions where the float model sees objects) on a few calibration
images. Quantizers are visited in the order the forward first calls them, the earlier ones at their chosen ranges,
the later ones off (float), the weights INT8, and each candidate range is tried by running the network from the
first layer that reads the quantizer (the earlier layers' outputs are kept). A quantizer shared by several modules
(TensorRT's scale-sharing groups are one object, models/quantization/rules.py) is chosen once.

The error at the reading conv's own output is no guide: on trained gelan-s (helmet, select split) ranges chosen
by it scored below every single method (the clipping that lowers a conv's mean squared error drops the rare large
activations the detections rest on). The cost is about one pass through the rest of the network per quantizer and
candidate on the search images: seconds on a GPU, minutes for a small model on a CPU.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn as nn
from tqdm import tqdm

from models.core.layer_outputs import LayerOutputs
from models.core.losses import head_distillation
from models.quantization.backends import Quantizer

SEARCH_IMAGES = 16  # the first calibration images: the error is compared on these


def owners(model: nn.Module, quantizers: Sequence[Quantizer]) -> list[list[nn.Module]]:
    """For each quantizer, the modules holding it as a direct child (the modules that read its INT8 tensor)."""
    index = {id(q): k for k, q in enumerate(quantizers)}
    found: list[dict[int, nn.Module]] = [{} for _ in quantizers]
    for m in model.modules():
        for child in m._modules.values():
            if child is not None and id(child) in index:
                found[index[id(child)]][id(m)] = m
    return [list(d.values()) for d in found]


@contextlib.contextmanager
def _hooks(handles: list) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def call_order(model: nn.Module, quantizers: Sequence[Quantizer], images: torch.Tensor) -> list[int]:
    """The quantizers' indices in the order the forward first calls them (quantizers never called come last)."""
    index = {id(q): k for k, q in enumerate(quantizers)}
    order: dict[int, None] = {}
    handles = [q.register_forward_pre_hook(lambda mod, _: order.setdefault(index[id(mod)], None)) for q in quantizers]
    with _hooks(handles), torch.no_grad():
        model(images)
    return list(order) + [k for k in range(len(quantizers)) if k not in order]


@contextlib.contextmanager
def _all_off(quantizers: Sequence[Quantizer]) -> Iterator[None]:
    was = [q._disabled for q in quantizers]
    for q in quantizers:
        q.disable()
    try:
        yield
    finally:
        for q, off in zip(quantizers, was):
            if not off:
                q.enable()


@contextlib.contextmanager
def _weights_quantized_once(model: nn.Module) -> Iterator[None]:
    """The weights held at their INT8 values and their quantizers off, for the search's many passes: each pass then
    skips the weights' fake quantization, which costs as much as the convolutions on a few small images, and
    computes the same values (quantizing a weight once gives what quantizing it at every pass gives)."""
    held = [(m, m.weight.data) for m in model.modules()
            if isinstance(getattr(m, "_weight_quantizer", None), Quantizer) and not m._weight_quantizer._disabled]
    with torch.no_grad():
        for m, weight in held:
            m.weight.data = m._weight_quantizer(weight)
            m._weight_quantizer.disable()
    try:
        yield
    finally:
        for m, weight in held:
            m.weight.data = weight
            m._weight_quantizer.enable()


def search(model: nn.Module, quantizers: Sequence[Quantizer], candidates: dict[str, list[torch.Tensor]],
           images: torch.Tensor) -> tuple[list[torch.Tensor], list[str], list[int]]:
    """Each activation quantizer's range, one of `candidates` ({method: one amax per quantizer}, in the order ties
    go to), chosen as the module docstring says. Returns the ranges, the method chosen for each quantizer and the
    order they were chosen in (the forward's). The quantizers are left on, at the chosen ranges; every other
    quantizer (the weights') as it was.

    Only the layers from the first one reading a quantizer on depend on its range: the earlier layers' outputs
    are kept, so a candidate costs the rest of the network, not a whole forward pass."""
    device = images.device
    readers = owners(model, quantizers)
    weights = [m for m in model.modules() if isinstance(m, Quantizer) and m.axis is not None and not m._disabled]
    was_training = model.training
    model.eval()
    methods = list(candidates)
    chosen: list[str] = [methods[0]] * len(quantizers)
    order: list[int] = []
    layers = LayerOutputs(model, images)
    try:
        head = model.model[-1]
        nc, reg_max = int(head.nc), int(getattr(head, "reg_max", 16))
        with torch.no_grad():
            order = call_order(model, quantizers, images)
            with _all_off([*quantizers, *weights]):
                reference = model(images)
            for q in quantizers:
                q.disable()
            with _weights_quantized_once(model):
                valid = 0  # the layers whose kept outputs hold for the ranges chosen so far
                # minutes on a CPU: a pass through the rest of the network per quantizer and candidate
                for k in tqdm(order, desc="per-quantizer ranges", unit="quantizer"):
                    q = quantizers[k]
                    first = layers.first_layer(readers[k])
                    layers.run(valid, first)
                    q.enable()
                    errors: dict[float, float] = {}  # by amax: methods that give one range are measured once
                    for method in methods:
                        amax = candidates[method][k].reshape(())
                        if float(amax) not in errors:
                            q.set_amax(amax.to(device))
                            errors[float(amax)] = float(head_distillation(layers.run(first), reference, nc, reg_max)[0])
                    # the least error; a tie goes to the earlier method
                    chosen[k] = min(methods, key=lambda m: (errors[float(candidates[m][k])], methods.index(m)))
                    q.set_amax(candidates[chosen[k]][k].reshape(()).to(device))
                    valid = first
    finally:
        for q in quantizers:
            q.enable()
        model.train(was_training)
    return [candidates[m][k] for k, m in enumerate(chosen)], chosen, order

