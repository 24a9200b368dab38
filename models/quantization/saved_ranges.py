"""A calibration kept apart from its model: every quantizer's range (amax) and on/off state in a small file, from
which the float weights rebuild the same PTQ model in seconds on any machine (no calibration images, no GPU).

The file is NumPy's .npz, read with `allow_pickle=False` (loading runs no code): one float32 array per quantizer
that holds a range, under the quantizer's name, and `__meta__`, a JSON string: the format version, the recipe that
inserted the quantizers, every quantizer's name, the ones turned off (layers kept in float), and what the caller
records (the calibration sample's digest, the method, the float weights' sha256).

A file fits a model when the model quantized by the recorded recipe has exactly the recorded quantizers and each
range has the number of values its quantizer takes (one per activation tensor, one per output channel of a
weight). Anything else is refused in one line naming the file and the first difference; nothing is cached.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from models.quantization.quantize import QuantRecipe, calibrate_weights, named_quantizers, quantize_model
from utils.io_utils import atomic_write

RANGES_FORMAT = 1
META_KEY = "__meta__"


def save_ranges(model: nn.Module, path: str | Path, recipe: QuantRecipe, **record) -> Path:
    """The ranges and on/off state of calibrated `model` (quantized by `recipe`) to `path`, with `record`."""
    quantizers = list(named_quantizers(model))
    arrays = {name: q.amax.detach().float().cpu().numpy() for name, q in quantizers if q.amax is not None}
    meta = {"format": RANGES_FORMAT, "recipe": recipe.to_dict(), "quantizers": [n for n, _ in quantizers],
            "off": [n for n, q in quantizers if q._disabled], **record}
    arrays[META_KEY] = np.array(json.dumps(meta))
    return atomic_write(Path(path), lambda tmp: _write_npz(tmp, arrays))


def _write_npz(tmp: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to the temporary name
        np.savez_compressed(f, **arrays)


def read_ranges(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """The ranges by quantizer name and the meta record of a ranges file."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        meta = json.loads(str(arrays.pop(META_KEY)))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a ranges file ({type(e).__name__}: {e})") from None
    if meta.get("format") != RANGES_FORMAT:
        raise ValueError(f"{path}: ranges format {meta.get('format')!r}, this toolkit reads {RANGES_FORMAT}")
    return arrays, meta


def recipe_from_dict(recipe: dict) -> QuantRecipe:
    """A QuantRecipe from its to_dict() as JSON holds it (tuples as lists)."""
    return QuantRecipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in recipe.items()})


def apply_ranges(model: nn.Module, ranges: dict[str, np.ndarray], meta: dict, path: str | Path) -> None:
    """Set the quantizers of `model` (quantized, weights calibrated) to the file's ranges and on/off state."""
    quantizers = dict(named_quantizers(model))
    missing = [n for n in meta["quantizers"] if n not in quantizers]
    extra = [n for n in quantizers if n not in meta["quantizers"]]
    if missing or extra:
        first = f"{missing[0]} is not in the model" if missing else f"the model's {extra[0]} has no range there"
        raise ValueError(f"{path}: the ranges do not fit this model ({len(missing)} quantizer(s) missing, "
                         f"{len(extra)} not covered: {first})")
    for name, q in quantizers.items():
        value = ranges.get(name)
        if value is None and name not in meta["off"]:
            raise ValueError(f"{path}: no range for {name}, which is not off either")
        # an activation takes one value; a weight one per output channel (set from the weights beforehand)
        want = 1 if q.axis is None else None if q.amax is None else q.amax.numel()
        if value is not None and want is not None and value.size != want:
            raise ValueError(f"{path}: {name} has {value.size} range value(s), the model's quantizer takes {want}")
    for name, q in quantizers.items():
        if name in ranges:
            q.set_amax(torch.from_numpy(ranges[name].copy()))
        if name in meta["off"]:
            q.disable()
        else:
            q.enable()


def rebuild_ptq(float_model: nn.Module, path: str | Path) -> tuple[nn.Module, dict]:
    """`float_model` (fused, in place) quantized by the file's recipe and set to its ranges; and the file's meta."""
    ranges, meta = read_ranges(path)
    model = quantize_model(float_model, recipe_from_dict(meta["recipe"]))  # as qat.py quantizes
    calibrate_weights(model)  # the weight quantizers' shapes (and values, replaced by the file's)
    apply_ranges(model, ranges, meta, path)
    return model.eval(), meta
