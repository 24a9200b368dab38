"""pytorch-quantization 2.1.3 (the default backend): its TensorQuantizer, QuantConv2d and QuantMaxPool2d, with two
speed/correctness changes kept in `Int8Quantizer`:
- fake quantization runs through PyTorch's native fused kernels (models/quantization/fake_quant.py) with scales
  computed once per epoch or evaluation (models/quantization/held_state.py: no host sync and one to three kernels
  per quantizer and step; FP16 activations stay FP16);
- activation statistics go to `models.quantization.calibration.HistogramCollector` (fast, CPU and GPU, independent
  of batching).
Its fake-quant op exports as QuantizeLinear/DequantizeLinear with int8 zero points (torch.onnx's own symbolics).
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn

with warnings.catch_warnings():  # its tensor_quant.py decorates with torch.jit.script, which recent PyTorch
    warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", FutureWarning)  # deprecates: not ours
    from pytorch_quantization import nn as quant_nn
    from pytorch_quantization.nn.modules.tensor_quantizer import TensorQuantizer
    from pytorch_quantization.tensor_quant import QuantDescriptor

from models.quantization.backends import Backend, Quantizer, convert_instance
from models.quantization.calibration import HistogramCollector
from models.quantization.fake_quant import fake_quant, fake_quant_learnable


class Int8Quantizer(Quantizer, TensorQuantizer):
    """TensorQuantizer with native fake-quant kernels and device-safe checkpoint loading."""

    backend_name = "pytorch-quantization"
    holds_scales = True

    def __init__(self, quant_desc: QuantDescriptor):
        super().__init__(quant_desc)
        if quant_desc.axis is None:  # activations: one collector serves every method
            self._calibrator = HistogramCollector(self._num_bits, self._unsigned)

    def holdable(self) -> bool:
        return getattr(self, "_amax", None) is not None and not self._amax.requires_grad and self._scale_amax is None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        # Inside a held block, straight to the held scales: TensorQuantizer.forward's switches and _quant_forward's
        # range checks are Python that torch.compile traces for each of a model's ~250 quantizers (about 0.5 s of
        # the 11 s gelan-c's forward takes to trace on a CPU); nothing they check can hold here.
        held = self._held
        if held is not None and self._if_quant and not (self._disabled or self._if_calib or self._if_clip):
            return held.fake_quant(inputs)
        return super().forward(inputs)

    def _quant_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        amax = getattr(self, "_amax", None)
        if amax is None or self._scale_amax is not None:  # dynamic range: recomputed every call
            return fake_quant(inputs, self._get_amax(inputs), self._num_bits)
        if self._learned_amax() is not None:
            return fake_quant_learnable(inputs, amax, self._num_bits)
        if self._held is not None:  # inside a held_state.held block: the scale computed at its start
            return self._held.fake_quant(inputs)
        if torch.compiler.is_compiling():  # a trace cannot read amax back to the host
            raise RuntimeError("a compiled forward reached a quantizer outside a "
                               "models.quantization.held_state.held block")
        return fake_quant(inputs, amax, self._num_bits)


# Conv and MaxPool are re-classed, not constructed: pytorch-quantization's constructors check their caller with
# inspect.stack(), about 30 ms a layer (5.5 s of gelan-t's 9 s insertion on a CPU).
def _quantized_conv(conv: nn.Conv2d) -> quant_nn.QuantConv2d:
    q = convert_instance(conv, quant_nn.QuantConv2d)
    q._fake_quant = True
    return q


def _quantized_maxpool(pool: nn.MaxPool2d) -> quant_nn.QuantMaxPool2d:
    q = convert_instance(pool, quant_nn.QuantMaxPool2d)
    q._fake_quant = True
    return q


@contextlib.contextmanager
def _quiet():
    """pytorch-quantization logs every quantizer's state change through absl (hundreds of lines per calibration
    of a large model): kept to errors while the quantizers are switched, the caller prints one summary instead."""
    from absl import logging as absl_logging
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)


BACKEND = Backend(
    name="pytorch-quantization",
    activation_quantizer=lambda num_bits: Int8Quantizer(QuantDescriptor(num_bits=num_bits, calib_method="histogram")),
    weight_quantizer=lambda num_bits: Int8Quantizer(QuantDescriptor(num_bits=num_bits, axis=(0,), calib_method="max")),
    quantized_conv=_quantized_conv,
    quantized_maxpool=_quantized_maxpool,
    checkpoint_modules=(__name__, "pytorch_quantization.nn", "pytorch_quantization.nn.modules.quant_conv",
                        "pytorch_quantization.nn.modules.quant_pooling",
                        "pytorch_quantization.nn.modules.tensor_quantizer"),
    calibrator_modules=("pytorch_quantization.calib",),
    quiet=_quiet,
)
