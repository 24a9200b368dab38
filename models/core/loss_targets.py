"""Upstream's training loss with its targets padded per image without reading the device once per image.

Upstream's `ComputeLoss.preprocess` (detection and segmentation alike) pads the batch's targets to (images, most
targets in one image, 5) with a Python loop over the images, and each image costs three reads back to the host
(its count, the `if` on it, a boolean index): about 100 waits for the GPU per step at batch 32, each draining
the queue of work the compiled forward just launched. `padded_targets` gives the same tensor with one read (the
largest count, which the shape needs). The subclass changes nothing else of upstream's loss.
"""
from __future__ import annotations

import torch

from utils.general import xywh2xyxy


def padded_targets(targets: torch.Tensor, batch_size: int, scale: torch.Tensor, device) -> torch.Tensor:
    """(image, class, x, y, w, h) rows -> (batch_size, most rows of one image, 5): each image's (class, x1, y1, x2,
    y2) scaled by `scale`, in the order the rows came, zeros after them; what upstream's `preprocess` returns."""
    if targets.shape[0] == 0:
        return torch.zeros(batch_size, 0, 5, device=device)
    image = targets[:, 0].long()
    counts = torch.zeros(batch_size, dtype=torch.long, device=image.device).index_add_(
        0, image, torch.ones_like(image))  # bincount reads its largest value back to the host
    order = torch.sort(image, stable=True).indices  # each image's rows in the order they came
    first = counts.cumsum(0) - counts
    rows = image[order]
    out = torch.zeros(batch_size, int(counts.max()), 5, device=device)
    out[rows, torch.arange(len(rows), device=rows.device) - first[rows]] = targets[order, 1:].to(out)
    out[..., 1:5] = xywh2xyxy(out[..., 1:5].mul_(scale))
    return out


def with_padded_targets(loss_class: type) -> type:
    """`loss_class` (upstream's ComputeLoss for boxes or masks) with its `preprocess` as `padded_targets`."""

    class Loss(loss_class):
        def preprocess(self, targets, batch_size, scale_tensor):
            return padded_targets(targets, batch_size, scale_tensor, self.device)
    Loss.__name__ = Loss.__qualname__ = loss_class.__name__
    return Loss
