"""Upstream's training loss without waiting for the GPU.

Upstream's detection loss (`utils/loss_tal.py`) reads the device back wherever it needs a value on the host: each
image's target count to pad the targets (three reads an image), the assigner's labels (copied into a CPU index
tensor), whether an anchor lies in two boxes (`fg_mask.max() > 1`), the normaliser `max(target_scores.sum(), 1)`,
whether any anchor is foreground, and the foreground anchors' boxes and distributions (`masked_select`, whose
size the host must learn), and the anchors' strides (`torch.full` with a device scalar). Each read waits for all
the work queued before it: in the fine-tuning step, the compiled forward; the host then launches the loss's few
hundred small kernels one wait at a time while the GPU idles between them. `DetectionLoss` computes the same value
with no read:
- the targets padded on the host, from the loader's CPU tensor (the one read there is of host memory), and copied
  to the device without a wait (pinned, non-blocking);
- the strides read once, when the loss is made; the assigner's indices built on the device; its resolution of
  anchors in two boxes applied always (it changes nothing where none is);
- the box and DFL losses over every anchor, weighted by the foreground mask instead of selecting it, with the
  background anchors' boxes replaced first by their own grid cell, so that no degenerate prediction there makes a
  NaN that a zero weight would not cancel in the backward pass;
- `clamp_min(1)` for `max(..., 1)`.
Its loss equals upstream's within float rounding: the same terms, summed in another order (tests/test_finetune.py).
`SegmentationLoss` does the same for upstream's segmentation loss (`utils/segment/loss_tal.py`), whose mask term
crops each image's foreground instances in a loop that reads each image's foreground count: here each image takes
as many anchors as it can have in the foreground (the assigner's `topk` for each of its boxes, known on the host),
foreground first, the rest weighted out. On 8 mosaics of COCO128 at 640 px (up to 99 boxes an image), the loss's
forward and backward on 2 CPU threads: 1.2 s against upstream's 0.7-0.8 (the anchors weighted out are computed too)
and no higher a peak of memory; on an H200, QAT 1.09x faster than with upstream's loss
(results/scaling/h200x2/2026-11-30-f/: without its waits, the host queues the loss while the GPU still runs the
forward).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from utils.general import xywh2xyxy
from utils.loss_tal import BboxLoss, ComputeLoss
from utils.metrics import bbox_iou
from utils.segment.general import crop_mask
from utils.tal.anchor_generator import bbox2dist, make_anchors
from utils.tal.assigner import TaskAlignedAssigner
from utils.torch_utils import de_parallel


def row_places(image: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each row of a batch goes when rows are padded by image: the rows' order (each image's in the order they
    came), then for each row in that order its image and its slot within the image; and each image's row count."""
    counts = torch.zeros(batch_size, dtype=torch.long, device=image.device).index_add_(
        0, image, torch.ones_like(image))  # bincount reads its largest value back to the host
    order = torch.sort(image, stable=True).indices
    rows = image[order]
    slots = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    return order, rows, slots, counts


def padded_rows(targets: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(image, class, x, y, w, h) rows -> (batch_size, most rows of one image, 5): each image's (class, x, y, w, h)
    in the order the rows came, zeros after them. Reads the largest count back to wherever `targets` is."""
    if targets.shape[0] == 0:
        return targets.new_zeros(batch_size, 0, 5)
    order, rows, slots, counts = row_places(targets[:, 0].long(), batch_size)
    out = targets.new_zeros(batch_size, int(counts.max()), 5)
    out[rows, slots] = targets[order, 1:]
    return out


def padded_targets(targets: torch.Tensor, batch_size: int, scale: torch.Tensor, device) -> torch.Tensor:
    """What upstream's `preprocess` returns, on `device`: each image's (class, x1, y1, x2, y2) scaled by `scale`,
    zeros after them. Padded where `targets` is (on the host, no wait for the device), then copied."""
    out = padded_rows(targets.float(), batch_size)
    out[..., 1:5] = xywh2xyxy(out[..., 1:5].mul_(scale.to(out)))
    return queued_copy(out, device)


def queued_copy(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`, the copy queued behind the device's work: a blocking copy to a GPU waits for that work
    first, and CUDA may make one from pageable memory wait too, so the source is pinned first."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def highest_overlaps(mask_pos: torch.Tensor, overlaps: torch.Tensor, n_max_boxes: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upstream's `select_highest_overlaps` without its `if fg_mask.max() > 1`: an anchor in several boxes keeps
    the one it overlaps most; where no anchor is in two, the `where` keeps every mask as it was."""
    fg_mask = mask_pos.sum(-2)
    multi = (fg_mask.unsqueeze(1) > 1).expand(-1, n_max_boxes, -1)
    is_max = F.one_hot(overlaps.argmax(1), n_max_boxes).permute(0, 2, 1).to(overlaps.dtype)
    mask_pos = torch.where(multi, is_max, mask_pos)
    return mask_pos.argmax(-2), mask_pos.sum(-2), mask_pos


class DeviceAssigner(TaskAlignedAssigner):
    """Upstream's task-aligned assigner, its indices on the device and its branch on the host removed. Returns what
    segmentation's returns: labels, boxes, scores, the foreground mask and each anchor's box index."""

    @torch.no_grad()
    def forward(self, pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt):
        self.bs, self.n_max_boxes = pd_scores.shape[0], gt_bboxes.shape[1]
        if self.n_max_boxes == 0:
            return (torch.full_like(pd_scores[..., 0], self.bg_idx), torch.zeros_like(pd_bboxes),
                    torch.zeros_like(pd_scores), torch.zeros_like(pd_scores[..., 0]).bool(),
                    torch.zeros_like(pd_scores[..., 0], dtype=torch.long))
        mask_pos, align_metric, overlaps = self.get_pos_mask(pd_scores, pd_bboxes, gt_labels, gt_bboxes, anc_points,
                                                             mask_gt)
        target_gt_idx, fg_mask, mask_pos = highest_overlaps(mask_pos, overlaps, self.n_max_boxes)
        target_labels, target_bboxes, target_scores = self.get_targets(gt_labels, gt_bboxes, target_gt_idx, fg_mask)
        align_metric *= mask_pos
        pos_align_metrics = align_metric.amax(axis=-1, keepdim=True)
        pos_overlaps = (overlaps * mask_pos).amax(axis=-1, keepdim=True)
        norm_align_metric = (align_metric * pos_overlaps / (pos_align_metrics + self.eps)).amax(-2).unsqueeze(-1)
        return target_labels, target_bboxes, target_scores * norm_align_metric, fg_mask.bool(), target_gt_idx

    def get_box_metrics(self, pd_scores, pd_bboxes, gt_labels, gt_bboxes):
        images = torch.arange(self.bs, device=pd_scores.device)[:, None]
        bbox_scores = pd_scores[images, :, gt_labels.squeeze(-1).long()]  # (b, max_num_obj, h*w)
        overlaps = bbox_iou(gt_bboxes.unsqueeze(2), pd_bboxes.unsqueeze(1), xywh=False, CIoU=True).squeeze(3).clamp(0)
        return bbox_scores.pow(self.alpha) * overlaps.pow(self.beta), overlaps


class WeightedBboxLoss(BboxLoss):
    """Upstream's IoU and DFL losses over every anchor, each weighted by its target score (0 off the foreground),
    instead of over the foreground anchors selected."""

    def forward(self, pred_dist, pred_bboxes, anchor_points, target_bboxes, target_scores, target_scores_sum,
                fg_mask):
        fg = fg_mask.unsqueeze(-1)
        cells = torch.cat((anchor_points - 0.5, anchor_points + 0.5), -1)  # a finite CIoU wherever it is used
        pred_bboxes = torch.where(fg, pred_bboxes, cells.to(pred_bboxes.dtype))
        target_bboxes = torch.where(fg, target_bboxes, cells.to(target_bboxes.dtype))
        weight = torch.where(fg, target_scores.sum(-1, keepdim=True), 0)
        iou = bbox_iou(pred_bboxes, target_bboxes, xywh=False, CIoU=True)
        loss_iou = ((1.0 - iou) * weight).sum() / target_scores_sum
        if not self.use_dfl:
            return loss_iou, pred_dist.new_zeros((), dtype=torch.float32), iou
        target_ltrb = bbox2dist(anchor_points, target_bboxes, self.reg_max)
        loss_dfl = (self._df_loss(pred_dist, target_ltrb) * weight).sum() / target_scores_sum
        return loss_iou, loss_dfl, iou


class Assigned(NamedTuple):
    """What the assigner gave the box terms that the mask term reads too."""
    boxes: torch.Tensor        # (b, anchors, 4): each anchor's target box, xyxy in pixels
    foreground: torch.Tensor   # (b, anchors) bool
    box_index: torch.Tensor    # (b, anchors): the index of that box among its image's targets
    most_boxes: int            # the most targets of one image in the batch (known on the host)
    size: tuple[float, float]  # the image's width and height in pixels


class DetectionLoss(ComputeLoss):
    """Upstream's detection loss (`utils/loss_tal.py` ComputeLoss: its settings, gains and value) with no read of
    the device: call with the head's training maps and the loader's targets, on the host as it makes them."""

    def __init__(self, model):
        super().__init__(model)
        assigner = self.assigner
        self.assigner = DeviceAssigner(assigner.topk, assigner.num_classes, assigner.alpha, assigner.beta)
        self.bbox_loss = WeightedBboxLoss(self.reg_max - 1, use_dfl=self.use_dfl)
        self.strides = [float(s) for s in self.stride]  # read once, here

    def __call__(self, p, targets, img=None, epoch=0):
        feats = p[1] if isinstance(p, tuple) else p
        box, cls, dfl, _ = self.box_terms(feats, targets)
        loss = torch.stack((box.float() * 7.5, cls.float() * 0.5, dfl.float() * 1.5))  # upstream's gains
        return loss.sum() * feats[0].shape[0], loss.detach()

    @staticmethod
    def normaliser(target_scores_sum: torch.Tensor) -> torch.Tensor:
        """What the box and class terms are divided by: upstream's max(sum of target scores, 1)."""
        return target_scores_sum.clamp_min(1)

    def box_terms(self, feats, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Assigned]:
        """The box (IoU), class and DFL terms before upstream's gains, and the assignment they used."""
        batch_size, (h, w) = feats[0].shape[0], feats[0].shape[2:]
        pred_distri, pred_scores = torch.cat([xi.view(batch_size, self.no, -1) for xi in feats], 2).split(
            (self.reg_max * 4, self.nc), 1)
        pred_scores = pred_scores.permute(0, 2, 1).contiguous()
        pred_distri = pred_distri.permute(0, 2, 1).contiguous()
        anchor_points, stride_tensor = make_anchors(feats, self.strides, 0.5)
        size = torch.tensor([w, h, w, h], dtype=torch.float32) * self.strides[0]  # the image size, on the host
        gt_labels, gt_bboxes = padded_targets(targets, batch_size, size, self.device).split((1, 4), 2)
        mask_gt = gt_bboxes.sum(2, keepdim=True).gt_(0)
        pred_bboxes = self.bbox_decode(anchor_points, pred_distri)
        _, target_bboxes, target_scores, fg_mask, target_gt_idx = self.assigner(
            pred_scores.detach().sigmoid(), (pred_bboxes.detach() * stride_tensor).type(gt_bboxes.dtype),
            anchor_points * stride_tensor, gt_labels, gt_bboxes, mask_gt)
        target_scores_sum = self.normaliser(target_scores.sum())
        cls = self.BCEcls(pred_scores, target_scores.to(pred_scores.dtype)).sum() / target_scores_sum
        box, dfl, _ = self.bbox_loss(pred_distri, pred_bboxes, anchor_points, target_bboxes / stride_tensor,
                                     target_scores, target_scores_sum, fg_mask)
        return box, cls, dfl, Assigned(target_bboxes, fg_mask, target_gt_idx, gt_bboxes.shape[1],
                                       (float(size[0]), float(size[1])))


class SegmentationLoss(DetectionLoss):
    """Upstream's segmentation loss (`utils/segment/loss_tal.py` ComputeLoss: its settings, gains and value) with no
    read of the device: call with the head's training outputs (maps, mask coefficients, prototypes), the loader's
    targets on the host and its masks on the device (`overlap`: one mask an image, each pixel its instance's number,
    as upstream trains by default; else each instance's own mask, in the targets' order)."""

    def __init__(self, model, overlap: bool = True):
        super().__init__(model)
        self.nm, self.overlap = de_parallel(model).model[-1].nm, overlap

    def __call__(self, p, targets, masks, img=None, epoch=0):
        feats, pred_masks, proto = p if len(p) == 3 else p[1]
        box, cls, dfl, assigned = self.box_terms(feats, targets)
        seg = self.mask_term(pred_masks, proto, masks, targets, assigned)
        batch_size = proto.shape[0]
        loss = torch.stack((box.float() * 7.5, seg.float() * 2.5 / batch_size, cls.float() * 0.5, dfl.float() * 1.5))
        return loss.sum() * batch_size, loss.detach()

    @staticmethod
    def normaliser(target_scores_sum: torch.Tensor) -> torch.Tensor:
        """Upstream's segmentation loss divides by the sum of target scores as it is (also below 1): the same here,
        except where it is 0 (no foreground anchor), which upstream turns into an infinite class term."""
        return torch.where(target_scores_sum > 0, target_scores_sum, 1)

    def mask_term(self, pred_masks, proto, masks, targets, assigned: Assigned) -> torch.Tensor:
        """Upstream's mask term: the sum over images of each image's mean over its foreground anchors of the cropped
        BCE over the area of the anchor's box. An image's foreground anchors are at most `topk` for each of its boxes,
        a count the host knows from the targets, so each image takes that many anchors, foreground first (in anchor
        order, as upstream selects them), the rest weighted 0: no read of the device. Each image's per-pixel part is
        kept for the backward pass, as upstream keeps its own: computing it again there (torch.utils.checkpoint) made
        QAT of 32 images at 640 px on an H200 24 % slower than with upstream's loss; kept, 9 % faster."""
        batch_size, _, mask_h, mask_w = proto.shape
        if tuple(masks.shape[-2:]) != (mask_h, mask_w):
            masks = F.interpolate(masks[None], (mask_h, mask_w), mode="nearest")[0]
        # image i reads masks[i] (its instances' numbers), as upstream's loop does; or its own instances' masks
        truth = masks[:batch_size] if self.overlap else by_image(masks, targets, batch_size, assigned.most_boxes)
        boxes_of = torch.bincount(targets[:, 0].long(), minlength=batch_size).tolist()  # host targets: no device read
        terms = [self.image_mask_term(pred_masks[i], proto[i], truth[i], assigned.boxes[i], assigned.foreground[i],
                                      assigned.box_index[i], self.assigner.topk * n, assigned.size)
                 for i, n in enumerate(boxes_of) if n]
        return torch.stack(terms).sum() if terms else proto.new_zeros((), dtype=torch.float32)

    def image_mask_term(self, coefficients, proto, truth, boxes, foreground, box_index, most: int,
                        size: tuple[float, float]) -> torch.Tensor:
        """One image's mask term over its first `most` anchors by foreground."""
        (mask_h, mask_w), (w, h) = proto.shape[1:], size
        anchors = foreground.to(torch.uint8).sort(descending=True, stable=True).indices[:most]
        weight = foreground[anchors].float()
        index = box_index[anchors]
        if self.overlap:
            gt_mask = (truth[None] == (index + 1)[:, None, None].to(truth.dtype)).float()
        else:
            gt_mask = truth[index]
        box = boxes[anchors]
        x1, y1, x2, y2 = box[:, 0] / w, box[:, 1] / h, box[:, 2] / w, box[:, 3] / h  # as fractions of the image
        area = torch.where(weight > 0, (x2 - x1) * (y2 - y1), 1)
        mxyxy = torch.stack((x1 * mask_w, y1 * mask_h, x2 * mask_w, y2 * mask_h), -1)  # (no host tensor to copy)
        pred = (coefficients[:, anchors].T @ proto.view(self.nm, -1)).view(-1, mask_h, mask_w)
        loss = crop_mask(F.binary_cross_entropy_with_logits(pred, gt_mask, reduction="none"), mxyxy)
        return (loss.mean(dim=(1, 2)) / area * weight).sum() / weight.sum().clamp_min(1)


def by_image(masks: torch.Tensor, targets: torch.Tensor, batch_size: int, most_boxes: int) -> torch.Tensor:
    """Instance masks in the targets' order (n, h, w) -> (batch_size, most_boxes, h, w), padded as `padded_rows`
    pads their targets; the places worked out on the host, from the targets' image column."""
    order, rows, slots, _ = (queued_copy(t, masks.device) for t in row_places(targets[:, 0].long(), batch_size))
    out = masks.new_zeros(batch_size, most_boxes, *masks.shape[1:])
    out[rows, slots] = masks[order]
    return out
