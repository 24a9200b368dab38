"""Reading and writing YOLO checkpoints, safely.

A YOLO checkpoint is a pickled model, and unpickling can run arbitrary code. Files are therefore read with an
allow-list of the globals such a checkpoint legitimately holds: torch's tensors and containers, the torch.nn modules,
upstream YOLOv9's modules, this overlay's quantized modules and the quantization backends' modules and calibrators
(Model Optimizer's only where the file names them: importing it takes seconds). The list is derived from those
packages (every nn.Module subclass they define), never a function. The pickle is read first without unpickling, its
stack followed symbolically, and refused where it does what torch's restricted unpickler
(`torch.load(weights_only=True)`) refuses, or calls a class of the list: torch's unpickler would, running the
class's constructor with the file's arguments, and upstream's model constructors evaluate the strings of their
config. A checkpoint creates its modules the way pickle creates any object (NEWOBJ: no constructor runs). What passes
is unpickled by Python's C unpickler restricted to the list, about 4x faster than torch's (Python). `trust=True`
(`--trust-checkpoint`) falls back to full unpickling for files from a source the user trusts, with a warning.

Upstream stores methods on modules (`m.forward = m.forward_fuse` when fusing, `self.detect = DDetect.forward`
in segmentation heads), which pickle as calls of `getattr`. Only a restricted getattr is allowed: it returns
`forward*` methods of allowed classes and nothing else (a plain getattr would reach any attribute, and from
there any function).
"""
from __future__ import annotations

import copy
import importlib
import io
import os
import pickle
import pickletools
import shutil
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import OrderedDict
from contextlib import ExitStack, contextmanager
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Iterator, NamedTuple

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


def _numpy_multiarray() -> ModuleType:
    import numpy as np
    return (getattr(np, "_core", None) or np.core).multiarray


def _numpy_values() -> list:
    """What upstream's checkpoints pickle for `best_fitness` (a numpy float64, or a 1-element array in those saved
    during training): data only; anything an array holds still passes the allow-list."""
    import numpy as np
    return [_numpy_multiarray().scalar, _numpy_multiarray()._reconstruct, np.ndarray, np.dtype,
            *(getattr(np.dtypes, n) for n in ("Float64DType", "Float32DType")
                                                if hasattr(np, "dtypes") and hasattr(np.dtypes, n))]


def _numpy_reconstruct() -> str:
    """The name of numpy's array constructor, as pickles name it: a function whose result a file sets state on."""
    return f"{_numpy_multiarray().__name__}._reconstruct"


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


def _pickle_module(unpickler: type[pickle.Unpickler]) -> ModuleType:
    """`pickle` with `unpickler`, in the form torch.load's pickle_module takes."""
    module = ModuleType(f"{unpickler.__name__}_pickle")
    module.Unpickler, module.load = unpickler, pickle.load
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
    """What a checkpoint's pickle names (every global, as `module.name`), which of those it calls (REDUCE), and which
    of those calls make an object it then fills: state set (BUILD) or items set (SETITEM)."""
    named: frozenset[str]
    called: frozenset[str]
    built: frozenset[str]
    filled: frozenset[str]


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


# The opcodes torch's restricted unpickler executes (torch.save writes protocol 2 with no others), each with its stack
# effect; a file with any other (INST and OBJ call classes, STACK_GLOBAL and EXT* find globals unchecked here, ...)
# is refused.
_EFFECTS = {op.name: _stack_effect(op) for op in pickletools.opcodes if op.name in {
    "PROTO", "STOP", "MARK", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "NONE",
    "NEWFALSE", "NEWTRUE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING",
    "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"}}
_TARGETED = frozenset({"REDUCE", "NEWOBJ", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS"})


class _Made(NamedTuple):
    """A stack entry the scan follows: a global (`how` "global"), an object a global made (`how` "new": NEWOBJ,
    "call": REDUCE), or an empty list or dict (`how` "list", "dict"); every other entry is None."""
    how: str
    name: str = ""


_LIST, _DICT = _Made("list"), _Made("dict")


def _pickle_references(pickled: bytes) -> References:
    """The globals a pickle names and calls, read without unpickling: its stack followed symbolically. Besides the
    opcodes outside torch's set, refused as torch's unpickler refuses them: a call (REDUCE) or creation (NEWOBJ) of
    anything but a global, state set (BUILD) on anything but an object the pickle made (a global's own attributes
    would change), appends to anything but a list, items set on anything but a dict or an object a global made."""
    stack: list = []
    memo, named, called, built, filled = {}, set(), set(), set(), set()
    mark = pickletools.markobject

    def refuse(what: str):
        raise pickle.UnpicklingError(f"{what} is not allowed in a YOLO checkpoint")

    for op, arg, _ in pickletools.genops(pickled):
        name = op.name
        if name in ("BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "GLOBAL":
            stack.append(_Made("global", _global_name(arg)))
            named.add(stack[-1].name)
        elif name == "MARK":
            stack.append(mark)
        elif name not in _EFFECTS:
            refuse(f"opcode {name}")
        else:
            marked, taken, left = _EFFECTS[name]
            if marked:  # what lies above the last mark, and the mark
                while stack.pop() is not mark:
                    pass
            if name not in _TARGETED:
                if taken:
                    del stack[-taken:]
                if left:
                    stack.append(_LIST if name == "EMPTY_LIST" else _DICT if name == "EMPTY_DICT" else None)
                continue
            target = stack[-taken]
            del stack[len(stack) - taken + 1:]  # the target stays, as the object made or the one changed
            how = target.how if target else None
            if name in ("REDUCE", "NEWOBJ"):
                if how != "global":
                    refuse(f"{name} of an object that is no global")
                stack[-1] = _Made("call" if name == "REDUCE" else "new", target.name)
                if name == "REDUCE":
                    called.add(target.name)
            elif name == "BUILD":
                if how not in ("new", "call"):
                    refuse("BUILD on an object the file did not make")
                if how == "call":
                    built.add(target.name)
            elif name in ("APPEND", "APPENDS"):
                if how != "list":
                    refuse(f"{name} to an object that is no list")
            elif how not in ("dict", "call"):
                refuse(f"{name} on an object that is no dict")
            elif how == "call":
                filled.add(target.name)
    return References(frozenset(named), frozenset(called), frozenset(built), frozenset(filled))


def _checkpoint_pickle(data: bytes) -> bytes | None:
    """The pickle of a `torch.save` archive, read as torch.load reads it; None for anything else."""
    with io.BytesIO(data) as f:
        if not torch.serialization._is_zipfile(f):
            return None
        with torch.serialization._open_zipfile_reader(f) as archive:
            return archive.get_record("data.pkl") if archive.has_record("data.pkl") else None


# Of the globals torch's restricted unpickler allows, those a YOLO checkpoint holds (tensors, parameters, their
# storages and dtypes, ordered dicts, sizes, sets, bytes): the others rebuild sparse, nested, quantized or subclassed
# tensors, which call what the file passes them or need checks of their own.
_TORCH_GLOBALS = ("collections.OrderedDict", "torch.nn.parameter.Parameter", "torch.Size", "torch.device",
                  "_codecs.encode", "builtins.set", "torch._utils._rebuild_tensor_v2",
                  "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state")
_DICT_TYPES = ("collections.OrderedDict",)  # a file may make these (REDUCE) and set their items


@lru_cache(maxsize=None)
def _torch_globals() -> dict[str, object]:
    """Those globals, as torch's restricted unpickler finds them by name (the same objects)."""
    from torch._weights_only_unpickler import _get_allowed_globals
    return {name: g for name, g in _get_allowed_globals().items() if name in _TORCH_GLOBALS or
            isinstance(g, (torch.dtype, torch.serialization.StorageType)) or g in torch._storage_classes}


def _never_called(allowed: tuple) -> set[str]:
    """The names (and former names) of the allow-list's module and calibrator classes: a checkpoint creates them
    (NEWOBJ) and never calls them, which would run their constructors with its own arguments."""
    numpy_values = set(_numpy_values())
    classes = tuple(c for c in allowed if c not in numpy_values)
    return {f"{c.__module__}.{c.__qualname__}" for c in classes} | {name for _, name in _former_names(classes)}


def _allowed_globals(allowed: tuple) -> dict[str, object]:
    """Every global a checkpoint may name, by the name it gives: torch's tensors and containers, the allow-list's
    classes (and their former names), and getattr restricted to `forward*` methods."""
    return {**_torch_globals(), **{f"{c.__module__}.{c.__qualname__}": c for c in allowed},
            **{name: c for c, name in _former_names(allowed)}, "builtins.getattr": _forward_getattr(allowed)}


def _refusal(references: References, allowed: tuple, globals_: dict[str, object]) -> str:
    """Why the allow-list refuses a file it has scanned, or "" where it loads."""
    unknown = sorted(references.named - globals_.keys())
    if unknown:
        return ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
    calls = sorted(references.called & _never_called(allowed))
    if calls:
        return f"calls {', '.join(calls)}: a constructor run with the file's own arguments"
    makers = {n for n, g in globals_.items() if isinstance(g, type)} | {_numpy_reconstruct()}
    not_made = sorted(references.built - makers)
    not_dicts = sorted(references.filled - set(_DICT_TYPES))
    if not_made or not_dicts:
        return f"sets state or items on what {', '.join(not_made + not_dicts)} returns"
    return ""


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


def _allow_list_pickle(globals_: dict[str, object]) -> ModuleType:
    """`pickle` with Python's C unpickler finding only `globals_`, in the form torch.load's pickle_module takes.
    It runs what the scan has followed (`_pickle_references`: the opcodes and targets torch's restricted unpickler
    allows), about 4x faster than that unpickler, which is Python."""
    class AllowListUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            found = globals_.get(_global_name(f"{module} {name}"))
            if found is None:
                raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a YOLO checkpoint")
            return found

    return _pickle_module(AllowListUnpickler)


def _weights_only_forced() -> bool:
    """Whether TORCH_FORCE_WEIGHTS_ONLY_LOAD makes every torch.load use torch's restricted unpickler (the values
    torch.serialization reads as true)."""
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


def _load_allowed(data: bytes, references: References, allowed: tuple, flag: str, weights: str | Path
                  ) -> tuple[dict | None, str]:
    """The checkpoint loaded through the allow-list, or why it is refused."""
    globals_ = _allowed_globals(allowed)
    refusal = _refusal(references, allowed, globals_)
    if refusal:
        return None, refusal
    try:
        if _weights_only_forced():  # torch then refuses any pickle module: its own unpickler, with the same globals
            # (those the file names, and numpy's whole: a dtype it names unpickles as a subclass, checked too)
            named = [(globals_[name], name) for name in references.named]
            with torch.serialization.safe_globals(named + _numpy_values()):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), ""
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False,
                          pickle_module=_allow_list_pickle(globals_)), ""
    except pickle.UnpicklingError as e:
        return None, str(e)
    except Exception as e:  # any other failure: not a PyTorch checkpoint at all
        raise ValueError(f"{flag} {weights}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from None


def _load_untrusted(data: bytes, flag: str, weights: str | Path) -> dict:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False,
                          pickle_module=_pickle_module(_FormerNamesUnpickler))
    except Exception as e:
        raise ValueError(f"{flag} {weights}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from None


@contextmanager
def _storable(model: nn.Module) -> Iterator[nn.Module]:
    """What a checkpoint holds of `model`, for the time of a save: eval mode, no hooks (a training loop's taps belong
    to that loop), FP32 on the CPU, learned amax frozen. A model already FP32 on the CPU without a learned amax (an
    EMA copy, an evaluated model, a student fine-tuned on a CPU) is pickled itself, its modes and hooks set aside and
    put back after; any other as a copy made so. A copy per save was a third of a CPU QAT epoch's checkpointing."""
    if not _in_fp32_on_the_cpu(model):
        copied = freeze_amax(copy.deepcopy(model).float().cpu().eval())
        for m in copied.modules():
            m._forward_hooks.clear()
            m._forward_pre_hooks.clear()
        yield copied
        return
    modules = list(model.modules())
    kept = [(m.training, m._forward_hooks, m._forward_pre_hooks) for m in modules]
    try:
        for m in modules:
            m.training, m._forward_hooks, m._forward_pre_hooks = False, OrderedDict(), OrderedDict()
        yield model
    finally:
        for m, (training, hooks, pre_hooks) in zip(modules, kept):
            m.training, m._forward_hooks, m._forward_pre_hooks = training, hooks, pre_hooks


def _in_fp32_on_the_cpu(model: nn.Module) -> bool:
    """Whether `model`'s floating tensors are FP32 on the CPU and no amax is a parameter: what `_storable` stores
    without a copy."""
    tensors = [*model.parameters(), *model.buffers()]
    return (all(t.device.type == "cpu" and (t.dtype == torch.float32 or not t.is_floating_point()) for t in tensors)
            and not any(isinstance(getattr(m, "_amax", None), nn.Parameter) for m in model.modules()))


def save_checkpoint(model: nn.Module, path: str | Path, **extra) -> Path:
    """Atomic save (temp file + rename) of a model in FP32: amax and QAT weights keep full precision,
    so evaluating the file reproduces the numbers measured before saving. Other modules in `extra` (an EMA
    copy) are stored the same way. Readable without trust."""
    with ExitStack() as stack:
        ckpt = {k: stack.enter_context(_storable(v)) if isinstance(v, nn.Module) else v
                for k, v in {"model": model, **extra}.items()}
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
    return fuse(model)


def fuse(model: nn.Module) -> nn.Module:
    """The model with each Conv's BatchNorm folded into it and each RepConvN's two branches merged, in place, as
    upstream's BaseModel.fuse() makes it (its functions, its forward_fuse), without the summary that fuse() prints
    after: a deep copy of the model profiled by thop, most of the time a small model's load takes."""
    from models.common import Conv, DWConv, RepConvN
    from utils.torch_utils import fuse_conv_and_bn
    for m in model.model.modules():
        if isinstance(m, RepConvN) and hasattr(m, "fuse_convs"):
            m.fuse_convs()
            m.forward = m.forward_fuse
        if isinstance(m, (Conv, DWConv)) and hasattr(m, "bn"):
            m.conv = fuse_conv_and_bn(m.conv, m.bn)
            delattr(m, "bn")
            m.forward = m.forward_fuse
    return model


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
