"""NVIDIA Model Optimizer (`nvidia-modelopt`, `--backend modelopt`): its TensorQuantizer, with its own fake-quant
op (`fake_tensor_quant`: scale 127 / amax computed at every call, values clamped to [-128, 127] as the exported
QuantizeLinear does) and its own ONNX symbolic for the Q/DQ pairs.

The quantizers sit in this module's `QuantConv2d` and `QuantMaxPool2d` rather than Model Optimizer's quantized
modules: those are dynamic classes made at run time (`QuantModuleRegistry.convert`), which a YOLO checkpoint, a
pickled model that upstream's val.py and detect.py load, cannot name, and which Model Optimizer itself saves as a
state to restore into a model built again (`mto.save` / `mto.restore`). These two are plain subclasses of the
torch modules, so a checkpoint loads through the same allow-list as the other backend's.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from modelopt.torch.quantization.config import QuantizerAttributeConfig
from modelopt.torch.quantization.nn import TensorQuantizer

from models.quantization.backends import Backend, Quantizer, convert_instance
from models.quantization.calibration import HistogramCollector
from models.quantization.fake_quant import fake_quant_learnable


class ModelOptimizerQuantizer(Quantizer, TensorQuantizer):
    """Model Optimizer's TensorQuantizer; activation statistics go to this project's HistogramCollector (every
    calibration candidate from one pass, combined across ranks), a learned amax to the LSQ op."""

    backend_name = "modelopt"

    def __init__(self, num_bits: int, per_channel: bool):
        # The straight-through gradient zeroed where a value is clipped, as pytorch-quantization's and PyTorch's
        # fake-quant kernels give it. Model Optimizer's default passes it through everywhere: fine-tuning then
        # pushes clipped values on with no effect on the loss, and QAT lost select mAP every epoch (gelan-s helmet-416,
        # H200, 2 seeds: -0.014 and -0.011 after two epochs where pytorch-quantization gained; results/backends/).
        super().__init__(QuantizerAttributeConfig(num_bits=num_bits, axis=(0,) if per_channel else None,
                                                  pass_through_bwd=False))
        if not per_channel:
            self._calibrator = HistogramCollector(num_bits, self._unsigned)

    def _fake_quantize(self, inputs: torch.Tensor) -> torch.Tensor:
        amax = self._learned_amax()  # Model Optimizer's op passes no gradient to amax
        if amax is not None:
            return fake_quant_learnable(inputs, amax, self._num_bits)
        return super()._fake_quantize(inputs)


class QuantConv2d(nn.Conv2d):
    """A conv whose input and weight pass through their quantizers (`_input_quantizer`, `_weight_quantizer`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self._input_quantizer(x), self._weight_quantizer(self.weight), self.bias)


class QuantMaxPool2d(nn.MaxPool2d):
    """A max pool on a quantized input: TensorRT pools INT8 in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self._input_quantizer(x))


BACKEND = Backend(
    name="modelopt",
    activation_quantizer=lambda num_bits: ModelOptimizerQuantizer(num_bits, per_channel=False),
    weight_quantizer=lambda num_bits: ModelOptimizerQuantizer(num_bits, per_channel=True),
    quantized_conv=lambda conv: convert_instance(conv, QuantConv2d),
    quantized_maxpool=lambda pool: convert_instance(pool, QuantMaxPool2d),
    checkpoint_modules=(__name__,),  # a checkpoint names the subclasses above, never Model Optimizer's own modules
    calibrator_modules=("modelopt.torch.quantization.calib",),  # but its quantizers' calibrators
)
