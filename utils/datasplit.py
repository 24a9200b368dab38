"""The select split, from the rule to the files a run writes, and dataset fingerprints.

Every choice `qat.py quantize` and the benchmark make (calibration method, delivered model, recipe, the peer's
method) is made on a `select` split: a fixed, seeded share of the training images that calibration, QAT and
float training never see. The reported val split is only measured. Membership depends on the file names and the
seed alone (a hash rank), so every machine carves the same split from the same folder, whatever its listing
order, and a smaller share of the same images is a subset of a larger one.

    python -m utils.datasplit DATA.yaml --out DIR [--fraction 0.1] [--min-images 100] [--seed 0]

writes DIR/fit.txt and DIR/select.txt (absolute image paths) and DIR/split.yaml: `train` = fit, `val` = select,
`test` = the original val, plus the fingerprints of the three (md5 over names, image bytes and label bytes).

A `qat.py` run asks once (`split_for` with its `SelectConfig`: carved from the training images, the val images of
`--select-data`, or with `--no-select` the val images) and gets a `SelectSplit` that writes the run's
`split/select.txt` (and `split/fit.txt`, what calibration and fine-tuning read) and describes itself for
report.json; the choices made on it are models/core/selection.py's.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from utils.io_utils import atomic_write

IMAGE_SUFFIXES = {".bmp", ".dng", ".jpeg", ".jpg", ".mpo", ".png", ".tif", ".tiff", ".webp", ".pfm"}
DEFAULT_FRACTION = 0.1
DEFAULT_MIN_IMAGES = 100
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Split:
    fit: tuple[Path, ...]
    select: tuple[Path, ...]


def read_data_yaml(data: str | Path) -> dict:
    """The data yaml with `train`/`val`/`test` resolved to absolute paths (a relative `path:` is taken
    against the yaml's own folder, not a checkout's)."""
    data = Path(data)
    if not data.is_file():
        raise FileNotFoundError(f"--data {data}: file not found")
    d = yaml.safe_load(data.read_text()) or {}
    missing = [k for k in ("train", "val", "names") if k not in d]
    if missing:
        raise ValueError(f"--data {data}: no {', '.join(missing)} key")
    root = Path(d.get("path") or ".")
    root = (root if root.is_absolute() else data.parent / root).resolve()
    for key in ("train", "val", "test"):
        if d.get(key):
            entries = d[key] if isinstance(d[key], list) else [d[key]]
            absolute = [str(_absolute(root, p)) for p in entries]
            d[key] = absolute if isinstance(d[key], list) else absolute[0]
    d["path"] = str(root)
    return d


def _absolute(root: Path, p: str) -> Path:
    p = Path(p)
    return p if p.is_absolute() else root / p


def image_files(source: str | Path | list) -> list[Path]:
    """Images of an upstream `train`/`val` entry: folders (recursively), .txt lists, or lists of either."""
    if isinstance(source, (list, tuple)):
        return sorted({f for s in source for f in image_files(s)})
    source = Path(source)
    if source.is_dir():
        return sorted(f for f in source.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
    if source.is_file() and source.suffix == ".txt":
        lines = [ln.strip() for ln in source.read_text().splitlines() if ln.strip()]
        return sorted(_absolute(source.parent, ln) for ln in lines)
    raise FileNotFoundError(f"{source}: neither an image folder nor a .txt list of images")


def label_file(image: Path) -> Path:
    """Upstream's label path for an image: the last /images/ of the path becomes /labels/, suffix .txt."""
    parts = str(image).rsplit(f"{os.sep}images{os.sep}", 1)
    return Path(f"{os.sep}labels{os.sep}".join(parts)).with_suffix(".txt")


def select_count(n_images: int, fraction: float = DEFAULT_FRACTION, min_images: int = DEFAULT_MIN_IMAGES) -> int:
    """How many of `n_images` training images are held out: the fraction (rounded, at least one), raised to
    `min_images` as long as at least half of the images remain for calibration and fine-tuning."""
    return max(1, round(fraction * n_images), min(min_images, n_images // 2))


def carve(images: list[Path], fraction: float = DEFAULT_FRACTION, seed: int = DEFAULT_SEED,
          min_images: int = DEFAULT_MIN_IMAGES) -> Split:
    """`select_count` of `images` into `select`, chosen by a seeded hash of each file name."""
    if not 0 < fraction < 1:
        raise ValueError(f"--fraction {fraction}: must be between 0 and 1")
    if len(images) < 2:
        raise ValueError(f"{len(images)} training image(s): too few to carve a selection split from")
    rank = sorted(images, key=lambda f: hashlib.sha256(f"{seed}:{f.name}".encode()).hexdigest())
    n = select_count(len(images), fraction, min_images)
    select = set(rank[:n])
    return Split(fit=tuple(f for f in images if f not in select), select=tuple(sorted(select)))


def fingerprint(images: list[Path] | tuple[Path, ...]) -> str:
    """md5 over the sorted file names, image bytes and label bytes (a missing label file counts as empty)."""
    md5 = hashlib.md5()
    for f in sorted(images, key=lambda p: p.name):
        md5.update(f.name.encode())
        md5.update(f.read_bytes())
        lbl = label_file(f)
        md5.update(lbl.read_bytes() if lbl.is_file() else b"")
    return md5.hexdigest()


def write_split(data: str | Path, out: str | Path, fraction: float = DEFAULT_FRACTION,
                seed: int = DEFAULT_SEED, min_images: int = DEFAULT_MIN_IMAGES) -> Path:
    """Write OUT/fit.txt, OUT/select.txt and OUT/split.yaml (see the module doc); returns the yaml's path.
    Idempotent: an existing split of the same data, fraction and seed is kept, any other is refused."""
    d = read_data_yaml(data)
    train, val = image_files(d["train"]), image_files(d["val"])
    if set(train) & set(val):
        raise ValueError(f"--data {data}: train and val share images; a selection split needs a separate val")
    split = carve(train, fraction, seed, min_images)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    fp = {"fit": fingerprint(split.fit), "select": fingerprint(split.select), "val": fingerprint(val)}
    spec = {"path": str(out), "train": str(out / "fit.txt"), "val": str(out / "select.txt"), "test": d["val"],
            "nc": d.get("nc", len(d["names"])), "names": d["names"],
            "split": {"source": str(Path(data).resolve()), "fraction": fraction, "min_images": min_images, "seed": seed,
                      "images": {"fit": len(split.fit), "select": len(split.select), "val": len(val)},
                      "fingerprint": fp}}
    yaml_file = out / "split.yaml"
    if yaml_file.is_file():
        old = yaml.safe_load(yaml_file.read_text()).get("split", {})
        if old.get("fingerprint") == fp and (old.get("fraction"), old.get("min_images"), old.get("seed")) == \
                (fraction, min_images, seed):
            return yaml_file
        raise FileExistsError(f"{yaml_file} holds another split (fraction {old.get('fraction')}, seed "
                              f"{old.get('seed')}); choose another --out")
    for name, files in (("fit.txt", split.fit), ("select.txt", split.select)):
        atomic_write(out / name, lambda tmp, fs=files: Path(tmp).write_text("".join(f"{f}\n" for f in fs)))
    atomic_write(yaml_file, lambda tmp: Path(tmp).write_text(yaml.safe_dump(spec, sort_keys=False)))
    return yaml_file


@dataclass(frozen=True)
class SelectConfig:
    """Where choices are made: a share of the training images (fraction, at least `min_images` where at most half
    of the images are taken), the val images of a separate yaml (`data`), or, switched off, the val images."""
    fraction: float = DEFAULT_FRACTION
    min_images: int = DEFAULT_MIN_IMAGES
    data: str | None = None
    enabled: bool = True

    def __post_init__(self):
        if not 0 < self.fraction < 1:
            raise ValueError(f"--select-fraction must be between 0 and 1, got {self.fraction}")
        if self.min_images < 1:
            raise ValueError(f"--select-min must be >= 1, got {self.min_images}")
        if self.data and not self.enabled:
            raise ValueError("--select-data and --no-select contradict each other")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SelectSplit:
    """The images choices are made on, and the training images left for calibration and fine-tuning (None: all
    of them)."""
    select: tuple[Path, ...]             # the image files
    fit: tuple[Path, ...] | None
    source: str                          # "train" (carved), "select-data" or "val" (no split)

    def info(self) -> dict:
        """For report.json: the source, image counts and the select images' fingerprint."""
        return {"source": self.source, "images": len(self.select), "fingerprint": fingerprint(self.select),
                **({} if self.fit is None else {"fit_images": len(self.fit)})}

    def write(self, folder: Path, write: bool = True) -> tuple[str, str | None]:
        """The select and fit image lists as upstream `val`/`train` entries: .txt files in `folder` (no fit list
        where the training images are not split), written where `write` (one process of a distributed job writes,
        the others read)."""
        lists = {folder / "select.txt": self.select, **({} if self.fit is None else {folder / "fit.txt": self.fit})}
        if write:
            folder.mkdir(parents=True, exist_ok=True)
            for path, files in lists.items():
                text = "".join(f"{f}\n" for f in files)
                if not path.is_file() or path.read_text() != text:
                    atomic_write(path, lambda tmp, t=text: Path(tmp).write_text(t))
        paths = [str(path) for path in lists]
        return paths[0], paths[1] if len(paths) > 1 else None


def split_for(data_dict: dict, cfg: SelectConfig, data_flag: str) -> SelectSplit:
    """The select split of a dataset (upstream's checked data dict), checked before anything is written."""
    if cfg.data:
        from utils.batches import load_data  # upstream's dataset check: only where a run asks
        if not Path(cfg.data).is_file():
            raise FileNotFoundError(f"--select-data {cfg.data}: file not found")
        return SelectSplit(_listed(load_data(cfg.data)["val"], f"--select-data {cfg.data}"), None, "select-data")
    if not cfg.enabled:
        from utils.general import LOGGER, colorstr
        LOGGER.warning(f"{colorstr('select: ')}--no-select: the calibration method, the best epoch and the delivered model are "
                       "chosen on the val images, so their val mAP is optimistic")
        return SelectSplit(_listed(data_dict["val"], f"--data {data_flag}"), None, "val")
    train = image_files(data_dict["train"])
    if len(train) < 4:
        raise ValueError(f"--data {data_flag}: {len(train)} training image(s) are too few to hold out a select split "
                         "(give --select-data, or --no-select)")
    # the split's seed is fixed, not the run's --seed: every seed of a benchmark and the float training hold out
    # the same images (utils/datasplit.py, which scripts/train_float.py and the benchmark use too)
    split = carve(train, cfg.fraction, DEFAULT_SEED, cfg.min_images)
    if not any(label_file(f).is_file() and label_file(f).stat().st_size for f in split.select):
        raise ValueError(f"--data {data_flag}: none of the {len(split.select)} held-out training images has a label; "
                         "choices made on them would be noise (give --select-data)")
    return SelectSplit(split.select, split.fit, "train")


def _listed(val, flag: str) -> tuple[Path, ...]:
    """The images of an upstream `val` entry, listed once (the run's split/select.txt records them)."""
    try:
        files = tuple(image_files(val))
    except FileNotFoundError as e:
        raise ValueError(f"{flag}: val {e}") from None
    if not files:
        raise ValueError(f"{flag}: val {val} holds no images")
    return files


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="dataset.yaml with train and val")
    p.add_argument("--out", required=True, help="folder for fit.txt, select.txt and split.yaml")
    p.add_argument("--fraction", type=float, default=DEFAULT_FRACTION, help="share of the training images held out")
    p.add_argument("--min-images", type=int, default=DEFAULT_MIN_IMAGES,
                   help="hold out at least this many while half of the training images remain")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    return p.parse_args(argv)


def main(argv=None) -> int:
    opt = parse_opt(argv)
    try:
        path = write_split(opt.data, opt.out, opt.fraction, opt.seed, opt.min_images)
    except (OSError, ValueError) as e:
        print(f"datasplit: error: {e}", file=sys.stderr)
        return 2
    info = yaml.safe_load(path.read_text())["split"]
    print(f"datasplit: {path}: {info['images']}, fingerprints {info['fingerprint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
