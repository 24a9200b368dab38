#!/usr/bin/env python3
"""Where a training image's CPU time goes in upstream's augmenting loader, the one `qat.py quantize` fine-tunes on:
per phase (decode, resize, mosaic, affine warp, colour, ...) in one process, and what that means for a GPU step.

    python scripts/profile_loader.py --data D.yaml --imgsz 640 --images 400 [--hyp data/hyps/hyp.scratch-high.yaml]

Run from the patched YOLOv9 checkout. The images are drawn as training draws them (shuffled, mosaic and mixup as
the hyp file says), under cProfile, whose cumulative time per upstream function splits the total into phases (the
profiler's own overhead is in the "other" phase), then the same draws again timed plainly (ms per image of one core:
a loader worker's). Writes --out (JSON) and prints a table: ms per image per phase, the cores a GPU step of a given
images/s needs for its loader alone, and the RAM that keeping the decoded images would take (`--cache ram`), which
removes the decode and resize phases.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from utils.io_utils import write_json  # noqa: E402
from utils.provenance import command_line, machine, toolkit_commit  # noqa: E402

# phase -> the function it is: upstream's (in its utils/ modules; upstream's imread wraps cv2.imdecode) or a C
# function of OpenCV's, by name
PHASES = {
    "decode (imread)": "imread",
    "resize to --imgsz (cv2.resize)": "resize",
    "affine warp (random_perspective)": "random_perspective",
    "colour (augment_hsv)": "augment_hsv",
    "albumentations (where installed)": "Albumentations.__call__",
    "mixup": "mixup",
}


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset.yaml: its training images")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--images", type=int, default=400, help="images drawn per measurement")
    p.add_argument("--batch-size", type=int, default=32, help="images per collated batch")
    p.add_argument("--hyp", default="data/hyps/hyp.scratch-high.yaml")
    p.add_argument("--task", choices=("detect", "segment"), default="detect",
                   help="segment: the loader of a segmentation model (instance masks too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-images-per-s", type=float, nargs="+", default=[200.0, 400.0, 600.0],
                   help="GPU steps' images/s to size the loader for")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def _matches(key: tuple, name: str) -> bool:
    """Whether a profile entry is `name` (its last dotted part): a C function of that name, or upstream's function
    in its utils/ modules."""
    file, _, func = key
    name = name.split(".")[-1]
    if file == "~":
        return func.strip("<>").split(" ")[-1].split(".")[-1] == name
    return func == name and "utils" in Path(file).parent.parts


def _cumulative(stats: pstats.Stats, name: str, caller: str | None = None) -> float:
    """Seconds spent in `name`, its callees included; with `caller`, only in the calls made by that function."""
    total = 0.0
    for key, (_, _, _, cumulative, callers) in stats.stats.items():
        if _matches(key, name):
            total += cumulative if caller is None else sum(c[3] for k, c in callers.items() if _matches(k, caller))
    return total


def draw(dataset, indices: list[int], batch_size: int) -> None:
    """What a loader worker does: each image, then each batch collated."""
    items = [dataset[i] for i in indices]
    for start in range(0, len(items), batch_size):
        dataset.collate_fn(items[start:start + batch_size])


def profile(dataset, indices: list[int], batch_size: int, seed: int) -> dict:
    """ms per image, plain and per phase, and the RAM per decoded image."""
    random.seed(seed)
    profiler = cProfile.Profile()
    profiler.enable()
    draw(dataset, indices, batch_size)
    profiler.disable()
    random.seed(seed)  # the same draws again, timed plainly: the files are in the OS's cache now, as from a
    t0 = time.perf_counter()  # training's second epoch on
    draw(dataset, indices, batch_size)
    plain_s = time.perf_counter() - t0
    stats = pstats.Stats(profiler)
    total = _cumulative(stats, "__getitem__") + _cumulative(stats, "collate_fn")
    per_image = 1000 / len(indices)
    phases = {phase: _cumulative(stats, name) for phase, name in PHASES.items()}
    inside = sum(_cumulative(stats, name, "load_mosaic") for name in ("load_image", "random_perspective"))
    phases["mosaic: tiles placed on one canvas"] = max(_cumulative(stats, "load_mosaic") - inside, 0.0)
    phases["collate"] = _cumulative(stats, "collate_fn")
    phases["other (labels, flips, to tensor, profiler)"] = max(total - sum(phases.values()), 0.0)
    decoded = [dataset.load_image(i)[0].nbytes for i in indices[:50]]
    return {"ms_per_image": round(plain_s * per_image, 2),
            "profiled_ms_per_image": round(total * per_image, 2),
            "phases_ms_per_image": {k: round(v * per_image, 2) for k, v in phases.items()},
            "decoded_bytes_per_image": int(sum(decoded) / len(decoded))}


def table(result: dict) -> str:
    p = result["profile"]
    rows = [f"| {k} | {v:.2f} | {100 * v / p['profiled_ms_per_image']:.0f} % |"
            for k, v in sorted(p["phases_ms_per_image"].items(), key=lambda kv: -kv[1])]
    cores = ", ".join(f"{k} img/s: {v}" for k, v in result["cores_for_loader"].items())
    return "\n".join([f"| phase ({result['imgsz']} px, {result['images']} images, one core) | ms per image | share |",
                      "|---|---|---|", *rows,
                      f"| **total** (unprofiled: {p['ms_per_image']:.2f}) | {p['profiled_ms_per_image']:.2f} | |",
                      "", f"cores for the loader alone: {cores}; `--cache ram` would hold "
                          f"{result['cache_ram_gb']} GB for {result['train_images']} images"])


def main(argv=None) -> int:
    opt = parse_opt(argv)
    if opt.images < 1:
        print("profile_loader: error: --images must be >= 1", file=sys.stderr)
        return 2
    from models.core.task import TASKS
    from utils.batches import load_data, load_hyp
    data, hyp = load_data(opt.data), load_hyp(opt.hyp)
    _, dataset = TASKS[opt.task].dataloader(data["train"], opt.imgsz, opt.batch_size, 32, hyp=hyp, augment=True,
                                            workers=0, shuffle=True)
    rng = random.Random(opt.seed)
    indices = [rng.randrange(len(dataset)) for _ in range(opt.images)]
    p = profile(dataset, indices, opt.batch_size, opt.seed)
    result = {"what": "upstream's augmenting loader, one process: ms per image per phase", "data": opt.data,
              "imgsz": opt.imgsz, "images": opt.images, "hyp": opt.hyp, "train_images": len(dataset), "profile": p,
              "cores_for_loader": {f"{r:g}": round(r * p["ms_per_image"] / 1000, 1) for r in opt.step_images_per_s},
              "cache_ram_gb": round(p["decoded_bytes_per_image"] * len(dataset) / 1e9, 2),
              "commit": toolkit_commit(), "command": command_line(), "machine": machine()}
    result["table"] = table(result)
    write_json(opt.out, result)
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
