"""The select split and every choice made on it: one mechanism for `qat.py quantize` and the accuracy benchmark.

A run holds out a seeded share of its training images (utils/datasplit.py: membership depends on the file names
alone, so every machine and every run of the same data carves the same split) that calibration and fine-tuning
never see. The calibration method, the best QAT epoch and the delivered model (the best of the PTQ model and every
QAT epoch) are chosen on it; the val images are only measured. `choose` is the rule for every choice: the highest
score, the first candidate on a tie (candidates are listed cheapest first, so a tie keeps the simpler one).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from utils.datasplit import (DEFAULT_FRACTION, DEFAULT_MIN_IMAGES, DEFAULT_SEED, carve, fingerprint, image_files,
                             label_file)
from utils.general import LOGGER, colorstr
from utils.io_utils import atomic_write

PREFIX = colorstr("select: ")


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
        from utils.batches import load_data
        if not Path(cfg.data).is_file():
            raise FileNotFoundError(f"--select-data {cfg.data}: file not found")
        return SelectSplit(_listed(load_data(cfg.data)["val"], f"--select-data {cfg.data}"), None, "select-data")
    if not cfg.enabled:
        LOGGER.warning(f"{PREFIX}--no-select: the calibration method, the best epoch and the delivered model are "
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


def choose(scores: dict[str, float | None]) -> str:
    """The candidate with the highest score; the first one listed on a tie. Unmeasured (None) candidates lose."""
    measured = {k: v for k, v in scores.items() if v is not None}
    if not measured:
        raise ValueError("no candidate was measured")
    return max(measured, key=lambda k: (measured[k], -list(scores).index(k)))


def choose_calibration(apply: Callable[[str], None], measure: Callable[[str], dict | None],
                       score: Callable[[dict], float], candidates: list[str], broadcast: Callable = lambda x: x
                       ) -> tuple[str, dict[str, dict | None]]:
    """Each candidate's ranges applied in turn and measured (`measure` returns None on ranks that do not
    evaluate; `broadcast` gives every rank the evaluating rank's results); the best applied. Returns its name and
    every candidate's metrics."""
    results = {}
    for name in candidates:
        apply(name)
        results[name] = measure(name)
    results = broadcast(results)
    best = choose({k: None if v is None else score(v) for k, v in results.items()})
    apply(best)
    return best, results
