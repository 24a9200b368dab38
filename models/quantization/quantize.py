"""INT8 quantization of YOLOv9 / GELAN detection and segmentation models for TensorRT (explicit Q/DQ).

The one place that owns quantization: which modules get quantizers (a declarative `QuantRecipe`),
the quantized module variants, calibration, checkpoints. The TensorRT scale-sharing rules are derived
in `models/quantization/rules.py`.

Quantizers are pytorch-quantization's `TensorQuantizer` (its modules, state and Q/DQ export format),
with two speed/correctness changes kept in `Int8Quantizer`:
- fake quantization runs through PyTorch's native fused kernels with scales computed once per epoch or
  evaluation (models/quantization/held_state.py: no host sync and one to three kernels per quantizer and step; FP16
  activations stay FP16), using the same [-128, 127] range that the exported QuantizeLinear and TensorRT
  use, so the model that is trained and evaluated is the model that is deployed;
- calibration histograms use `models.quantization.calibration.HistogramCollector` (fast, CPU and GPU,
  independent of batching).

Calibration collects statistics once (`collect_statistics`); every candidate range (max, mse, entropy, three
percentiles) is computed from those same statistics, so `--calib-method auto` can measure each candidate and keep
the best (models/core/selection.py) for the cost of one pass over the calibration images.
"""
from __future__ import annotations

import contextlib
import copy
import math
import re
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pytorch_quantization import nn as quant_nn
from pytorch_quantization.nn.modules.tensor_quantizer import TensorQuantizer
from pytorch_quantization.tensor_quant import QuantDescriptor

from models.common import AConv, ADown, Concat, RepNBottleneck
from models.core.distributed import World
from models.quantization.calibration import (AMAX_METHODS, AUTO_CANDIDATES, HISTOGRAM_CANDIDATES,  # noqa: F401
                                             PER_QUANTIZER, HistogramCollector, combine_statistics)
from models.quantization.ranges import SEARCH_IMAGES, search

CALIB_METHODS = ("auto",) + AMAX_METHODS + (PER_QUANTIZER,)
CONVS = (nn.Conv2d, quant_nn.QuantConv2d)  # pytorch-quantization's conv is no nn.Conv2d subclass
_MIN_AMAX = 1e-6  # TensorRT rejects a zero scale; a channel that is all zeros gets this instead


# --------------------------------------------------------------------------------------------------
# Recipe
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantRecipe:
    """What to quantize and how. Patterns are regexes matched (re.search) against module names."""

    num_bits: int = 8
    calib_method: str = "auto"         # auto (the best on the select split) | max | mse | percentile | entropy |
                                       # per-quantizer
    percentile: float = 99.999         # used by calib_method="percentile"
    calib_batches: int = 25            # training batches whose activations set the ranges
    skip: tuple[str, ...] = ()         # module-name patterns left in floating point
    # DFL decodes box distributions with fixed weights; INT8 there costs box precision, saves nothing.
    never_quantize: tuple[str, ...] = (r"\.dfl(\.|$)",)
    share_add_inputs: bool = True      # residual Add inputs use one scale (TensorRT fuses Conv+Add)
    # TensorRT's scale-sharing rules (models/quantization/rules.py). Off only to measure what they cost in accuracy:
    # the export then has joins with several scales, where TensorRT inserts reformat layers.
    share_rules: bool = True

    def __post_init__(self):
        if self.calib_method not in CALIB_METHODS:
            raise ValueError(f"--calib-method must be one of {CALIB_METHODS}, got {self.calib_method!r}")
        if not 0 <= self.percentile <= 100:
            raise ValueError(f"--percentile must be in [0, 100], got {self.percentile}")
        if self.calib_batches < 1:
            raise ValueError(f"--calib-batches must be >= 1, got {self.calib_batches}")

    def candidates(self) -> dict[str, tuple[str, float | None]]:
        """The activation ranges this recipe calibrates: {name: (method, percentile)}; several for `auto`."""
        if self.calib_method == "auto":
            return dict(AUTO_CANDIDATES)
        if self.calib_method == "percentile":
            return {f"percentile-{self.percentile:g}": ("percentile", self.percentile)}
        return {self.calib_method: (self.calib_method, None)}

    def is_skipped(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.skip + self.never_quantize)

    def to_dict(self) -> dict:
        return asdict(self)


def skip_patterns(skip_layers: Iterable[str]) -> tuple[str, ...]:
    """`--skip-layers` values to regexes: a layer index `22` means everything under `model.22.`."""
    patterns = []
    for item in skip_layers:
        item = str(item).strip()
        if not item:
            continue
        if item.isdigit():
            patterns.append(rf"^model\.{int(item)}(\.|$)")
        else:
            try:
                re.compile(item)
            except re.error as e:
                raise ValueError(f"--skip-layers: {item!r} is neither a layer index nor a valid regex ({e})")
            patterns.append(item)
    return tuple(patterns)


# --------------------------------------------------------------------------------------------------
# Quantizer
# --------------------------------------------------------------------------------------------------
class QuantParams(NamedTuple):
    scale: float | torch.Tensor             # per tensor: a float; per channel: one value per output channel
    inv_scale: float | torch.Tensor         # 1 / scale in float32, as the native kernels compute it
    zero_point: int | torch.Tensor
    bound: int                              # 127 for INT8: values are clamped to [-bound - 1, bound]


def quant_params(amax: torch.Tensor, num_bits: int = 8) -> QuantParams:
    """Scale and zero point for symmetric INT8 from amax, as host values / plain tensors.

    Built outside the autograd and ONNX traces, so the exported scale is a constant, and held for a whole training
    epoch or evaluation (models/quantization/held_state.py), so a step neither recomputes them nor waits on the GPU.
    """
    bound = 2 ** (num_bits - 1) - 1
    scale = amax.detach().float().clamp_min(_MIN_AMAX).cpu().numpy() / bound
    if scale.size == 1:
        scale = scale.reshape(())
        return QuantParams(float(scale), float(np.float32(1) / scale), 0, bound)
    scale = torch.from_numpy(scale.reshape(-1).copy()).to(amax.device)
    return QuantParams(scale, 1.0 / scale, torch.zeros_like(scale, dtype=torch.int32), bound)


def fake_quant_with(x: torch.Tensor, params: QuantParams) -> torch.Tensor:
    """Fake-quantize with precomputed `quant_params`: per tensor, or per channel along dim 0.

    Exported by torch.onnx as QuantizeLinear/DequantizeLinear with int8 zero points.
    """
    scale, inv_scale, zero_point, bound = params
    per_tensor = isinstance(scale, float)
    dtype = x.dtype
    # AMP activations: the CUDA kernel quantizes FP16/BF16 directly (it computes in FP32 inside);
    # casting to FP32 and back would triple the memory traffic of every quantizer.
    cast = dtype != torch.float32 and not (per_tensor and x.is_cuda and dtype in (torch.float16, torch.bfloat16))
    if cast:  # only where the kernel lacks the dtype; never in ONNX export, which traces FP32 (no Cast nodes)
        x = x.float()
    if per_tensor and x.is_cpu and not (x.requires_grad and torch.is_grad_enabled()) \
            and not torch.onnx.is_in_onnx_export() and not torch.compiler.is_compiling():
        # Evaluation on a CPU: the native kernel takes ~2.5x as long as multiplying by the float32 1 / scale,
        # rounding half to even, clamping and scaling in place, which give its values bit for bit (+ 0.0: its zeros
        # are never negative; tests/test_quantize.py). Quantization was ~40 % of a CPU evaluation's time.
        out = x.mul(inv_scale).round_().clamp_(-bound - 1, bound).mul_(scale).add_(0.0)
    elif per_tensor:
        out = torch.fake_quantize_per_tensor_affine(x, scale, zero_point, -bound - 1, bound)
    elif torch.onnx.is_in_onnx_export():  # exports as QuantizeLinear/DequantizeLinear with axis=0
        out = torch.fake_quantize_per_channel_affine(x, scale, zero_point, 0, -bound - 1, bound)
    else:
        # The same values and gradient mask as the per-channel kernel, which reads its zero points back to
        # the host (two GPU syncs per weight and step): the per-tensor kernel at scale 1 rounds and clamps.
        shape = (-1,) + (1,) * (x.dim() - 1)
        out = torch.fake_quantize_per_tensor_affine(x * inv_scale.view(shape), 1.0, 0, -bound - 1, bound)
        out = out * scale.view(shape)
    return out.to(dtype) if cast else out


def fake_quant_learnable(x: torch.Tensor, amax: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """Per-tensor fake quantization with a gradient for amax (LSQ: the step size learns from the rounding and
    clipping errors it causes, scaled by 1/sqrt(numel * bound) as in the LSQ paper). The forward values equal
    `fake_quant` with the same amax."""
    bound = 2 ** (num_bits - 1) - 1
    scale = (amax.float().clamp_min(_MIN_AMAX) / bound).reshape(1)
    zero_point = torch.zeros(1, device=x.device)
    grad_factor = 1.0 / math.sqrt(x.numel() * bound)
    out = torch._fake_quantize_learnable_per_tensor_affine(x.float(), scale, zero_point, -bound - 1, bound, grad_factor)
    return out.to(x.dtype)


def fake_quant(x: torch.Tensor, amax: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """Symmetric fake quantization, per tensor (amax.numel()==1) or per channel along dim 0."""
    return fake_quant_with(x, quant_params(amax, num_bits))


class Int8Quantizer(TensorQuantizer):
    """TensorQuantizer with native fake-quant kernels and device-safe checkpoint loading."""

    # the values of an open models.quantization.held_state.held block (class default: also for unpickled quantizers)
    _held = None

    def __init__(self, quant_desc: QuantDescriptor):
        super().__init__(quant_desc)
        if quant_desc.axis is None:  # activations: one collector serves every method
            self._calibrator = HistogramCollector(self._num_bits, self._unsigned)

    def _quant_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        amax = getattr(self, "_amax", None)
        if amax is None or self._scale_amax is not None:  # dynamic range: recomputed every call
            return fake_quant(inputs, self._get_amax(inputs), self._num_bits)
        if amax.requires_grad and torch.is_grad_enabled() and not torch.onnx.is_in_onnx_export():
            return fake_quant_learnable(inputs, amax, self._num_bits)
        if self._held is not None:  # inside a held_state.held block: the scale computed at its start
            return self._held.fake_quant(inputs)
        if torch.compiler.is_compiling():  # a trace cannot read amax back to the host
            raise RuntimeError("a compiled forward reached a quantizer outside a "
                               "models.quantization.held_state.held block")
        return fake_quant(inputs, amax, self._num_bits)

    def __getstate__(self) -> dict:  # a block's values belong to the block: never pickled or deep-copied
        state = super().__getstate__()
        state.pop("_held", None)
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

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # pytorch-quantization creates a missing `_amax` with `.cuda()`; create it where the value is.
        key = prefix + "_amax"
        if key in state_dict:
            self.set_amax(state_dict[key])
        else:
            self.clear_amax()
        nn.Module._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)


def _activation_desc(recipe: QuantRecipe) -> QuantDescriptor:
    return QuantDescriptor(num_bits=recipe.num_bits, calib_method="histogram")


def _weight_desc(recipe: QuantRecipe) -> QuantDescriptor:
    return QuantDescriptor(num_bits=recipe.num_bits, axis=(0,), calib_method="max")


# --------------------------------------------------------------------------------------------------
# Quantized module variants (instances are converted, upstream classes are untouched)
# --------------------------------------------------------------------------------------------------
def _convert_instance(module: nn.Module, cls: type) -> nn.Module:
    """Re-class a module instance into its quantized subclass, keeping its state and attributes
    (YOLO's layer bookkeeping `f`, `i`, `type`, `np` included)."""
    new = cls.__new__(cls)
    new.__dict__ = module.__dict__.copy()
    new._modules = module._modules.copy()
    new._parameters = module._parameters.copy()
    new._buffers = module._buffers.copy()
    return new


class QuantConcat(Concat):
    """Concat whose inputs are quantized by one quantizer: TensorRT concatenates INT8 in place."""

    def forward(self, x):
        return torch.cat([self._input_quantizer(t) for t in x], self.d)


class QuantADown(ADown):
    """ADown with its average pool and max pool running on INT8 inputs."""

    def forward(self, x):
        x = F.avg_pool2d(self._avgpool_quantizer(x), 2, 1, 0, False, True)
        x1, x2 = x.chunk(2, 1)
        x1 = self.cv1(x1)
        x2 = F.max_pool2d(self._maxpool_quantizer(x2), 3, 2, 1)
        return torch.cat((x1, self.cv2(x2)), 1)


class QuantAConv(AConv):
    """AConv with its average pool running on an INT8 input."""

    def forward(self, x):
        return self.cv1(F.avg_pool2d(self._avgpool_quantizer(x), 2, 1, 0, False, True))


class QuantRepNBottleneck(RepNBottleneck):
    """RepNBottleneck whose residual Add takes INT8 inputs, so TensorRT fuses it into the conv."""

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        if not self.add:
            return y
        return self._add_quantizer0(x) + self._add_quantizer1(y)


class QuantUpsample(nn.Upsample):
    def forward(self, x):
        return super().forward(self._input_quantizer(x))


def _quantizer(desc: QuantDescriptor) -> Int8Quantizer:
    return Int8Quantizer(desc)


# Module type -> its quantized replacement (or None where an instance has nothing to quantize), as Model
# Optimizer registers quantized module types. Exact types: subclasses carry their own forward.
QUANTIZED_TYPES: dict[type, Callable[[nn.Module, QuantRecipe], nn.Module | None]] = {}


def register(*types: type):
    def add(make):
        for t in types:
            QUANTIZED_TYPES[t] = make
        return make
    return add


# Conv and MaxPool are re-classed like the blocks below, not constructed: pytorch-quantization's constructors
# check their caller with inspect.stack(), about 30 ms a layer (5.5 s of gelan-t's 9 s insertion on a CPU).
@register(nn.Conv2d)
def _quant_conv(conv: nn.Conv2d, recipe: QuantRecipe) -> quant_nn.QuantConv2d:
    q = _convert_instance(conv, quant_nn.QuantConv2d)
    q._fake_quant = True
    # fused convs may hold non-leaf tensors: fresh parameters with the same values
    q.weight = nn.Parameter(conv.weight.detach().clone())
    if conv.bias is not None:
        q.bias = nn.Parameter(conv.bias.detach().clone())
    q._input_quantizer = _quantizer(_activation_desc(recipe))
    q._weight_quantizer = _quantizer(_weight_desc(recipe))
    return q


@register(nn.MaxPool2d)
def _quant_maxpool(pool: nn.MaxPool2d, recipe: QuantRecipe) -> quant_nn.QuantMaxPool2d:
    q = _convert_instance(pool, quant_nn.QuantMaxPool2d)
    q._fake_quant = True
    q._input_quantizer = _quantizer(_activation_desc(recipe))
    return q


def _attach(module: nn.Module, cls: type, names: tuple[str, ...], recipe: QuantRecipe) -> nn.Module:
    new = _convert_instance(module, cls)
    for name in names:
        new.add_module(name, _quantizer(_activation_desc(recipe)))
    return new


def _register_attached(cls: type, quantized: type, names: tuple[str, ...], when=lambda m: True) -> None:
    register(cls)(lambda m, recipe: _attach(m, quantized, names, recipe) if when(m) else None)


_register_attached(nn.Upsample, QuantUpsample, ("_input_quantizer",))
_register_attached(Concat, QuantConcat, ("_input_quantizer",))
_register_attached(ADown, QuantADown, ("_avgpool_quantizer", "_maxpool_quantizer"))
_register_attached(AConv, QuantAConv, ("_avgpool_quantizer",))
_register_attached(RepNBottleneck, QuantRepNBottleneck, ("_add_quantizer0", "_add_quantizer1"), lambda m: m.add)


def _replace_modules(module: nn.Module, recipe: QuantRecipe, prefix: str = "") -> None:
    for name, child in list(module.named_children()):
        full = f"{prefix}.{name}" if prefix else name
        if recipe.is_skipped(full):
            continue
        make = QUANTIZED_TYPES.get(type(child))
        new = make(child, recipe) if make is not None else None
        if new is not None:
            setattr(module, name, new)
            child = new
        _replace_modules(child, recipe, full)


# --------------------------------------------------------------------------------------------------
# Model-level API
# --------------------------------------------------------------------------------------------------
def float_convs(model: nn.Module, recipe: QuantRecipe = QuantRecipe()) -> list[str]:
    """The convs of a quantized model that compute in float by choice (--skip-layers, mixed precision), not by
    design (the recipe's never_quantize: DFL)."""
    if not is_quantized(model):
        return []
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, CONVS) or any(re.search(p, name) for p in recipe.never_quantize):
            continue
        if not isinstance(m, quant_nn.QuantConv2d) or m._weight_quantizer._disabled:
            out.append(name)
    return out


def quantize_model(model: nn.Module, recipe: QuantRecipe = QuantRecipe(), imgsz: int = 64) -> nn.Module:
    """Insert quantizers into a fused (reparameterized) float YOLO model, in place.

    With `recipe.share_rules`, quantizers that TensorRT must give one scale are made one object
    (see `models.quantization.rules`), so calibration and QAT see them as one.
    """
    if is_quantized(model):
        raise ValueError("model is already quantized")
    _replace_modules(model, recipe)
    if recipe.share_rules:
        from models.quantization.rules import share_quantizers  # rules need the quantized model first
        share_quantizers(model, imgsz=imgsz, share_add_inputs=recipe.share_add_inputs)
    return model


def learnable_amax_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Make every calibrated activation amax a trained parameter; returns them (one per shared quantizer)."""
    return [q.make_amax_learnable() for _, q in named_quantizers(model, activations_only=True)
            if not q._disabled and q.amax is not None]


def freeze_amax(model: nn.Module) -> nn.Module:
    """Learned amax back to buffers, in place."""
    for _, q in named_quantizers(model):
        q.freeze_amax()
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, TensorQuantizer) for m in model.modules())


def is_enabled(quantizer: TensorQuantizer) -> bool:
    return not quantizer._disabled


def quantized_convs(model: nn.Module) -> Iterator[tuple[str, nn.Module, TensorQuantizer, TensorQuantizer]]:
    """Each quantized conv with its input and weight quantizers: what the stages above read of a conv, so that
    only this package names the quantization library's attributes."""
    for name, m in model.named_modules():
        if isinstance(m, quant_nn.QuantConv2d):
            yield name, m, m._input_quantizer, m._weight_quantizer


def named_quantizers(model: nn.Module, activations_only: bool = False) -> Iterator[tuple[str, TensorQuantizer]]:
    """Every distinct quantizer once (a shared one under its first name)."""
    for name, m in model.named_modules():
        if isinstance(m, TensorQuantizer) and not (activations_only and m.axis is not None):
            yield name, m


def quantizer_counts(model: nn.Module) -> dict[str, int]:
    placements = sum(isinstance(m, TensorQuantizer) for _, m in model.named_modules(remove_duplicate=False))
    distinct = list(named_quantizers(model))
    return {
        "placements": placements,
        "distinct": len(distinct),
        "weight": sum(q.axis is not None for _, q in distinct),
        "activation": sum(q.axis is None for _, q in distinct),
        "enabled": sum(not q._disabled for _, q in distinct),
    }


@contextlib.contextmanager
def quantization_disabled(quantizers: Iterable[TensorQuantizer]):
    """Temporarily run the given quantizers as identity."""
    quantizers = [q for q in quantizers if not q._disabled]
    for q in quantizers:
        q.disable()
    try:
        yield
    finally:
        for q in quantizers:
            q.enable()


@torch.no_grad()
def calibrate_weights(model: nn.Module) -> None:
    """Per-output-channel max |w| of every quantized conv weight (no data needed)."""
    for m in model.modules():
        if isinstance(m, quant_nn.QuantConv2d):
            w = m.weight.detach().float()
            m._weight_quantizer.set_amax(w.abs().amax(dim=(1, 2, 3), keepdim=True))


class ActivationStatistics:
    """What one calibration pass saw at every enabled activation quantizer, and the ranges derived from it.
    `apply(name)` sets every amax to a candidate's ranges (computed once, then cached). The per-quantizer candidate
    runs `model` on `images` (the first calibration images, every rank's share in one process's order): rank 0
    searches and every rank gets its result, so all ranks hold the same ranges."""

    def __init__(self, names: list[str], quantizers: list[TensorQuantizer], collectors: list[HistogramCollector],
                 candidates: dict[str, tuple[str, float | None]], collect_s: float, model: nn.Module,
                 images: torch.Tensor | None = None, world: World = World()):
        self.names, self.quantizers, self.collectors, self.candidates = names, quantizers, collectors, candidates
        self.collect_s, self.device = collect_s, _device_of(model)
        self.model, self.images, self.world = model, images, world
        self.amax_s: dict[str, float] = {}
        self.per_quantizer: dict[str, str] = {}  # the method each quantizer took in the per-quantizer candidate
        self._ranges: dict[str, list[torch.Tensor]] = {}

    def ranges(self, name: str) -> list[torch.Tensor]:
        if name not in self._ranges:
            method, percentile = self.candidates.get(name) or HISTOGRAM_CANDIDATES[name]  # the search's pool too
            t0 = time.perf_counter()
            if method == PER_QUANTIZER:
                with quiet_quantizers():
                    self._ranges[name] = self._search()
            else:
                kwargs = {} if percentile is None else {"percentile": percentile}
                self._ranges[name] = [c.compute_amax(method, **kwargs) for c in self.collectors]
            self.amax_s[name] = round(time.perf_counter() - t0, 3)
        return self._ranges[name]

    def _search(self) -> list[torch.Tensor]:
        result = None
        if self.world.main:
            pool = {m: self.ranges(m) for m in HISTOGRAM_CANDIDATES}
            ranges, methods, order = search(self.model, self.quantizers, pool, self.images)
            result = ([r.cpu() for r in ranges], methods, order)
        ranges, methods, order = self.world.broadcast(result)
        self.per_quantizer = {self.names[k]: methods[k] for k in order}  # in the order they were chosen
        return ranges

    def apply(self, name: str) -> None:
        for q, amax in zip(self.quantizers, self.ranges(name)):
            q.set_amax(amax.reshape(()).to(self.device))


@contextlib.contextmanager
def quiet_quantizers():
    """pytorch-quantization logs every quantizer's state change through absl (hundreds of lines per calibration
    of a large model): kept to errors while the quantizers are switched, the caller prints one summary instead."""
    from absl import logging as absl_logging
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)


@torch.no_grad()
def collect_statistics(model: nn.Module, recipe: QuantRecipe, batches: Iterable[torch.Tensor],
                       world: World = World()) -> ActivationStatistics:
    """One pass over `batches` (on the model's device, float, 0-1 scaled): the histogram and maximum of every
    enabled activation quantizer's input, and the per-channel weight ranges. In a distributed job each rank passes
    its share of the calibration images and gets the combined statistics (models/core/distributed.py)."""
    with quiet_quantizers():
        return _collect_statistics(model, recipe, batches, world)


def _collect_statistics(model: nn.Module, recipe: QuantRecipe, batches: Iterable[torch.Tensor],
                        world: World) -> ActivationStatistics:
    named = [(n, q) for n, q in named_quantizers(model, activations_only=True) if not q._disabled]
    acts = [q for _, q in named]
    collectors = []
    for q in acts:
        if not isinstance(q._calibrator, HistogramCollector):
            q._calibrator = HistogramCollector(q.num_bits, q.unsigned)
        q._calibrator.reset()
        collectors.append(q._calibrator)
        q.clear_amax()
        q.disable_quant()
        q.enable_calib()
    calibrate_weights(model)
    candidates = recipe.candidates()
    searched = any(method == PER_QUANTIZER for method, _ in candidates.values())
    kept: list[torch.Tensor] = []  # this rank's share of the first batches: the per-quantizer search's images
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        for im in batches:
            model(im)
            if searched and sum(len(k) for k in kept) * world.size < SEARCH_IMAGES:
                kept.append(im)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        combine_statistics(collectors, world)
    finally:
        for q in acts:
            q.disable_calib()
            q.enable_quant()
        model.train(was_training)
    empty = [i for i, c in enumerate(collectors) if c.hist is None]
    if empty:
        raise RuntimeError(f"{len(empty)} quantizer(s) saw no data during calibration; is the model's forward complete?")
    for q in acts:  # the statistics now belong to the returned object
        q._calibrator = HistogramCollector(q.num_bits, q.unsigned)
    images = search_images(kept, world, _device_of(model)) if searched else None
    return ActivationStatistics([n for n, _ in named], acts, collectors, candidates, time.perf_counter() - t0, model,
                                images, world)


def search_images(kept: list[torch.Tensor], world: World, device: torch.device) -> torch.Tensor:
    """The first SEARCH_IMAGES calibration images in one process's order: each global batch is the ranks' shares
    in rank order (utils/batches.py `RankBatches`)."""
    shares = world.all_gather([k.cpu() for k in kept])
    batches = [torch.cat([share[b] for share in shares]) for b in range(len(kept))]
    return torch.cat(batches)[:SEARCH_IMAGES].to(device)


def calibrate(model: nn.Module, recipe: QuantRecipe, batches: Iterable[torch.Tensor], world: World = World()
              ) -> ActivationStatistics:
    """PTQ with one fixed method: statistics over `batches`, then every amax by `recipe.calib_method`.
    (`auto` measures candidates on a select split: models/core/selection.py.)"""
    if recipe.calib_method == "auto":
        raise ValueError("calib_method 'auto' chooses by measuring: use models.core.selection.choose_calibration")
    stats = collect_statistics(model, recipe, batches, world)
    stats.apply(next(iter(stats.candidates)))
    return stats


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# --------------------------------------------------------------------------------------------------
# Teacher
# --------------------------------------------------------------------------------------------------
def copy_float(model: nn.Module) -> nn.Module:
    """A detached copy for use as the frozen float teacher."""
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


__all__ = [
    "QuantRecipe", "Int8Quantizer", "fake_quant", "fake_quant_with", "fake_quant_learnable",
    "learnable_amax_parameters",
    "freeze_amax", "quant_params", "quantize_model", "is_quantized",
    "named_quantizers", "quantizer_counts", "quantization_disabled", "calibrate",
    "collect_statistics", "ActivationStatistics", "AUTO_CANDIDATES", "HISTOGRAM_CANDIDATES",
    "calibrate_weights", "copy_float",
    "skip_patterns", "CALIB_METHODS", "QUANTIZED_TYPES", "register",
]
