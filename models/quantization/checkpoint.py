"""Reading and writing YOLO checkpoints, safely.

A YOLO checkpoint is a pickled model, and unpickling can run arbitrary code. Files are therefore read with
`torch.load(weights_only=True)` and an allow-list of the classes such a checkpoint legitimately holds: the
torch.nn modules, upstream YOLOv9's modules, this overlay's quantized modules and the quantization backends'
modules and calibrators (Model Optimizer's only where the file names them: importing it takes seconds). The list
is derived from those packages (every nn.Module subclass they define), never a function. torch's restricted
unpickler calls any allowed global a file asks it to call (REDUCE), classes included, which runs the class's
constructor with the file's arguments: upstream's model constructors evaluate the strings of their config, so one
crafted file could run any code. A checkpoint creates its modules the way pickle creates any object (NEWOBJ: no
constructor runs), so the pickle is read first without unpickling, and a file that calls a class of the list is
refused. `trust=True` (`--trust-checkpoint`) falls back to full unpickling for files from a source the user trusts,
with a warning.

Upstream stores methods on modules (`m.forward = m.forward_fuse` when fusing, `self.detect = DDetect.forward`
in segmentation heads), which pickle as calls of `getattr`. Only a restricted getattr is allowed: it returns
`forward*` methods of allowed classes and nothing else (a plain getattr would reach any attribute, and from
there any function).
"""
from __future__ import annotations

import copy
import importlib
import io
import pickle
import pickletools
import shutil
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn as nn

from models.quantization.backends import BACKENDS, DEFAULT_BACKEND, get_backend
from models.quantization.quantize import freeze_amax, is_quantized
from utils.general import LOGGER
from utils.io_utils import atomic_write

_MODULE_PACKAGES = ("torch.nn", "models.common", "models.yolo", "models.quantization.quantize")
_CALIBRATOR_PACKAGES = ("models.quantization.calibration",)
# Where checkpoints written by earlier layouts name this overlay's classes, so those files load as they did: modules
# that moved whole (before models/ was split by stage), then classes that left a module that stays (before the
# backends: pytorch-quantization's quantizer).
MOVED_MODULES = {"models.quantize": "models.quantization.quantize", "models.calibrate": "models.quantization.calibration"}
MOVED_CLASSES = {"models.quantization.quantize.Int8Quantizer": "models.quantization.backends.pytorch_quantization"}


def module_now(module: str, name: str) -> str:
    """The module that holds class `name` now, of one a checkpoint names."""
    module = MOVED_MODULES.get(module, module)
    return MOVED_CLASSES.get(f"{module}.{name}", module)


def backends_named(globals_in_file: set[str]) -> tuple[str, ...]:
    """The backends whose classes a checkpoint's pickle names (the default's always: the allow-list has held it
    since before there were backends)."""
    return tuple(name for name, (module, _, library) in BACKENDS.items()
                 if name == DEFAULT_BACKEND or any(g.startswith((f"{module}.", f"{library}.")) for g in globals_in_file))


def _numpy_values() -> list:
    """What upstream's checkpoints pickle for `best_fitness` (a numpy float64, or a 1-element array in those saved
    during training): data only; anything an array holds still passes the allow-list."""
    import numpy as np
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray.scalar, core.multiarray._reconstruct, np.ndarray, np.dtype,
            *(getattr(np.dtypes, n) for n in ("Float64DType", "Float32DType")
                                                if hasattr(np, "dtypes") and hasattr(np.dtypes, n))]


@lru_cache(maxsize=None)
def allowed_classes(backends: tuple[str, ...] = (DEFAULT_BACKEND,)) -> tuple:
    """Classes a YOLO / yolov9-qat checkpoint quantized with `backends` may hold: modules and calibrators (no
    functions), and numpy's scalar reconstruction."""
    classes = set(_numpy_values())
    modules, calibrators = _MODULE_PACKAGES, _CALIBRATOR_PACKAGES
    for backend in map(get_backend, backends):
        modules, calibrators = modules + backend.checkpoint_modules, calibrators + backend.calibrator_modules
    for name in modules + calibrators:
        for obj in vars(importlib.import_module(name)).values():
            if isinstance(obj, type) and (issubclass(obj, nn.Module) or name in calibrators
                                          and obj.__module__.startswith(name)):
                classes.add(obj)
    return tuple(sorted(classes, key=lambda c: f"{c.__module__}.{getattr(c, '__qualname__', c.__name__)}"))


def _former_names(allowed: tuple) -> list[tuple[type, str]]:
    """The allowed classes that moved, under the names older checkpoints give them."""
    former_modules = set(MOVED_MODULES) | {k.rsplit(".", 1)[0] for k in MOVED_CLASSES}
    return [(c, f"{old}.{c.__qualname__}") for c in allowed for old in sorted(former_modules)
            if old != c.__module__ and module_now(old, c.__qualname__) == c.__module__]


class _FormerNamesUnpickler(pickle.Unpickler):
    """Full unpickling (--trust-checkpoint) that finds classes that moved where they are now."""

    def find_class(self, module: str, name: str):
        return super().find_class(module_now(module, name), name)


def _former_names_pickle() -> ModuleType:
    """`pickle` with the unpickler above, in the form torch.load's pickle_module takes."""
    module = ModuleType("former_names_pickle")
    module.Unpickler, module.load = _FormerNamesUnpickler, pickle.load
    return module


def _forward_getattr(allowed: tuple):
    """getattr for unpickling: `forward*` methods of `allowed` module classes (or their instances) only."""
    def forward_getattr(obj, name: str):
        cls = obj if isinstance(obj, type) else type(obj)
        if not (isinstance(name, str) and name.startswith("forward") and cls in allowed):
            raise pickle.UnpicklingError(f"getattr({cls.__name__}, {name!r}) is not allowed in a YOLO checkpoint")
        return getattr(obj, name)
    return forward_getattr


class References(NamedTuple):
    """What a checkpoint's pickle names (every global, as `module.name`) and which of those it calls."""
    named: frozenset[str]
    called: frozenset[str]


def _global_name(arg: str) -> str:
    """A GLOBAL opcode's "module name" as torch's unpickler resolves it (the Python 2 names that protocol 2 writes
    mapped to Python 3's)."""
    module, name = arg.split(" ", 1)
    module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
    return f"{module}.{name}"


def _stack_effect(op: pickletools.OpcodeInfo) -> tuple[bool, int, int]:
    """Whether an opcode takes what lies above the last mark (and the mark), how many entries it takes besides (below
    the mark), and how many it leaves."""
    before = op.stack_before
    marked = pickletools.markobject in before
    return marked, before.index(pickletools.markobject) if marked else len(before), len(op.stack_after)


_EFFECTS = {op.name: _stack_effect(op) for op in pickletools.opcodes}
_REFUSED_OPCODES = frozenset({"INST", "OBJ", "EXT1", "EXT2", "EXT4", "STACK_GLOBAL", "NEWOBJ_EX"})


def _pickle_references(pickled: bytes) -> References:
    """The globals a pickle names and calls, read without unpickling: its stack followed symbolically, each entry the
    name of the global it holds or None. Opcodes that make objects other than by NEWOBJ and REDUCE (INST, OBJ, the
    extension registry) or find globals other than by GLOBAL are refused: torch's restricted unpickler has none."""
    stack, memo, named, called = [], {}, set(), set()
    mark = pickletools.markobject
    for op, arg, _ in pickletools.genops(pickled):
        name = op.name
        if name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo[arg])
        elif name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
            memo[len(memo) if arg is None else arg] = stack[-1]
        elif name == "GLOBAL":
            stack.append(_global_name(arg))
            named.add(stack[-1])
        elif name == "MARK":
            stack.append(mark)
        elif name in _REFUSED_OPCODES:
            raise pickle.UnpicklingError(f"opcode {name} is not allowed in a YOLO checkpoint")
        else:
            marked, taken, left = _EFFECTS[name]
            if marked:  # what lies above the last mark, and the mark
                while stack.pop() is not mark:
                    pass
            if name == "REDUCE" and stack[-2]:
                called.add(stack[-2])
            if taken:
                del stack[-taken:]
            stack.extend((None,) * left)
    return References(frozenset(named), frozenset(called))


def _checkpoint_pickle(data: bytes) -> bytes | None:
    """The pickle of a `torch.save` archive, read as torch.load reads it; None for anything else."""
    with io.BytesIO(data) as f:
        if not torch.serialization._is_zipfile(f):
            return None
        with torch.serialization._open_zipfile_reader(f) as archive:
            return archive.get_record("data.pkl") if archive.has_record("data.pkl") else None


def _never_called(allowed: tuple) -> set[str]:
    """The names (and former names) of the allow-list's module and calibrator classes: a checkpoint creates them
    (NEWOBJ) and never calls them, which would run their constructors with its own arguments."""
    numpy_values = set(_numpy_values())
    classes = tuple(c for c in allowed if c not in numpy_values)
    return {f"{c.__module__}.{c.__qualname__}" for c in classes} | {name for _, name in _former_names(classes)}


def _allowed_globals_in(allowed: tuple, named: frozenset[str]) -> list:
    """The allow-list narrowed to the module and calibrator classes the file's pickle names: torch's restricted
    unpickler looks each reference up in the whole list, ~0.3 s a load with all of it. numpy's values stay whole: a
    pickled dtype names `numpy.dtype` and unpickles as a subclass of it that the unpickler checks too."""
    every = [*allowed, *_former_names(allowed), (_forward_getattr(allowed), "builtins.getattr")]
    numpy_values = set(_numpy_values())
    return [g for g in every if g in numpy_values or
            (g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}") in named]


def _references_in(data: bytes) -> tuple[References | None, str]:
    """What a checkpoint file's pickle names and calls, or why it cannot be read."""
    try:
        pickled = _checkpoint_pickle(data)
        if pickled is None:
            return None, ("not an archive written by torch.save of PyTorch >= 1.6; an older file you trust loads "
                          "with --trust-checkpoint")
        return _pickle_references(pickled), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def read_checkpoint(weights: str | Path, trust: bool = False, flag: str = "--weights") -> dict:
    """The checkpoint dict of a YOLO .pt file, loaded with the allow-list (or fully with `trust`)."""
    path = Path(weights)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {weights}: file not found")
    data = path.read_bytes()  # read once: what is checked is what loads
    references, unreadable = _references_in(data)
    if unreadable and not trust:
        raise ValueError(f"{flag} {weights}: not a readable PyTorch checkpoint ({unreadable})")
    try:
        allowed = allowed_classes(backends_named(references.named if references else frozenset()))
    except ValueError as e:
        raise ValueError(f"{flag} {weights}: quantized with a library that does not import here: {e}") from None
    ckpt, refusal = (None, unreadable) if unreadable else _load_allowed(data, references, allowed, flag, weights)
    if refusal:
        if not trust:
            raise ValueError(f"{flag} {weights}: holds objects outside the allow-list of YOLO classes ({refusal}); "
                             "if you trust where the file comes from, pass --trust-checkpoint")
        LOGGER.warning(f"WARNING: {flag} {weights}: fully unpickled (--trust-checkpoint): it could run code")
        ckpt = _load_untrusted(data, flag, weights)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("ema") or ckpt.get("model"), nn.Module):
        raise ValueError(f"{flag} {weights}: no YOLO model inside (expected a dict with 'model')")
    return ckpt


def _load_allowed(data: bytes, references: References, allowed: tuple, flag: str, weights: str | Path
                  ) -> tuple[dict | None, str]:
    """The checkpoint loaded through the allow-list, or why it is refused."""
    calls = sorted(references.called & _never_called(allowed))
    if calls:
        return None, f"calls {', '.join(calls)}: a constructor run with the file's own arguments"
    try:
        with torch.serialization.safe_globals(_allowed_globals_in(allowed, references.named)):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), ""
    except pickle.UnpicklingError as e:
        return None, _unsafe_globals(data, allowed) or str(e)
    except Exception as e:  # any other failure: not a PyTorch checkpoint at all
        raise ValueError(f"{flag} {weights}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from None


def _load_untrusted(data: bytes, flag: str, weights: str | Path) -> dict:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False,
                          pickle_module=_former_names_pickle())
    except Exception as e:
        raise ValueError(f"{flag} {weights}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from None


def _unsafe_globals(data: bytes, allowed: tuple) -> str:
    """The globals a refused file names that neither torch nor the allow-list allows (the first five)."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in allowed} | {n for _, n in _former_names(allowed)}
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    names = sorted(g for g in unsafe if g not in names and g != "builtins.getattr")
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _storable(model: nn.Module) -> nn.Module:
    """A CPU FP32 copy with learned amax frozen and no hooks (a training loop's taps belong to that loop)."""
    model = freeze_amax(copy.deepcopy(model).float().cpu().eval())
    for m in model.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    return model


def save_checkpoint(model: nn.Module, path: str | Path, **extra) -> Path:
    """Atomic save (temp file + rename) of a model in FP32: amax and QAT weights keep full precision,
    so evaluating the file reproduces the numbers measured before saving. Other modules in `extra` (an EMA
    copy) are stored the same way. Readable without trust."""
    ckpt = {k: _storable(v) if isinstance(v, nn.Module) else v for k, v in {"model": model, **extra}.items()}
    return atomic_write(path, lambda tmp: torch.save(ckpt, tmp))


def copy_checkpoint(saved: str | Path, path: str | Path) -> Path:
    """Another name for a checkpoint already saved (the delivered model, the best epoch), copied atomically: the
    same bytes, without copying and pickling the model again."""
    return atomic_write(path, lambda tmp: shutil.copyfile(saved, tmp))


def load_float_model(weights: str | Path, device: torch.device | str = "cpu", trust: bool = False,
                     ckpt: dict | None = None) -> nn.Module:
    """A reparameterized (converted) float YOLO checkpoint, fused (Conv+BN, RepConvN) and in eval mode. `ckpt`: the
    file's checkpoint dict where the caller has read it already.

    Training checkpoints with the auxiliary PGI branch are refused: run reparameterization.py first.
    """
    return _float_model(ckpt or read_checkpoint(weights, trust), weights).to(device).eval()


def trained_overlap(ckpt: dict) -> bool | None:
    """How a segmenter's float training made its masks, as upstream's checkpoints record it (`opt`, the training's
    options): True for one mask per image (upstream's default), False for every instance's own (--no-overlap),
    None where the file does not say."""
    opt = ckpt.get("opt")
    no_overlap = opt.get("no_overlap") if isinstance(opt, dict) else None
    return None if no_overlap is None else not no_overlap


def training_record(ckpt: dict) -> dict:
    """What a checkpoint derived from a training one (compacted, converted) keeps of upstream's training options:
    how its masks were trained, which its fine-tune follows; nothing else of them (they hold local paths)."""
    overlap = trained_overlap(ckpt)
    return {} if overlap is None else {"opt": {"no_overlap": not overlap}}


def load_quantized_model(weights: str | Path, device: torch.device | str = "cpu", trust: bool = False) -> nn.Module:
    return _quantized_model(read_checkpoint(weights, trust), weights).to(device).eval()


def _float_model(ckpt: dict, weights: str | Path) -> nn.Module:
    model = (ckpt.get("ema") or ckpt["model"]).float()
    if is_quantized(model):
        raise ValueError(f"--weights {weights}: already quantized; pass the float (converted) weights")
    head = type(model.model[-1]).__name__
    if head.startswith(("Dual", "Triple")):
        raise ValueError(f"--weights {weights}: {head} head found: these are training weights with the auxiliary "
                         "branch; convert them first with reparameterization.py")
    if "Panoptic" in head:
        raise ValueError(f"--weights {weights}: {head} head: panoptic models are not supported (detection and "
                         "instance segmentation are)")
    return model.fuse()


def _quantized_model(ckpt: dict, weights: str | Path) -> nn.Module:
    if not is_quantized(ckpt["model"]):
        raise ValueError(f"--weights {weights}: not a quantized model; quantize it first with `qat.py quantize`")
    return ckpt["model"].float()


def load_for_export(weights: str | Path, device: str | torch.device = "cpu", inplace: bool = False,
                    trust: bool = False, ckpt: dict | None = None) -> nn.Module:
    """Quantized checkpoints as they are; float ones fused. Heads set to (not) modify tensors in place. `ckpt`: the
    file's checkpoint dict where the caller has read it already."""
    ckpt = ckpt or read_checkpoint(weights, trust)
    model = (_quantized_model if is_quantized(ckpt["model"]) else _float_model)(ckpt, weights).to(device).eval()
    for m in model.modules():
        if hasattr(m, "inplace"):
            m.inplace = inplace
    return model
