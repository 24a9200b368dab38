"""Data, evaluation and reporting used by qat.py (upstream YOLOv9 code underneath)."""
from __future__ import annotations

import itertools
import json
import math
import tempfile
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import yaml

import val as validate
from utils.dataloaders import create_dataloader
from utils.general import LOGGER, check_dataset, colorstr, init_seeds
from utils.io_utils import atomic_write

METRIC_KEYS = ("ap", "ap50", "precision", "recall")


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
def load_data(data: str | Path) -> dict:
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"--data {data}: file not found")
    try:
        return check_dataset(str(path), autodownload=False)
    except Exception as e:  # upstream raises a bare Exception for missing image folders
        raise ValueError(f"--data {data}: {e}")


def load_hyp(hyp: str | Path) -> dict:
    path = Path(hyp)
    if not path.is_file():
        raise FileNotFoundError(f"--hyp {hyp}: file not found")
    return yaml.safe_load(path.read_text())


def train_loader(data_dict: dict, imgsz: int, batch_size: int, stride: int, hyp: dict, workers: int,
                 augment: bool) -> torch.utils.data.DataLoader:
    """Shuffled training batches. A plain DataLoader (upstream's `close_mosaic` switch selects it; mosaic itself
    follows `hyp`): each pass re-draws its order from `loader.generator`, which `train_batches` seeds."""
    loader, _ = create_dataloader(data_dict["train"], imgsz, batch_size, stride, hyp=hyp, augment=augment,
                                  workers=workers, shuffle=True, close_mosaic=True, prefix=colorstr("train: "))
    return loader


class FirstBatches:
    """The first `n` batches of a loader, with a length (upstream val.run takes any iterable)."""

    def __init__(self, loader, n: int | None):
        self.loader, self.n = loader, (len(loader) if n is None else min(n, len(loader)))

    def __iter__(self):
        return itertools.islice(iter(self.loader), self.n)

    def __len__(self):
        return self.n


def val_loader(data_dict: dict, imgsz: int, batch_size: int, stride: int, workers: int,
               num_image: int | None = None, data: str | Path = "") -> FirstBatches:
    """Rectangular validation batches, the same first `num_image` images on every pass (a plain DataLoader:
    upstream's InfiniteDataLoader resumes where the last, partial pass stopped). Refuses a val set without
    images or without a single label (every metric would be 0 and a 'best' epoch picked on noise)."""
    try:
        loader, dataset = create_dataloader(data_dict["val"], imgsz, batch_size, stride, rect=True, pad=0.5,
                                            workers=workers, close_mosaic=True, prefix=colorstr("val: "))
    except Exception as e:  # upstream raises a bare Exception for an empty or unreadable image folder
        raise ValueError(f"--data {data}: val {data_dict['val']}: {e}".split("\n")[0]) from None
    if sum(len(labels) for labels in dataset.labels) == 0:
        raise ValueError(f"--data {data}: the {len(dataset)} validation images have no labels (looked for "
                         f"{Path(dataset.label_files[0]).parent}/*.txt); mAP would be 0 for every model")
    return FirstBatches(loader, None if num_image is None else math.ceil(num_image / batch_size))


def _cycle(loader, n: int) -> Iterator:
    """`n` batches of `loader`, starting a new pass when one ends."""
    it = iter(loader)
    for _ in range(n):
        try:
            yield next(it)
        except StopIteration:
            it = iter(loader)
            yield next(it)


def train_batches(loader, device: torch.device, n: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`n` batches of (images as float 0-1 on `device`, upstream targets), in an order and with augmentations
    that depend on `seed` only: an epoch seeded by (run seed, epoch) is the same whether or not the run was
    interrupted and resumed before it."""
    init_seeds(seed, deterministic=False)  # augmentations drawn in this process (workers=0)
    generator = getattr(loader, "generator", None)
    if generator is not None:  # shuffling and the workers' seeds
        generator.manual_seed(seed)
    for batch in _cycle(loader, n):
        yield batch[0].to(device, non_blocking=True).float() / 255, batch[1]


def image_batches(loader, device: torch.device, n: int) -> Iterator[torch.Tensor]:
    """`n` batches of images as float 0-1 tensors on `device` (cycling the loader if it is short)."""
    for batch in _cycle(loader, n):
        yield batch[0].to(device, non_blocking=True).float() / 255


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------
def evaluate(model: nn.Module, loader, data_dict: dict, conf_thres: float = 0.001,
             iou_thres: float = 0.7, desc: str = "") -> dict:
    """mAP50-95, mAP50, P, R of `model` with upstream val.run (FP32: quantized models stay exact)."""
    if desc:
        LOGGER.info(colorstr("eval: ") + desc)
    was_training = model.training
    (mp, mr, map50, map_, *_), _, _ = validate.run(
        data_dict, batch_size=loader.loader.batch_size if hasattr(loader, "loader") else 1,
        conf_thres=conf_thres, iou_thres=iou_thres, half=False, model=model, dataloader=loader,
        plots=False, verbose=False, save_dir=Path(tempfile.gettempdir()))
    model.train(was_training)
    return {"ap": round(float(map_), 5), "ap50": round(float(map50), 5),
            "precision": round(float(mp), 5), "recall": round(float(mr), 5)}


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------
def metrics_table(rows: list[tuple[str, dict | None]]) -> str:
    """Markdown table: one row per model, AP / AP50 / Precision / Recall."""
    lines = ["| Eval Model | AP | AP50 | Precision | Recall |", "|---|---|---|---|---|"]
    for name, m in rows:
        cells = ["-"] * 4 if m is None else [f"{m[k]:.4f}" for k in METRIC_KEYS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, obj) -> Path:
    """Atomic JSON write (temp file + rename)."""
    def dump(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
    return atomic_write(path, dump)
