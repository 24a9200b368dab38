#!/usr/bin/env python3
"""Write a small YOLO-format detection (or segmentation) dataset offline, identical on every machine.

12 classes (6 shapes, 6 seven-segment digits) of varied size, colour and rotation, partly overlapping, on
cluttered backgrounds (gradients, noise, lines, scribbles). Layout:
    OUT/images/{train,val}/*.png   OUT/labels/{train,val}/*.txt   OUT/data.yaml

    python scripts/make_demo_dataset.py --out datasets/demo --train 400 --val 100 --imgsz 320 [--segments]

Every pixel is computed by this file with exact arithmetic: random numbers come from a counter-based
generator (splitmix64 on uint64 arrays, no numpy Generator, whose streams may change between versions),
shapes are unions of convex polygons filled by edge tests (no OpenCV rasterizer, no font), noise is a sum of
uniforms (no transcendental array functions), and images are stored as PNG (lossless: no JPEG codec
differences). Any numpy/OpenCV version therefore writes the same dataset; data.yaml records the md5 of each
split's labels and decoded pixels (`fingerprint`) so copies can be compared. With --segments each object's
label is its outline polygon (upstream's segmentation format) instead of its box.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
import sys
from pathlib import Path

import cv2
import numpy as np
import yaml

SHAPES = ("circle", "square", "triangle", "star", "cross", "hexagon")
DIGITS = ("2", "3", "4", "5", "7", "8")
NAMES = list(SHAPES) + [f"digit_{d}" for d in DIGITS]
_SEGMENTS = {"2": "abged", "3": "abgcd", "4": "fgbc", "5": "afgcd", "7": "abc", "8": "abcdefg"}
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


# --------------------------------------------------------------------------------------------------
# Random numbers that do not depend on any library version
# --------------------------------------------------------------------------------------------------
class Rng:
    """splitmix64 over a counter: integer arithmetic on uint64 arrays (wrapping), the same everywhere."""

    def __init__(self, seed: int):
        self.key = np.uint64(seed * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF)
        self.counter = 0

    def _bits(self, n: int) -> np.ndarray:
        z = (np.arange(self.counter, self.counter + n, dtype=np.uint64) + self.key) * np.uint64(0x9E3779B97F4A7C15)
        self.counter += n
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _MASK64

    def random(self, n: int | None = None):
        u = (self._bits(1 if n is None else n) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
        return float(u[0]) if n is None else u

    def uniform(self, lo: float, hi: float, n: int | None = None):
        return lo + (hi - lo) * self.random(n)

    def integers(self, lo: int, hi: int) -> int:
        """An int in [lo, hi)."""
        return lo + min(int(self.random() * (hi - lo)), hi - lo - 1)

    def normal(self, sigma: float, shape: tuple[int, ...]) -> np.ndarray:
        """Approximately normal (sum of four uniforms, unit variance after scaling): only + and *."""
        n = int(np.prod(shape))
        u = self.random(4 * n).reshape(4, n).sum(0)
        return ((u - 2.0) * (sigma * 1.7320508075688772)).reshape(shape)


# --------------------------------------------------------------------------------------------------
# Shapes: unions of convex polygons in object coordinates (unit radius), counter-clockwise
# --------------------------------------------------------------------------------------------------
def _regular(n: int, r: float = 1.0, phase: float = 0.0) -> list[tuple[float, float]]:
    return [(r * math.cos(phase + 2 * math.pi * k / n), r * math.sin(phase + 2 * math.pi * k / n)) for k in range(n)]


def _rect(x0: float, y0: float, x1: float, y1: float) -> list[tuple[float, float]]:
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


def _star() -> list[list[tuple[float, float]]]:
    outer, inner = _regular(5, 1.0, -math.pi / 2), _regular(5, 0.45, -math.pi / 2 + math.pi / 5)
    return [inner] + [[inner[(k - 1) % 5], outer[k], inner[k]] for k in range(5)]


def _digit(d: str) -> list[list[tuple[float, float]]]:
    w, h, t = 0.55, 1.0, 0.2  # half width, half height, stroke
    seg = {"a": _rect(-w, -h, w, -h + t), "g": _rect(-w, -t / 2, w, t / 2), "d": _rect(-w, h - t, w, h),
           "f": _rect(-w, -h, -w + t, 0), "b": _rect(w - t, -h, w, 0), "e": _rect(-w, 0, -w + t, h),
           "c": _rect(w - t, 0, w, h)}
    return [seg[s] for s in _SEGMENTS[d]]


def shape_parts(cls: int) -> list[list[tuple[float, float]]]:
    name = NAMES[cls]
    if name == "circle":
        return [_regular(48)]
    if name == "square":
        return [_rect(-0.8, -0.8, 0.8, 0.8)]
    if name == "triangle":
        return [_regular(3, 1.0, -math.pi / 2)]
    if name == "star":
        return _star()
    if name == "cross":
        return [_rect(-1, -0.3, 1, 0.3), _rect(-0.3, -1, 0.3, 1)]
    if name == "hexagon":
        return [_regular(6)]
    return _digit(name.split("_")[1])


def _transform(parts, cx: float, cy: float, radius: float, angle: float):
    c, s = round(math.cos(angle), 12), round(math.sin(angle), 12)  # libm's last bit must not matter
    return [[(round(cx + radius * (c * x - s * y), 6), round(cy + radius * (s * x + c * y), 6)) for x, y in p]
            for p in parts]


def coverage(parts, imgsz: int) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """Fraction (0, 1/4, ... 1) of each pixel inside the union of convex polygons (2x2 samples per pixel),
    over the polygons' pixel bounding box clipped to the image. Returns (alpha, (x0, y0, x1, y1))."""
    xs = [x for p in parts for x, _ in p]
    ys = [y for p in parts for _, y in p]
    x0, y0 = max(0, int(math.floor(min(xs)))), max(0, int(math.floor(min(ys))))
    x1, y1 = min(imgsz, int(math.ceil(max(xs))) + 1), min(imgsz, int(math.ceil(max(ys))) + 1)
    if x1 <= x0 or y1 <= y0:
        return np.zeros((0, 0)), (0, 0, 0, 0)
    sy, sx = np.mgrid[y0 * 2:y1 * 2, x0 * 2:x1 * 2].astype(np.float64)
    px, py = (sx + 0.5) * 0.5, (sy + 0.5) * 0.5
    inside = np.zeros(px.shape, bool)
    for poly in parts:
        ok = np.ones(px.shape, bool)
        for (ax, ay), (bx, by) in zip(poly, poly[1:] + poly[:1]):
            ok &= (bx - ax) * (py - ay) - (by - ay) * (px - ax) >= 0
        inside |= ok
    alpha = inside.reshape(y1 - y0, 2, x1 - x0, 2).mean((1, 3))
    return alpha, (x0, y0, x1, y1)


def _segment_mask(p: tuple[float, float], q: tuple[float, float], half_width: float, imgsz: int) -> np.ndarray:
    """Pixels within `half_width` of the segment p-q (squared distances: arithmetic only). Computed over the
    segment's box grown by `half_width` and a pixel (every pixel outside is farther away), with the same arithmetic
    per pixel as over the whole image: the same mask, a fraction of the work."""
    mask = np.zeros((imgsz, imgsz), bool)
    x0, y0 = (max(0, math.floor(min(p[i], q[i]) - half_width)) for i in (0, 1))
    x1, y1 = (min(imgsz, math.ceil(max(p[i], q[i]) + half_width) + 1) for i in (0, 1))
    if x1 <= x0 or y1 <= y0:
        return mask
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float64)
    dx, dy = q[0] - p[0], q[1] - p[1]
    length2 = dx * dx + dy * dy
    t = np.clip(((xx - p[0]) * dx + (yy - p[1]) * dy) / length2, 0.0, 1.0) if length2 > 0 else np.zeros_like(xx)
    ex, ey = xx - (p[0] + t * dx), yy - (p[1] + t * dy)
    mask[y0:y1, x0:x1] = ex * ex + ey * ey <= half_width * half_width
    return mask


def _background(imgsz: int, rng: Rng) -> np.ndarray:
    yy, xx = np.mgrid[0:imgsz, 0:imgsz].astype(np.float64) / imgsz
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    a = rng.uniform(0, 2 * math.pi)
    t = round(math.cos(a), 12) * xx + round(math.sin(a), 12) * yy
    t = (t - t.min()) / (t.max() - t.min() + 1e-6)
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    img += rng.normal(rng.uniform(4, 18), img.shape)
    for _ in range(rng.integers(4, 14)):  # straight clutter lines
        p, q = tuple(rng.uniform(0, imgsz, 2)), tuple(rng.uniform(0, imgsz, 2))
        img[_segment_mask(p, q, rng.uniform(0.5, 1.5), imgsz)] = rng.uniform(0, 255, 3)
    for _ in range(rng.integers(2, 6)):  # scribbles: short random walks
        colour, p = rng.uniform(0, 255, 3), tuple(rng.uniform(0, imgsz, 2))
        for _ in range(6):
            q = (p[0] + rng.uniform(-imgsz / 12, imgsz / 12), p[1] + rng.uniform(-imgsz / 12, imgsz / 12))
            img[_segment_mask(p, q, 0.6, imgsz)] = colour
            p = q
    return img


def _iou(a, b) -> float:
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0, x2 - x1) * max(0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _outline(mask: np.ndarray, offset: tuple[int, int]) -> np.ndarray:
    """One polygon around every part of a binary mask, through the boundary pixels' centres, in image
    coordinates: the box upstream derives from it is the object's box less half a pixel on each side. Parts
    (a thin stroke can break at low resolution) are joined by zero-width bridges, as YOLO label converters do."""
    contours, _ = cv2.findContours(mask.astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    parts = sorted((c.reshape(-1, 2).astype(np.float64) for c in contours), key=lambda c: (c[:, 1].min(), c[:, 0].min()))
    return _bridged(parts, 0, 0) + np.array(offset, np.float64) + 0.5


def _bridged(parts: list[np.ndarray], k: int, entry: int) -> np.ndarray:
    """Closed walk around part k from point `entry`, detouring at its point nearest to part k+1 through the
    walk around parts k+1... and back along the same bridge."""
    c = np.roll(parts[k], -entry, axis=0)
    c = np.concatenate([c, c[:1]])
    if k == len(parts) - 1:
        return c
    d = ((c[:, None, :] - parts[k + 1][None, :, :]) ** 2).sum(-1)
    i, j = np.unravel_index(int(d.argmin()), d.shape)
    return np.concatenate([c[:i + 1], _bridged(parts, k + 1, int(j)), c[i:]])


def make_image(imgsz: int, rng: Rng, max_objects: int = 6):
    """One image (uint8 HxWx3) and its objects: (class, box x0 y0 x1 y1, outline polygon)."""
    img = _background(imgsz, rng)
    objects = []
    for _ in range(rng.integers(1, max_objects + 1)):
        cls = rng.integers(0, len(NAMES))
        radius = rng.uniform(0.04, 0.16) * imgsz
        angle = math.radians(rng.uniform(-180, 180) if cls < len(SHAPES) else rng.uniform(-30, 30))
        cx, cy = rng.uniform(0, imgsz), rng.uniform(0, imgsz)
        colour, shade = rng.uniform(0, 255, 3), rng.uniform(0.8, 1.0)
        alpha, (x0, y0, x1, y1) = coverage(_transform(shape_parts(cls), cx, cy, radius, angle), imgsz)
        solid = alpha >= 0.5
        if not solid.any():
            continue
        rows, cols = np.nonzero(solid.any(1))[0], np.nonzero(solid.any(0))[0]
        box = (x0 + int(cols[0]), y0 + int(rows[0]), x0 + int(cols[-1]) + 1, y0 + int(rows[-1]) + 1)
        if box[2] - box[0] < 6 or box[3] - box[1] < 6 or any(_iou(box, o[1]) > 0.3 for o in objects):
            continue  # too small, or hiding another object
        region = img[y0:y1, x0:x1]
        fill = colour * shade + rng.normal(6, region.shape)
        region[:] = region * (1 - alpha[..., None]) + fill * alpha[..., None]
        objects.append((cls, box, _outline(solid, (x0, y0))))
    return np.clip(np.floor(img + 0.5), 0, 255).astype(np.uint8), objects


def label_lines(objects, imgsz: int, segments: bool) -> list[str]:
    if segments:
        return [f"{cls} " + " ".join(f"{v / imgsz:.6f}" for v in poly.reshape(-1)) for cls, _, poly in objects]
    return [f"{cls} {(b[0] + b[2]) / 2 / imgsz:.6f} {(b[1] + b[3]) / 2 / imgsz:.6f} "
            f"{(b[2] - b[0]) / imgsz:.6f} {(b[3] - b[1]) / imgsz:.6f}" for cls, b, _ in objects]


def write_dataset(out: Path, n_train: int, n_val: int, imgsz: int, seed: int, segments: bool = False) -> Path:
    """Build the dataset in a temp folder beside `out`, then move it into place."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"  # mkdir honours the umask (mkdtemp would make 0700)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fingerprint = {}
        for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
            rng = Rng(split_seed)
            md5 = hashlib.md5()
            (tmp / "images" / split).mkdir(parents=True)
            (tmp / "labels" / split).mkdir(parents=True)
            for i in range(n):
                img, objects = make_image(imgsz, rng)
                stem = f"{split}_{i:05d}"
                if not cv2.imwrite(str(tmp / "images" / split / f"{stem}.png"), img):
                    raise OSError(f"could not write {tmp / 'images' / split / stem}.png")
                text = "".join(line + "\n" for line in label_lines(objects, imgsz, segments))
                (tmp / "labels" / split / f"{stem}.txt").write_text(text)
                md5.update(img.tobytes())
                md5.update(text.encode())
            fingerprint[split] = md5.hexdigest()
        data = {"path": str(out), "train": "images/train", "val": "images/val", "test": "images/val",
                "nc": len(NAMES), "names": NAMES, "fingerprint": fingerprint}
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
    p.add_argument("--segments", action="store_true", help="instance outline polygons instead of boxes")
    p.add_argument("--exist-ok", action="store_true", help="replace an existing dataset folder")
    return p.parse_args(argv)


def run(out: Path, train: int, val: int, imgsz: int, seed: int, segments: bool = False,
        exist_ok: bool = False) -> Path:
    if train < 1 or val < 1 or imgsz < 32:
        raise ValueError("--train and --val must be >= 1 and --imgsz >= 32")
    out = Path(out)
    if out.exists():
        if not exist_ok:
            raise FileExistsError(f"--out {out} already exists; pass --exist-ok to replace it")
        shutil.rmtree(out)
    return write_dataset(out, train, val, imgsz, seed, segments)


def main(argv=None) -> int:
    opt = parse_opt(argv)
    try:
        path = run(**vars(opt))
    except (ValueError, OSError) as e:
        print(f"make_demo_dataset: error: {e}", file=sys.stderr)
        return 2
    fp = yaml.safe_load(path.read_text())["fingerprint"]
    print(f"make_demo_dataset: wrote {path} ({opt.train} train / {opt.val} val images, {len(NAMES)} classes"
          f"{', outline polygons' if opt.segments else ''}); fingerprint train {fp['train']} val {fp['val']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
