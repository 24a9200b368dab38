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
MASK_METRIC_KEYS = ("mask_ap", "mask_ap50", "mask_precision", "mask_recall")
TASKS = ("detect", "segment")
MASK_DOWNSAMPLE = 4  # ground-truth masks at the prototypes' resolution, as upstream segment/train.py validates


def task_of(model: nn.Module) -> str:
    """"segment" for models whose head also predicts masks (Segment, DSegment: a prototype branch), else "detect"."""
    return "segment" if hasattr(model.model[-1], "proto") else "detect"


def selection_score(metrics: dict) -> float:
    """What picks the best QAT epoch: box mAP50-95, plus mask mAP50-95 for segmentation."""
    return metrics["ap"] + metrics.get("mask_ap", 0.0)


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


def task_dataloader(task: str, path, imgsz: int, batch_size: int, stride: int, **kwargs):
    """Upstream's loader of the task: segmentation batches also carry the instance masks (overlapping
    instances in one mask per image, as upstream trains)."""
    if task == "segment":
        from utils.segment.dataloaders import create_dataloader as create_segment_dataloader
        return create_segment_dataloader(path, imgsz, batch_size, stride, overlap_mask=True,
                                         mask_downsample_ratio=MASK_DOWNSAMPLE, **kwargs)
    return create_dataloader(path, imgsz, batch_size, stride, **kwargs)


def train_loader(data_dict: dict, imgsz: int, batch_size: int, stride: int, hyp: dict, workers: int,
                 augment: bool, task: str = "detect") -> torch.utils.data.DataLoader:
    """Shuffled training batches. A plain DataLoader (upstream's `close_mosaic` switch selects it; mosaic itself
    follows `hyp`): each pass re-draws its order from `loader.generator`, which `train_batches` seeds."""
    loader, _ = task_dataloader(task, data_dict["train"], imgsz, batch_size, stride, hyp=hyp, augment=augment,
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
               num_image: int | None = None, data: str | Path = "", task: str = "detect") -> FirstBatches:
    """Rectangular validation batches, the same first `num_image` images on every pass (a plain DataLoader:
    upstream's InfiniteDataLoader resumes where the last, partial pass stopped). Refuses a val set without
    images or without a single label (every metric would be 0 and a 'best' epoch picked on noise)."""
    try:
        loader, dataset = task_dataloader(task, data_dict["val"], imgsz, batch_size, stride, rect=True, pad=0.5,
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


def train_batches(loader, device: torch.device, n: int, seed: int
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """`n` batches of (images as float 0-1 on `device`, upstream targets, instance masks or None for detection
    data), in an order and with augmentations that depend on `seed` only: an epoch seeded by (run seed, epoch)
    is the same whether or not the run was interrupted and resumed before it."""
    init_seeds(seed, deterministic=False)  # augmentations drawn in this process (workers=0)
    generator = getattr(loader, "generator", None)
    if generator is not None:  # shuffling and the workers' seeds
        generator.manual_seed(seed)
    for batch in _cycle(loader, n):
        yield batch[0].to(device, non_blocking=True).float() / 255, batch[1], batch[4] if len(batch) > 4 else None


def image_batches(loader, device: torch.device, n: int) -> Iterator[torch.Tensor]:
    """`n` batches of images as float 0-1 tensors on `device` (cycling the loader if it is short)."""
    for batch in _cycle(loader, n):
        yield batch[0].to(device, non_blocking=True).float() / 255


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------
def evaluate(model: nn.Module, loader, data_dict: dict, conf_thres: float = 0.001,
             iou_thres: float = 0.7, desc: str = "") -> dict:
    """mAP50-95, mAP50, P, R of `model` with upstream's validation (FP32: quantized models stay exact); for
    segmentation models also the mask metrics (upstream segment/val.py: its mask processing and matching)."""
    if desc:
        LOGGER.info(colorstr("eval: ") + desc)
    was_training = model.training
    common = dict(batch_size=loader.loader.batch_size if hasattr(loader, "loader") else 1, conf_thres=conf_thres,
                  iou_thres=iou_thres, half=False, model=model, dataloader=loader, plots=False, verbose=False,
                  save_dir=Path(tempfile.gettempdir()))
    if task_of(model) == "segment":
        from segment import val as segment_validate
        results, _, _ = segment_validate.run(data_dict, overlap=True, mask_downsample_ratio=MASK_DOWNSAMPLE, **common)
        keys = ("precision", "recall", "ap50", "ap", "mask_precision", "mask_recall", "mask_ap50", "mask_ap")
    else:
        results, _, _ = validate.run(data_dict, **common)
        keys = ("precision", "recall", "ap50", "ap")
    model.train(was_training)
    metrics = {k: round(float(v), 5) for k, v in zip(keys, results)}
    return {k: metrics[k] for k in (*METRIC_KEYS, *MASK_METRIC_KEYS) if k in metrics}


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------
def metrics_table(rows: list[tuple[str, dict | None]]) -> str:
    """Markdown table: one row per model, AP / AP50 / Precision / Recall (boxes), and the same for masks when
    any row has them."""
    masks = any(m and "mask_ap" in m for _, m in rows)
    keys = METRIC_KEYS + (MASK_METRIC_KEYS if masks else ())
    head = ["AP", "AP50", "Precision", "Recall"]
    head = [f"Box {h}" for h in head] + [f"Mask {h}" for h in head] if masks else head
    lines = ["| Eval Model | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, m in rows:
        cells = [f"{m[k]:.4f}" if m and k in m else "-" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, obj) -> Path:
    """Atomic JSON write (temp file + rename)."""
    def dump(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
    return atomic_write(path, dump)
