"""YOLOv9 training weights (main + auxiliary PGI branch, Dual head) -> GELAN inference weights ("converted").

    python reparameterization.py --weights yolov9-c.pt --model c --cfg models/detect/gelan-c.yaml --save yolov9-c-converted.pt

The layer mapping is derived from the two model definitions, not typed per model: starting from the
detection head, each GELAN layer is paired with the training layer that feeds the matching head input,
then their inputs are paired recursively (upstream's Silence placeholder is looked through). Every pair
must have the same module type and parameter shapes, and every GELAN tensor must be filled.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

FILE = Path(__file__).resolve()
ROOT = FILE.parents[0]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from models.quantize import read_checkpoint  # noqa: E402
from models.yolo import Model  # noqa: E402
from utils.general import LOGGER, colorstr  # noqa: E402
from utils.io_utils import atomic_write, cli_main  # noqa: E402

PREFIX = colorstr("reparameterization: ")
MODELS = ("t", "s", "m", "c", "e")
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


def derive_mapping(gelan: nn.Module, train: nn.Module) -> tuple[dict[int, int], dict[str, str]]:
    """Layer map gelan -> training, and the head's sub-module renames (e.g. cv2 -> cv4)."""
    t_head = train.model[-1]
    if not type(t_head).__name__.startswith("Dual"):
        raise MappingError(f"the weights have a {type(t_head).__name__} head, not a Dual one: "
                           "they are already converted (use them directly with qat.py)")
    g_in = _inputs(gelan, len(gelan.model) - 1)
    t_in = _inputs(train, len(train.model) - 1)
    half = len(t_in) // 2
    errors = []
    # The main branch is the second half of the Dual head's inputs (cv4/cv5); the first half is auxiliary.
    for branch, heads in ((t_in[half:], {"cv2": "cv4", "cv3": "cv5", "dfl": "dfl2"}),
                          (t_in[:half], {"cv2": "cv2", "cv3": "cv3", "dfl": "dfl"})):
        mapping: dict[int, int] = {}
        try:
            if len(branch) != len(g_in):
                raise MappingError(f"head inputs: gelan {len(g_in)}, training branch {len(branch)}")
            for a, b in zip(g_in, branch):
                _pair(gelan, train, a, b, mapping)
            return mapping, heads
        except MappingError as e:
            errors.append(str(e))
    raise MappingError(errors[0])


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


def run(cfg, weights, model, device, classes_num, save, exist_ok=False, **_) -> dict:
    save = Path(save)
    if save.exists() and not exist_ok:
        raise FileExistsError(f"--save {save} exists; pass --exist-ok to overwrite it")
    if not Path(cfg).is_file():
        raise FileNotFoundError(f"--cfg {cfg}: file not found")
    ckpt = read_checkpoint(weights)
    train = (ckpt.get("ema") or ckpt["model"]).float().to(device).eval()
    nc = int(train.model[-1].nc)
    if nc != classes_num:
        raise ValueError(f"--classes_num {classes_num} but {weights} was trained with {nc} classes")
    gelan = Model(cfg, ch=3, nc=classes_num).to(device).eval()
    try:
        gelan, summary = convert(train, gelan)
    except MappingError as e:
        raise ValueError(f"{weights} does not convert to {Path(cfg).name} (--model {model}): {e}")
    gelan.names = getattr(train, "names", [str(i) for i in range(nc)])
    gelan.nc = nc
    gelan.hyp = getattr(train, "hyp", None)
    out = {"model": copy.deepcopy(gelan).half(), "optimizer": None, "best_fitness": None, "ema": None,
           "updates": None, "epoch": -1, "converted_from": str(weights)}
    atomic_write(save, lambda tmp: torch.save(out, tmp))
    LOGGER.info(f"{PREFIX}{weights} -> {colorstr('bold', save)}: {summary['layers']} layers, {summary['tensors']} "
                f"tensors, params {summary['params_before']:,} -> {summary['params_after']:,} (saved FP16)")
    return {**summary, "save": str(save), "gelan": gelan}


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", type=str, default=None, help="gelan model yaml (default: models/detect/gelan-<model>.yaml)")
    p.add_argument("--weights", type=str, required=True, help="trained YOLOv9 weights (.pt)")
    p.add_argument("--model", choices=MODELS, required=True, help="which YOLOv9: t, s, m, c or e")
    p.add_argument("--device", default="cpu", help="cpu or cuda:0")
    p.add_argument("--classes_num", "--classes-num", type=int, default=80, help="number of classes")
    p.add_argument("--save", type=str, default="./yolov9-c-converted.pt", help="output path")
    p.add_argument("--exist-ok", action="store_true", help="overwrite --save if it exists")
    opt = p.parse_args(argv)
    expected = f"gelan-{opt.model}"
    opt.cfg = opt.cfg or str(ROOT / "models" / "detect" / f"{expected}.yaml")
    if Path(opt.cfg).stem.startswith("gelan-") and Path(opt.cfg).stem != expected:
        p.error(f"--model {opt.model} goes with models/detect/{expected}.yaml, not --cfg {opt.cfg}")
    return opt


def main(argv=None) -> int:
    return cli_main("reparameterization.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
