"""The quantization libraries a model can be quantized with, and what differs between them, behind one interface.

A backend provides the quantizer type (a library's TensorQuantizer with `Quantizer`'s methods), the quantized
conv and max pool it is inserted with, its fake-quant op (the quantizer's forward) and its Q/DQ export (the
op's ONNX symbolic), and the modules its checkpoints pickle. Everything this project adds on top is written once
against `Quantizer` and used by both: the recipe and the layers kept in float (quantize.py), scale sharing at
joins (rules.py), calibration statistics and auto's choice (calibration.py, models/core/selection.py), QAT,
mixed precision, export, lint and the ONNX Runtime checks.

- `pytorch-quantization` (default): pytorch-quantization 2.1.3's TensorQuantizer running this project's native
  fake-quant kernels (models/quantization/fake_quant.py) with scales held per epoch (held_state.py), which the
  compiled fine-tuning step needs.
- `modelopt`: NVIDIA Model Optimizer's TensorQuantizer with its own fake-quant op and export, the maintained
  successor of pytorch-quantization. Its scale is computed from amax inside every forward, so it is not held and
  the fine-tuning step is eager.

Only this package imports a quantization library (tests/test_layout.py).
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch.nn as nn

# --backend value: (the module defining it, the package users install, the library's import name)
BACKENDS = {"pytorch-quantization": ("models.quantization.backends.pytorch_quantization", "pytorch-quantization",
                                     "pytorch_quantization"),
            "modelopt": ("models.quantization.backends.model_optimizer", "nvidia-modelopt", "modelopt")}
DEFAULT_BACKEND = "pytorch-quantization"


class Quantizer:
    """What this project asks of a quantizer, on top of a library's TensorQuantizer (mixed in first): ranges set,
    cleared, learned and frozen the same way in both, and held fixed inside a held_state.held block where the
    backend's forward reads held scales. Both libraries keep amax in a `_amax` buffer and share the switches used
    here (`enable`, `disable`, `enable_calib`, `disable_quant`, ...) and a `_calibrator` with `collect`."""

    backend_name = ""
    holds_scales = False  # whether the forward reads scales held by a held_state.held block
    # the values of an open held block, and the per-channel tensors blocks write them into (held_state.py); class
    # defaults: also for unpickled quantizers
    _held = None
    _held_storage = None

    def holdable(self) -> bool:
        """Whether a held block computes this quantizer's scales at its start."""
        return False

    def __getstate__(self) -> dict:  # a block's values belong to the block: never pickled or deep-copied
        state = super().__getstate__()
        state.pop("_held", None)
        state.pop("_held_storage", None)  # a copy sharing it would write into this quantizer's tensors
        return state

    def _check_not_held(self) -> None:
        if self._held is not None:
            raise RuntimeError("a range changed inside a block that holds it fixed (models/quantization/held_state.py)")

    def set_amax(self, amax: torch.Tensor) -> None:
        self._check_not_held()
        amax = amax.detach().float()
        if isinstance(getattr(self, "_amax", None), nn.Parameter):  # learned amax: keep the parameter object
            with torch.no_grad():
                self._amax.copy_(amax.reshape(self._amax.shape))
        elif hasattr(self, "_amax"):
            self._amax = amax.to(self._amax.device).reshape(self._amax.shape) \
                if amax.numel() == self._amax.numel() else amax.to(self._amax.device)
        else:
            self.register_buffer("_amax", amax)

    def clear_amax(self) -> None:
        self._check_not_held()
        self._buffers.pop("_amax", None)
        self._parameters.pop("_amax", None)

    def make_amax_learnable(self) -> nn.Parameter:
        """Turn the calibrated amax into a trained parameter (same value); idempotent."""
        if not isinstance(self._amax, nn.Parameter):
            value = self._buffers.pop("_amax")
            self.register_parameter("_amax", nn.Parameter(value.clone()))
        return self._amax

    def freeze_amax(self) -> None:
        """A learned amax back to a plain buffer (what checkpoints and exports hold)."""
        if isinstance(getattr(self, "_amax", None), nn.Parameter):
            value = self._parameters.pop("_amax").detach().clone()
            self.register_buffer("_amax", value)

    def _learned_amax(self) -> torch.Tensor | None:
        """amax where this forward trains it (LSQ: models/quantization/fake_quant.py), else None."""
        amax = getattr(self, "_amax", None)
        if amax is not None and amax.requires_grad and torch.is_grad_enabled() and not torch.onnx.is_in_onnx_export():
            return amax
        return None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the libraries create a missing `_amax` on a fixed device (pytorch-quantization: `.cuda()`) or refuse a
        # changed shape; create it where the value is
        key = prefix + "_amax"
        if key in state_dict:
            self.set_amax(state_dict[key])
        else:
            self.clear_amax()
        nn.Module._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)


@dataclass(frozen=True)
class Backend:
    """One quantization library, as quantize.py inserts it."""

    name: str                                                # the --backend value
    activation_quantizer: Callable[[int], Quantizer]         # num_bits -> a per-tensor quantizer
    weight_quantizer: Callable[[int], Quantizer]             # num_bits -> a per-output-channel quantizer
    quantized_conv: Callable[[nn.Conv2d], nn.Module]         # the conv re-classed (its quantizers attached after)
    quantized_maxpool: Callable[[nn.MaxPool2d], nn.Module]
    checkpoint_modules: tuple[str, ...]                      # modules whose nn.Module classes its checkpoints hold
    calibrator_modules: tuple[str, ...] = ()                 # modules whose calibrator classes they hold
    quiet: Callable[[], ContextManager] = contextlib.nullcontext  # its logging kept to errors while switching


def get_backend(name: str) -> Backend:
    """The backend called `name` (its library imported now), or a one-line error saying what to install."""
    if name not in BACKENDS:
        raise ValueError(f"--backend must be one of {tuple(BACKENDS)}, got {name!r}")
    module, package, _ = BACKENDS[name]
    try:
        return importlib.import_module(module).BACKEND
    except ImportError as e:
        raise ValueError(f"{package} does not import ({e}); install it with "
                         f"./install_dependencies.sh{' --modelopt' if name == 'modelopt' else ''}") from None


def convert_instance(module: nn.Module, cls: type) -> nn.Module:
    """Re-class a module instance into its quantized subclass, keeping its state and attributes
    (YOLO's layer bookkeeping `f`, `i`, `type`, `np` included)."""
    new = cls.__new__(cls)
    new.__dict__ = module.__dict__.copy()
    new._modules = module._modules.copy()
    new._parameters = module._parameters.copy()
    new._buffers = module._buffers.copy()
    return new
