"""What a model predicts, decided once: detection, or instance segmentation (boxes plus masks).

A `Task` is the one place that knows the difference: the names of the exported outputs, the dataset loader
(segmentation batches carry instance masks), upstream's training loss, the metrics reported and the score that
picks a best epoch. The pipeline, the evaluation loop and the export take it as a parameter. It is read off a
PyTorch model (a head with a prototype branch) or off a deployed graph's outputs (a prototype output), by one
rule: a model that outputs mask prototypes is a segmentation model. A segmentation task also says which masks its
fine-tune trains on: the ones the float model was trained on (`trained_with`), so that the loader and the loss agree.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils.results import selection_score

BOX_METRICS = ("ap", "ap50", "precision", "recall")
MASK_METRICS = ("mask_ap", "mask_ap50", "mask_precision", "mask_recall")
MASK_DOWNSAMPLE = 4  # training's ground-truth masks at the prototypes' resolution, as segment/train.py has them
PROTOTYPES = "output1"
END_TO_END_MASKS = "det_masks"


@dataclass(frozen=True)
class Task:
    name: str
    output_names: tuple[str, ...]
    metric_keys: tuple[str, ...]
    overlap: bool = True  # segmentation training masks: one per image (upstream's default) or each instance's own

    @property
    def has_masks(self) -> bool:
        return PROTOTYPES in self.output_names

    def trained_with(self, overlap: bool) -> Task:
        """This task training on one mask per image (`overlap`) or on every instance's full mask (upstream's
        --no-overlap). A fine-tune trains on what its float model was trained on: a model that learned full masks
        and is fine-tuned on overlap masks learns to cut the smaller instances out of the larger ones again."""
        return replace(self, overlap=overlap) if self.has_masks else self

    @property
    def training_masks(self) -> str | None:
        """How the training masks are made, for reports: "overlap" or "full" (None: no masks)."""
        return ("overlap" if self.overlap else "full") if self.has_masks else None

    def dataloader(self, path, imgsz: int, batch_size: int, stride: int, scoring: bool = False, **kwargs):
        """Upstream's loader for the task: (loader, dataset). Segmentation batches also carry the instance masks:
        for training (the loss), at 1/4 resolution, overlapping instances in one mask per image as upstream trains
        by default, or each instance's own (`overlap` off); for `scoring`, every instance's full mask at the input's
        resolution, as upstream's segment/val.py scores (with one mask per image, a smaller instance cuts its area
        out of a larger one it lies on: a damage on a panel takes a median 26-35 % out of most panels of
        cardamage-seg's val labels)."""
        if self.has_masks:
            from utils.segment.dataloaders import create_dataloader
            return create_dataloader(path, imgsz, batch_size, stride, overlap_mask=self.overlap and not scoring,
                                     mask_downsample_ratio=1 if scoring else MASK_DOWNSAMPLE, **kwargs)
        from utils.dataloaders import create_dataloader
        return create_dataloader(path, imgsz, batch_size, stride, **kwargs)

    def scored_masks(self, masks: torch.Tensor, imgsz: tuple[int, int]) -> torch.Tensor:
        """A scoring batch's full instance masks as segment/val.py compares them with predicted ones: resized to the
        prototypes' resolution (bilinear, > 0.5). segment/val.py resizes per image when it scores; done once per
        batch here, the same pixels (each mask is resized on its own), so a kept batch holds 1/16 of them."""
        shape = (imgsz[0] // MASK_DOWNSAMPLE, imgsz[1] // MASK_DOWNSAMPLE)
        if not len(masks):
            return masks.new_zeros(0, *shape, dtype=torch.float32)
        return F.interpolate(masks[None].float(), shape, mode="bilinear", align_corners=False)[0].gt_(0.5)

    def loss(self, model: nn.Module):
        """Upstream's training loss for `model` (which must carry `hyp`): a callable
        (predictions, targets, masks) -> loss summed over the batch; targets as the loader makes them (on the host),
        masks as this task's training loader makes them, on the model's device. Neither reads anything back from the
        device (models/core/sync_free_loss.py)."""
        from models.core.sync_free_loss import DetectionLoss, SegmentationLoss
        if self.has_masks:
            compute = SegmentationLoss(model, overlap=self.overlap)
            return lambda preds, targets, masks: compute(preds, targets, masks.float())[0]
        compute = DetectionLoss(model)
        return lambda preds, targets, masks: compute(_train_maps(preds), targets)[0]

    def score(self, metrics: dict) -> float:
        """What picks a best epoch: box mAP50-95, plus mask mAP50-95 for segmentation."""
        return selection_score(self.metrics(metrics))

    def metrics(self, values: dict) -> dict:
        """The task's metrics out of a larger dict."""
        return {k: values[k] for k in self.metric_keys if k in values}


DETECT = Task("detect", ("output0",), BOX_METRICS)
SEGMENT = Task("segment", ("output0", PROTOTYPES), BOX_METRICS + MASK_METRICS)
TASKS = {t.name: t for t in (DETECT, SEGMENT)}


def task_of(model: nn.Module) -> Task:
    """The task of a PyTorch YOLO model: its head has a prototype branch (Segment, DSegment) or not."""
    return SEGMENT if hasattr(model.model[-1], "proto") else DETECT


def task_of_outputs(names: list[str]) -> Task:
    """The task of a deployed graph, by its output names (what export_qat.py writes)."""
    return SEGMENT if PROTOTYPES in names or END_TO_END_MASKS in names else DETECT


def _train_maps(preds) -> list[torch.Tensor]:
    """The raw per-level maps a detection head returns in training mode, whichever mode produced `preds`."""
    if isinstance(preds, (list, tuple)) and len(preds) == 2 and isinstance(preds[1], (list, tuple)):
        return list(preds[1])
    return list(preds)
