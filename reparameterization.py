"""YOLOv9 training weights (main + auxiliary PGI branch, Dual head) -> GELAN inference weights ("converted").

    python reparameterization.py --weights yolov9-c.pt --model c --cfg models/detect/gelan-c.yaml --save yolov9-c-converted.pt
    python reparameterization.py --weights yolov9-c-seg.pt --model c-seg --save yolov9-c-seg-converted.pt

Segmentation: yolov9-c-seg (trained from models/segment/yolov9-c-dseg.yaml, DualDSegment head) converts to a
DSegment GELAN model derived from the training model's main branch: upstream's gelan-c-dseg.yaml has a shallower
prototype ELAN, and gelan-c-seg.yaml a different head (Segment with a Proto module), so neither matches.

The layer mapping is derived from the two model definitions, not typed per model: starting from the
detection head, each GELAN layer is paired with the training layer that feeds the matching head input,
then their inputs are paired recursively (upstream's Silence placeholder is looked through). Every pair
must have the same module type and parameter shapes, and every GELAN tensor must be filled.
"""
from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path

FILE = Path(__file__).resolve()
ROOT = FILE.parents[0]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from models.quantization.checkpoint import read_checkpoint, training_record  # noqa: E402
from models.yolo import Model, SegmentationModel  # noqa: E402
from utils.general import LOGGER, colorstr  # noqa: E402
from utils.io_utils import atomic_write, cli_main  # noqa: E402

PREFIX = colorstr("reparameterization: ")
MODELS = ("t", "s", "m", "c", "e", "c-seg")
# Upstream has no GELAN yaml equal to yolov9-c-seg's main branch (its prototype ELAN is deeper than
# gelan-c-dseg.yaml's), so that one is derived from the training model's own definition.
DERIVED_CFG = ("c-seg",)
INPUT = None  # the image, as a layer index


def _inputs(model: nn.Module, i: int) -> list:
    """Absolute indices of the layers feeding layer i (INPUT for the image)."""
    f = model.model[i].f
    return [INPUT if (j == -1 and i == 0) else (i + j if j < 0 else j) for j in ([f] if isinstance(f, int) else f)]


def _through_silence(model: nn.Module, i):
    while i is not INPUT and type(model.model[i]).__name__ == "Silence":
        i = _inputs(model, i)[0]
    return i


def _shapes(module: nn.Module) -> list:
    return [(k, tuple(v.shape)) for k, v in module.state_dict().items()]


class MappingError(ValueError):
    pass


def _pair(gelan, train, gi, tj, mapping: dict) -> None:
    gi, tj = _through_silence(gelan, gi), _through_silence(train, tj)
    if gi is INPUT or tj is INPUT:
        if gi is not tj:
            raise MappingError(f"gelan layer {gi} and training layer {tj}: one reads the image, the other does not")
        return
    if gi in mapping:
        if mapping[gi] != tj:
            raise MappingError(f"gelan layer {gi} would map to training layers {mapping[gi]} and {tj}")
        return
    g, t = gelan.model[gi], train.model[tj]
    if type(g).__name__ != type(t).__name__:
        raise MappingError(f"gelan layer {gi} is {type(g).__name__}, training layer {tj} is {type(t).__name__}")
    if _shapes(g) != _shapes(t):
        diff = next(((a, b) for a, b in zip(_shapes(g), _shapes(t)) if a != b), (len(_shapes(g)), len(_shapes(t))))
        raise MappingError(f"gelan layer {gi} ({type(g).__name__}) and training layer {tj} differ in shape: "
                           f"{diff[0]} vs {diff[1]}")
    mapping[gi] = tj
    g_in, t_in = _inputs(gelan, gi), _inputs(train, tj)
    if len(g_in) != len(t_in):
        raise MappingError(f"gelan layer {gi} has {len(g_in)} inputs, training layer {tj} has {len(t_in)}")
    for a, b in zip(g_in, t_in):
        _pair(gelan, train, a, b, mapping)


@dataclass(frozen=True)
class DualHead:
    """How a training (Dual) head splits into the GELAN head: which inputs and sub-modules are the main branch."""

    single: str                        # the GELAN head class
    n_proto: int                       # trailing inputs feeding mask prototypes (aux first, then main)
    main: dict[str, str] = field(default_factory=dict)   # GELAN sub-module -> training sub-module
    aux: dict[str, str] = field(default_factory=dict)

    def branches(self, inputs: list) -> tuple[list, list]:
        """(main, aux) head inputs: detection levels, then this branch's prototype input."""
        det, proto = inputs[:len(inputs) - self.n_proto], inputs[len(inputs) - self.n_proto:]
        nl, half = len(det) // 2, self.n_proto // 2
        return det[nl:] + proto[half:], det[:nl] + proto[:half]


# The main branch is the second half of a Dual head's inputs and its second set of sub-modules.
DUAL_HEADS = {
    "DualDDetect": DualHead("DDetect", 0, main={"cv2": "cv4", "cv3": "cv5", "dfl": "dfl2"},
                            aux={"cv2": "cv2", "cv3": "cv3", "dfl": "dfl"}),
    "DualDSegment": DualHead("DSegment", 2,
                             main={"cv2": "cv4", "cv3": "cv5", "dfl": "dfl2", "cv4": "cv7", "proto": "proto2"},
                             aux={"cv2": "cv2", "cv3": "cv3", "dfl": "dfl", "cv4": "cv6", "proto": "proto"}),
}


def derive_mapping(gelan: nn.Module, train: nn.Module) -> tuple[dict[int, int], dict[str, str]]:
    """Layer map gelan -> training, and the head's sub-module renames (e.g. cv2 -> cv4)."""
    t_kind, g_kind = type(train.model[-1]).__name__, type(gelan.model[-1]).__name__
    if not t_kind.startswith("Dual"):
        raise MappingError(f"the weights have a {t_kind} head, not a Dual one: "
                           "they are already converted (use them directly with qat.py)")
    if t_kind not in DUAL_HEADS:
        raise MappingError(f"{t_kind} heads are not supported (supported: {', '.join(DUAL_HEADS)})")
    head = DUAL_HEADS[t_kind]
    if g_kind != head.single:
        raise MappingError(f"a {t_kind} training head converts to a {head.single} head, but the --cfg model has a "
                           f"{g_kind} head (leave --cfg out to derive the GELAN model from the weights)")
    g_in = _inputs(gelan, len(gelan.model) - 1)
    main, aux = head.branches(_inputs(train, len(train.model) - 1))
    errors = []
    for branch, renames in ((main, head.main), (aux, head.aux)):
        mapping: dict[int, int] = {}
        try:
            if len(branch) != len(g_in):
                raise MappingError(f"head inputs: gelan {len(g_in)}, training branch {len(branch)}")
            for a, b in zip(g_in, branch):
                _pair(gelan, train, a, b, mapping)
            return mapping, renames
        except MappingError as e:
            errors.append(str(e))
    raise MappingError(errors[0])


def derived_gelan_yaml(train: nn.Module) -> dict:
    """The GELAN model definition of a training model: the layers its main head branch reads, in order,
    with the single-branch head. Module arguments are copied, so the layers are built identically."""
    t_kind = type(train.model[-1]).__name__
    if t_kind not in DUAL_HEADS or not isinstance(getattr(train, "yaml", None), dict):
        raise MappingError(f"cannot derive a GELAN model from a {t_kind} model without its yaml definition")
    head = DUAL_HEADS[t_kind]
    main, _ = head.branches(_inputs(train, len(train.model) - 1))
    keep, todo = set(), [_through_silence(train, i) for i in main]
    while todo:
        i = todo.pop()
        if i is not INPUT and i not in keep:
            keep.add(i)
            todo += [_through_silence(train, j) for j in _inputs(train, i)]
    order = sorted(keep)
    new_index = {old: k for k, old in enumerate(order)}
    layers = train.yaml["backbone"] + train.yaml["head"]

    def source(k: int, old) -> int:
        if old is INPUT:
            if k:
                raise MappingError(f"training layer {order[k]} reads the image but is not the first layer")
            return -1
        return -1 if new_index[old] == k - 1 else new_index[old]

    body = []
    for k, old in enumerate(order):
        _, n, module, args = layers[old]
        sources = [source(k, _through_silence(train, j)) for j in _inputs(train, old)]
        body.append([sources[0] if len(sources) == 1 else sources, n, module, args])
    head_args = layers[len(train.model) - 1][3]
    definition = {k: v for k, v in train.yaml.items() if k not in ("backbone", "head", "ch")}
    head_inputs = [new_index[_through_silence(train, i)] for i in main]
    return {**definition, "backbone": body, "head": [[head_inputs, 1, head.single, head_args]]}


def convert(train: nn.Module, gelan: nn.Module) -> tuple[nn.Module, dict]:
    """Fill `gelan` from `train`. Returns the model and a summary of the mapping."""
    mapping, heads = derive_mapping(gelan, train)
    t_state = train.state_dict()
    g_state = gelan.state_dict()
    head_i, head_j = len(gelan.model) - 1, len(train.model) - 1
    new_state, missing = {}, []
    for key, value in g_state.items():
        layer = int(key.split(".")[1])
        rest = key.split(".", 2)[2]
        if layer == head_i:
            sub, tail = rest.split(".", 1)
            src = f"model.{head_j}.{heads.get(sub, sub)}.{tail}"
        elif layer in mapping:
            src = f"model.{mapping[layer]}.{rest}"
        else:
            missing.append(key)
            continue
        if src not in t_state or t_state[src].shape != value.shape:
            got = None if src not in t_state else tuple(t_state[src].shape)
            raise MappingError(f"{key} {tuple(value.shape)} has no match ({src}: {got})")
        new_state[key] = t_state[src]
    if missing:
        raise MappingError(f"gelan tensors left unfilled: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    gelan.load_state_dict(new_state, strict=True)
    summary = {"layers": len(mapping) + 1, "tensors": len(new_state), "head": heads,
               "params_before": sum(p.numel() for p in train.parameters()),
               "params_after": sum(p.numel() for p in gelan.parameters())}
    return gelan, summary


def run(cfg, weights, model, device, classes_num, save, exist_ok=False, trust_checkpoint=False) -> dict:
    save = Path(save)
    if save.exists() and not exist_ok:
        raise FileExistsError(f"--save {save} exists; pass --exist-ok to overwrite it")
    if cfg is not None and not Path(cfg).is_file():
        raise FileNotFoundError(f"--cfg {cfg}: file not found")
    ckpt = read_checkpoint(weights, trust_checkpoint)
    train = (ckpt.get("ema") or ckpt["model"]).float().to(device).eval()
    nc = int(train.model[-1].nc)
    if nc != classes_num:
        raise ValueError(f"--classes_num {classes_num} but {weights} was trained with {nc} classes")
    model_class = SegmentationModel if "Segment" in type(train.model[-1]).__name__ else Model
    target = Path(cfg).name if cfg else "the GELAN model derived from its main branch"
    try:
        gelan = model_class(cfg or derived_gelan_yaml(train), ch=3, nc=classes_num).to(device).eval()
        gelan, summary = convert(train, gelan)
    except MappingError as e:
        raise ValueError(f"{weights} does not convert to {target} (--model {model}): {e}")
    gelan.names = getattr(train, "names", [str(i) for i in range(nc)])
    gelan.nc = nc
    gelan.hyp = getattr(train, "hyp", None)
    out = {"model": copy.deepcopy(gelan).half(), "optimizer": None, "best_fitness": None, "ema": None,
           "updates": None, "epoch": -1, "converted_from": str(weights), **training_record(ckpt)}
    atomic_write(save, lambda tmp: torch.save(out, tmp))
    LOGGER.info(f"{PREFIX}{weights} -> {colorstr('bold', save)}: {summary['layers']} layers, {summary['tensors']} "
                f"tensors, params {summary['params_before']:,} -> {summary['params_after']:,} (saved FP16)")
    return {**summary, "save": str(save), "gelan": gelan}


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", type=str, default=None,
                   help="gelan model yaml (default: models/detect/gelan-<model>.yaml; c-seg: derived from the weights)")
    p.add_argument("--weights", type=str, required=True, help="trained YOLOv9 weights (.pt)")
    p.add_argument("--model", choices=MODELS, required=True, help="which YOLOv9: t, s, m, c, e or c-seg")
    p.add_argument("--device", default="cpu", help="cpu or cuda:0")
    p.add_argument("--classes_num", "--classes-num", type=int, default=80, help="number of classes")
    p.add_argument("--save", type=str, default=None, help="output path (default: ./yolov9-<model>-converted.pt)")
    p.add_argument("--exist-ok", action="store_true", help="overwrite --save if it exists")
    p.add_argument("--trust-checkpoint", action="store_true", help="unpickle --weights fully (can run code)")
    opt = p.parse_args(argv)
    opt.save = opt.save or f"./yolov9-{opt.model}-converted.pt"
    if opt.model in DERIVED_CFG:
        return opt
    expected = f"gelan-{opt.model}"
    opt.cfg = opt.cfg or str(ROOT / "models" / "detect" / f"{expected}.yaml")
    if Path(opt.cfg).stem.startswith("gelan-") and Path(opt.cfg).stem != expected:
        p.error(f"--model {opt.model} goes with models/detect/{expected}.yaml, not --cfg {opt.cfg}")
    return opt


def main(argv=None) -> int:
    return cli_main("reparameterization.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
