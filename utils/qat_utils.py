"""Data, evaluation, QAT distillation and reporting used by qat.py (upstream YOLOv9 code underneath)."""
from __future__ import annotations

import itertools
import json
import math
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from tqdm import tqdm

import val as validate
from utils.dataloaders import create_dataloader
from utils.general import LOGGER, TQDM_BAR_FORMAT, check_dataset, colorstr
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
    loader, _ = create_dataloader(data_dict["train"], imgsz, batch_size, stride, hyp=hyp, augment=augment,
                                  workers=workers, shuffle=True, prefix=colorstr("train: "))
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
               num_image: int | None = None) -> FirstBatches:
    loader, _ = create_dataloader(data_dict["val"], imgsz, batch_size, stride, rect=True, pad=0.5,
                                  workers=workers, prefix=colorstr("val: "))
    return FirstBatches(loader, None if num_image is None else math.ceil(num_image / batch_size))


def image_batches(loader, device: torch.device, n: int) -> Iterator[torch.Tensor]:
    """`n` batches of images as float 0-1 tensors on `device` (cycling the loader if it is short)."""
    it = iter(loader)
    for _ in range(n):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
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
# QAT by distillation from the float model
# --------------------------------------------------------------------------------------------------
def supervised_layers(n_layers: int, stride: int) -> list[int]:
    """Every `stride`-th top-level layer, and always the head."""
    if stride < 1:
        raise ValueError(f"--supervision-stride must be >= 1, got {stride}")
    return sorted(set(range(0, n_layers, stride)) | {n_layers - 1})


def _feature_maps(out) -> list[torch.Tensor]:
    """A layer's output as a list of tensors (heads return (decoded, raw maps) in eval mode)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)) and len(out) == 2 and isinstance(out[1], (list, tuple)):
        return list(out[1])
    return [t for t in out if isinstance(t, torch.Tensor)]


class LayerTap:
    """Forward hooks recording the outputs of chosen top-level layers."""

    def __init__(self, model: nn.Module, layers: Iterable[int]):
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self._handles = [model.model[i].register_forward_hook(self._hook(i)) for i in layers]

    def _hook(self, i):
        def record(_module, _inputs, out):
            self.outputs[i] = _feature_maps(out)
        return record

    def remove(self):
        for h in self._handles:
            h.remove()


def lr_at(epoch: int, epochs: int, lr: float) -> float:
    """Warm-up at lr/10, lr in the middle, lr/10 for the last fifth (the reference QAT schedule, scaled)."""
    if epochs <= 2:
        return lr
    warm, cool = max(1, round(0.3 * epochs)), round(0.8 * epochs)
    return lr / 10 if epoch < warm or epoch >= cool else lr


def distill_epoch(student: nn.Module, teacher: nn.Module, batches: Iterable[torch.Tensor], layers: list[int],
                  optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, desc: str,
                  total: int) -> float:
    """One QAT epoch: MSE between student (fake-quant) and teacher (float) outputs of `layers`."""
    student.train()
    teacher.eval()
    s_tap, t_tap = LayerTap(student, layers), LayerTap(teacher, layers)
    device = next(student.parameters()).device
    autocast = torch.autocast("cuda", dtype=torch.float16) if scaler is not None else nullcontext()
    losses = []
    try:
        pbar = tqdm(batches, total=total, desc=desc, bar_format=TQDM_BAR_FORMAT)
        for im in pbar:
            with autocast:
                with torch.no_grad():
                    teacher(im)
                student(im)
                loss = sum(F.mse_loss(s.float(), t.float())
                           for i in layers for s, t in zip(s_tap.outputs[i], t_tap.outputs[i]))
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            losses.append(float(loss.detach()))
            pbar.set_postfix(loss=f"{losses[-1]:.5f}", device=str(device))
    finally:
        s_tap.remove()
        t_tap.remove()
    return sum(losses) / max(len(losses), 1)


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
