"""INT8 quantization of YOLOv9 / GELAN detection and segmentation models for TensorRT (explicit Q/DQ).

The one place that owns quantization: which modules get quantizers (a declarative `QuantRecipe`), the quantized
module variants, calibration. The quantizers themselves come from the recipe's backend (pytorch-quantization or
Model Optimizer, models/quantization/backends/), through its small interface only; the TensorRT scale-sharing rules
are derived in `models/quantization/rules.py`.

Calibration collects statistics once (`collect_statistics`, models.quantization.calibration.HistogramCollector for
either backend); every candidate range (max, mse, entropy, five percentiles) is computed from those same
statistics, so `--calib-method auto` can measure each candidate and keep the best (models/core/selection.py) for
the cost of one pass over the calibration images.
"""
from __future__ import annotations

import contextlib
import copy
import re
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common import AConv, ADown, Concat, RepNBottleneck
from models.core.distributed import World
from models.quantization.backends import BACKENDS, DEFAULT_BACKEND, Backend, Quantizer, convert_instance, get_backend
from models.quantization.calibration import (AMAX_METHODS, AUTO_CANDIDATES, HISTOGRAM_CANDIDATES,  # noqa: F401
                                             PER_QUANTIZER, HistogramCollector, combine_statistics)
from models.quantization.ranges import SEARCH_IMAGES, search

CALIB_METHODS = ("auto",) + AMAX_METHODS + (PER_QUANTIZER,)


# --------------------------------------------------------------------------------------------------
# Recipe
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantRecipe:
    """What to quantize and how. Patterns are regexes matched (re.search) against module names."""

    backend: str = DEFAULT_BACKEND     # the quantization library (models/quantization/backends/)
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
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {tuple(BACKENDS)}, got {self.backend!r}")
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
# Quantized module variants (instances are converted, upstream classes are untouched)
# --------------------------------------------------------------------------------------------------
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


# Module type -> its quantized replacement (or None where an instance has nothing to quantize), as Model
# Optimizer registers quantized module types. Exact types: subclasses carry their own forward.
QUANTIZED_TYPES: dict[type, Callable[[nn.Module, Backend, int], nn.Module | None]] = {}


def register(*types: type):
    def add(make):
        for t in types:
            QUANTIZED_TYPES[t] = make
        return make
    return add


@register(nn.Conv2d)
def _quant_conv(conv: nn.Conv2d, backend: Backend, num_bits: int) -> nn.Module:
    q = backend.quantized_conv(conv)
    # fused convs may hold non-leaf tensors: fresh parameters with the same values
    q.weight = nn.Parameter(conv.weight.detach().clone())
    if conv.bias is not None:
        q.bias = nn.Parameter(conv.bias.detach().clone())
    q._input_quantizer = backend.activation_quantizer(num_bits)
    q._weight_quantizer = backend.weight_quantizer(num_bits)
    return q


@register(nn.MaxPool2d)
def _quant_maxpool(pool: nn.MaxPool2d, backend: Backend, num_bits: int) -> nn.Module:
    q = backend.quantized_maxpool(pool)
    q._input_quantizer = backend.activation_quantizer(num_bits)
    return q


def _attach(module: nn.Module, cls: type, names: tuple[str, ...], backend: Backend, num_bits: int) -> nn.Module:
    new = convert_instance(module, cls)
    for name in names:
        new.add_module(name, backend.activation_quantizer(num_bits))
    return new


def _register_attached(cls: type, quantized: type, names: tuple[str, ...], when=lambda m: True) -> None:
    register(cls)(lambda m, backend, num_bits: _attach(m, quantized, names, backend, num_bits) if when(m) else None)


_register_attached(nn.Upsample, QuantUpsample, ("_input_quantizer",))
_register_attached(Concat, QuantConcat, ("_input_quantizer",))
_register_attached(ADown, QuantADown, ("_avgpool_quantizer", "_maxpool_quantizer"))
_register_attached(AConv, QuantAConv, ("_avgpool_quantizer",))
_register_attached(RepNBottleneck, QuantRepNBottleneck, ("_add_quantizer0", "_add_quantizer1"), lambda m: m.add)


def _replace_modules(module: nn.Module, recipe: QuantRecipe, backend: Backend, prefix: str = "") -> None:
    for name, child in list(module.named_children()):
        full = f"{prefix}.{name}" if prefix else name
        if recipe.is_skipped(full):
            continue
        make = QUANTIZED_TYPES.get(type(child))
        new = make(child, backend, recipe.num_bits) if make is not None else None
        if new is not None:
            setattr(module, name, new)
            child = new
        _replace_modules(child, recipe, backend, full)


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
        if not is_conv(m) or any(re.search(p, name) for p in recipe.never_quantize):
            continue
        weights = _weight_quantizer(m)
        if weights is None or weights._disabled:
            out.append(name)
    return out


def quantize_model(model: nn.Module, recipe: QuantRecipe = QuantRecipe(), imgsz: int = 64) -> nn.Module:
    """Insert quantizers into a fused (reparameterized) float YOLO model, in place.

    With `recipe.share_rules`, quantizers that TensorRT must give one scale are made one object
    (see `models.quantization.rules`), so calibration and QAT see them as one.
    """
    if is_quantized(model):
        raise ValueError("model is already quantized")
    _replace_modules(model, recipe, get_backend(recipe.backend))
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
    return any(isinstance(m, Quantizer) for m in model.modules())


def backend_of(model: nn.Module) -> str:
    """The backend a quantized model's quantizers come from."""
    return next(m.backend_name for m in model.modules() if isinstance(m, Quantizer))


def holds_scales(model: nn.Module) -> bool:
    """Whether the model's quantizers read scales held per epoch (models/quantization/held_state.py), which a
    compiled step needs."""
    return all(m.holds_scales for m in model.modules() if isinstance(m, Quantizer))


def _weight_quantizer(m: nn.Module) -> Quantizer | None:
    q = getattr(m, "_weight_quantizer", None)
    return q if isinstance(q, Quantizer) else None


def is_conv(m: nn.Module) -> bool:
    """A conv, quantized or not (pytorch-quantization's QuantConv2d is no nn.Conv2d subclass)."""
    return isinstance(m, nn.Conv2d) or _weight_quantizer(m) is not None


def is_enabled(quantizer: Quantizer) -> bool:
    return not quantizer._disabled


def quantized_convs(model: nn.Module) -> Iterator[tuple[str, nn.Module, Quantizer, Quantizer]]:
    """Each quantized conv with its input and weight quantizers: what the stages above read of a conv, so that
    only this package names the quantization library's attributes."""
    for name, m in model.named_modules():
        if _weight_quantizer(m) is not None:
            yield name, m, m._input_quantizer, m._weight_quantizer


def named_quantizers(model: nn.Module, activations_only: bool = False) -> Iterator[tuple[str, Quantizer]]:
    """Every distinct quantizer once (a shared one under its first name)."""
    for name, m in model.named_modules():
        if isinstance(m, Quantizer) and not (activations_only and m.axis is not None):
            yield name, m


def quantizer_counts(model: nn.Module) -> dict[str, int]:
    placements = sum(isinstance(m, Quantizer) for _, m in model.named_modules(remove_duplicate=False))
    distinct = list(named_quantizers(model))
    return {
        "placements": placements,
        "distinct": len(distinct),
        "weight": sum(q.axis is not None for _, q in distinct),
        "activation": sum(q.axis is None for _, q in distinct),
        "enabled": sum(not q._disabled for _, q in distinct),
    }


@contextlib.contextmanager
def quantization_disabled(quantizers: Iterable[Quantizer]):
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
    for _, m, _, weights in quantized_convs(model):
        weights.set_amax(m.weight.detach().float().abs().amax(dim=(1, 2, 3), keepdim=True))


class ActivationStatistics:
    """What one calibration pass saw at every enabled activation quantizer, and the ranges derived from it.
    `apply(name)` sets every amax to a candidate's ranges (computed once, then cached). The per-quantizer candidate
    runs `model` on `images` (the first calibration images, every rank's share in one process's order): rank 0
    searches and every rank gets its result, so all ranks hold the same ranges."""

    def __init__(self, names: list[str], quantizers: list[Quantizer], collectors: list[HistogramCollector],
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
                with quiet(self.model):
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


def quiet(model: nn.Module):
    """The model's quantization library kept to errors while its quantizers are switched (a summary follows)."""
    return get_backend(backend_of(model)).quiet()


@torch.no_grad()
def collect_statistics(model: nn.Module, recipe: QuantRecipe, batches: Iterable[torch.Tensor],
                       world: World = World()) -> ActivationStatistics:
    """One pass over `batches` (on the model's device, float, 0-1 scaled): the histogram and maximum of every
    enabled activation quantizer's input, and the per-channel weight ranges. In a distributed job each rank passes
    its share of the calibration images and gets the combined statistics (models/core/distributed.py)."""
    with quiet(model):
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
    "QuantRecipe", "learnable_amax_parameters", "freeze_amax", "quantize_model", "is_quantized", "backend_of",
    "named_quantizers", "quantizer_counts", "quantization_disabled", "calibrate",
    "collect_statistics", "ActivationStatistics", "AUTO_CANDIDATES", "HISTOGRAM_CANDIDATES",
    "calibrate_weights", "copy_float",
    "skip_patterns", "CALIB_METHODS", "QUANTIZED_TYPES", "register",
]
