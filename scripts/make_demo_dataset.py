#!/usr/bin/env python3
"""Write a small YOLO-format detection dataset offline, deterministic by seed.

12 classes (6 shapes, 6 digits) of varied size, colour and rotation, partly overlapping, on cluttered
backgrounds (gradients, noise, lines, scribbles). Layout:
    OUT/images/{train,val}/*.jpg   OUT/labels/{train,val}/*.txt   OUT/data.yaml

    python scripts/make_demo_dataset.py --out datasets/demo --train 400 --val 100 --imgsz 320

The seed fixes the random draws, but the pixels come from OpenCV's rasterizer, and a one-pixel change in an
object's mask changes its box and, through the overlap test, every later draw: other numpy/OpenCV builds
produce another copy of the dataset. data.yaml records each split's label fingerprint to tell copies apart.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np
import yaml

SHAPES = ("circle", "square", "triangle", "star", "cross", "hexagon")
DIGITS = ("2", "3", "4", "5", "7", "8")
NAMES = list(SHAPES) + [f"digit_{d}" for d in DIGITS]


def _polygon(n: int, r: float, c: float, phase: float = 0.0, inner: float | None = None) -> np.ndarray:
    pts = []
    steps = n * (2 if inner else 1)
    for k in range(steps):
        rad = (inner if inner and k % 2 else 1.0) * r
        a = phase + 2 * math.pi * k / steps
        pts.append((c + rad * math.cos(a), c + rad * math.sin(a)))
    return np.round(np.array(pts)).astype(np.int32)


def _draw_mask(cls: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Binary mask of one object, centred in a (2*size, 2*size) canvas, unrotated."""
    canvas = np.zeros((2 * size, 2 * size), np.uint8)
    c, r = size, size / 2
    name = NAMES[cls]
    if name == "circle":
        cv2.circle(canvas, (c, c), int(r), 255, -1)
    elif name == "square":
        cv2.rectangle(canvas, (int(c - r), int(c - r)), (int(c + r), int(c + r)), 255, -1)
    elif name == "triangle":
        cv2.fillPoly(canvas, [_polygon(3, r, c, -math.pi / 2)], 255)
    elif name == "star":
        cv2.fillPoly(canvas, [_polygon(5, r, c, -math.pi / 2, inner=0.45)], 255)
    elif name == "cross":
        t = int(r * 0.35)
        cv2.rectangle(canvas, (int(c - r), c - t), (int(c + r), c + t), 255, -1)
        cv2.rectangle(canvas, (c - t, int(c - r)), (c + t, int(c + r)), 255, -1)
    elif name == "hexagon":
        cv2.fillPoly(canvas, [_polygon(6, r, c)], 255)
    else:  # digit
        text = name.split("_")[1]
        thickness = max(2, size // 8)
        scale = cv2.getFontScaleFromHeight(cv2.FONT_HERSHEY_SIMPLEX, size, thickness)
        (w, h), _ = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, thickness)
        cv2.putText(canvas, text, (c - w // 2, c + h // 2), cv2.FONT_HERSHEY_SIMPLEX, scale, 255, thickness,
                    cv2.LINE_AA)
    return canvas


def _background(imgsz: int, rng: np.random.Generator) -> np.ndarray:
    yy, xx = np.mgrid[0:imgsz, 0:imgsz].astype(np.float32) / imgsz
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    a = rng.uniform(0, 2 * math.pi)
    t = (np.cos(a) * xx + np.sin(a) * yy)
    t = (t - t.min()) / (np.ptp(t) + 1e-6)
    img = (c0 * (1 - t[..., None]) + c1 * t[..., None])
    img += rng.normal(0, rng.uniform(4, 18), img.shape)
    img = np.clip(img, 0, 255).astype(np.uint8)
    for _ in range(rng.integers(4, 14)):  # straight clutter lines
        p1, p2 = rng.integers(0, imgsz, 2), rng.integers(0, imgsz, 2)
        cv2.line(img, tuple(map(int, p1)), tuple(map(int, p2)), tuple(map(int, rng.integers(0, 256, 3))),
                 int(rng.integers(1, 3)), cv2.LINE_AA)
    for _ in range(rng.integers(2, 6)):  # scribbles
        pts = np.cumsum(rng.normal(0, imgsz / 25, (8, 2)), 0) + rng.integers(0, imgsz, 2)
        cv2.polylines(img, [pts.astype(np.int32)], False, tuple(map(int, rng.integers(0, 256, 3))), 1,
                      cv2.LINE_AA)
    return img


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0, x2 - x1) * max(0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def make_image(imgsz: int, rng: np.random.Generator, max_objects: int = 6):
    img = _background(imgsz, rng)
    boxes, labels = [], []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        cls = int(rng.integers(len(NAMES)))
        size = int(rng.uniform(0.08, 0.32) * imgsz)
        mask = _draw_mask(cls, size, rng)
        angle = rng.uniform(-180, 180) if cls < len(SHAPES) else rng.uniform(-30, 30)
        m = cv2.getRotationMatrix2D((size, size), angle, 1.0)
        mask = cv2.warpAffine(mask, m, (2 * size, 2 * size), flags=cv2.INTER_LINEAR)
        ys, xs = np.nonzero(mask > 127)
        if len(xs) == 0:
            continue
        x0 = int(rng.integers(-size // 2, imgsz - size - size // 2 + 1))
        y0 = int(rng.integers(-size // 2, imgsz - size - size // 2 + 1))
        box = np.array([xs.min() + x0, ys.min() + y0, xs.max() + 1 + x0, ys.max() + 1 + y0], np.float64)
        box = np.clip(box, 0, imgsz)
        if (box[2] - box[0]) < 6 or (box[3] - box[1]) < 6:
            continue
        if any(_iou(box, b) > 0.3 for b in boxes):  # some overlap, never hidden objects
            continue
        colour = np.array(rng.integers(0, 256, 3), np.float32)
        alpha = (mask.astype(np.float32) / 255.0)[..., None]
        ys0, xs0 = max(0, y0), max(0, x0)
        ys1, xs1 = min(imgsz, y0 + 2 * size), min(imgsz, x0 + 2 * size)
        a = alpha[ys0 - y0:ys1 - y0, xs0 - x0:xs1 - x0]
        region = img[ys0:ys1, xs0:xs1].astype(np.float32)
        shade = colour * rng.uniform(0.8, 1.0) + rng.normal(0, 6, region.shape)
        img[ys0:ys1, xs0:xs1] = np.clip(region * (1 - a) + shade * a, 0, 255).astype(np.uint8)
        boxes.append(box)
        labels.append(cls)
    return img, boxes, labels


def label_fingerprint(labels_dir: Path) -> str:
    """md5 of a split's label files, concatenated in name order (equals `cat $(ls | sort) | md5sum`)."""
    md5 = hashlib.md5()
    for f in sorted(labels_dir.glob("*.txt")):
        md5.update(f.read_bytes())
    return md5.hexdigest()


def write_dataset(out: Path, n_train: int, n_val: int, imgsz: int, seed: int) -> Path:
    """Build the dataset in a temp folder beside `out`, then move it into place."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
            rng = np.random.default_rng(split_seed)
            (tmp / "images" / split).mkdir(parents=True)
            (tmp / "labels" / split).mkdir(parents=True)
            for i in range(n):
                img, boxes, labels = make_image(imgsz, rng)
                stem = f"{split}_{i:05d}"
                cv2.imwrite(str(tmp / "images" / split / f"{stem}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 92])
                lines = [f"{c} {(b[0] + b[2]) / 2 / imgsz:.6f} {(b[1] + b[3]) / 2 / imgsz:.6f} "
                         f"{(b[2] - b[0]) / imgsz:.6f} {(b[3] - b[1]) / imgsz:.6f}" for c, b in zip(labels, boxes)]
                (tmp / "labels" / split / f"{stem}.txt").write_text("\n".join(lines) + ("\n" if lines else ""))
        data = {"path": str(out), "train": "images/train", "val": "images/val", "test": "images/val",
                "nc": len(NAMES), "names": NAMES,
                "fingerprint": {split: label_fingerprint(tmp / "labels" / split) for split in ("train", "val")}}
        (tmp / "data.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / "data.yaml"


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("datasets/demo"), help="output folder")
    p.add_argument("--train", type=int, default=400, help="number of training images")
    p.add_argument("--val", type=int, default=100, help="number of validation images")
    p.add_argument("--imgsz", type=int, default=320, help="image size (square)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exist-ok", action="store_true", help="replace an existing dataset folder")
    return p.parse_args(argv)


def run(out: Path, train: int, val: int, imgsz: int, seed: int, exist_ok: bool = False) -> Path:
    if train < 1 or val < 1 or imgsz < 32:
        raise ValueError("--train and --val must be >= 1 and --imgsz >= 32")
    out = Path(out)
    if out.exists():
        if not exist_ok:
            raise FileExistsError(f"--out {out} already exists; pass --exist-ok to replace it")
        shutil.rmtree(out)
    return write_dataset(out, train, val, imgsz, seed)


def main(argv=None) -> int:
    opt = parse_opt(argv)
    try:
        path = run(**vars(opt))
    except (ValueError, FileExistsError) as e:
        print(f"make_demo_dataset: error: {e}", file=sys.stderr)
        return 2
    print(f"make_demo_dataset: wrote {path} ({opt.train} train / {opt.val} val images, {len(NAMES)} classes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
