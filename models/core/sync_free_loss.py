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
Segmentation keeps upstream's loss, which crops each image's instances in a loop that reads each image's
foreground count; only its targets are padded here, with one read (`with_padded_targets`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from utils.general import xywh2xyxy
from utils.loss_tal import BboxLoss, ComputeLoss
from utils.metrics import bbox_iou
from utils.tal.anchor_generator import bbox2dist, make_anchors
from utils.tal.assigner import TaskAlignedAssigner


def padded_rows(targets: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(image, class, x, y, w, h) rows -> (batch_size, most rows of one image, 5): each image's (class, x, y, w, h)
    in the order the rows came, zeros after them. Reads the largest count back to wherever `targets` is."""
    if targets.shape[0] == 0:
        return targets.new_zeros(batch_size, 0, 5)
    image = targets[:, 0].long()
    counts = torch.zeros(batch_size, dtype=torch.long, device=image.device).index_add_(
        0, image, torch.ones_like(image))  # bincount reads its largest value back to the host
    order = torch.sort(image, stable=True).indices  # each image's rows in the order they came
    first = counts.cumsum(0) - counts
    rows = image[order]
    out = targets.new_zeros(batch_size, int(counts.max()), 5)
    out[rows, torch.arange(len(rows), device=rows.device) - first[rows]] = targets[order, 1:]
    return out


def padded_targets(targets: torch.Tensor, batch_size: int, scale: torch.Tensor, device) -> torch.Tensor:
    """What upstream's `preprocess` returns, on `device`: each image's (class, x1, y1, x2, y2) scaled by `scale`,
    zeros after them. Padded where `targets` is (on the host, no wait for the device), then copied."""
    out = padded_rows(targets.float(), batch_size)
    out[..., 1:5] = xywh2xyxy(out[..., 1:5].mul_(scale.to(out)))
    device = torch.device(device)
    if device.type == "cuda" and out.device.type == "cpu":
        out = out.pin_memory()  # a pinned source: the copy is queued, the host goes on
    return out.to(device, non_blocking=True)


def with_padded_targets(loss_class: type) -> type:
    """`loss_class` (upstream's ComputeLoss for boxes or masks) with its `preprocess` as `padded_targets`."""

    class Loss(loss_class):
        def preprocess(self, targets, batch_size, scale_tensor):
            return padded_targets(targets, batch_size, scale_tensor, self.device)
    Loss.__name__ = Loss.__qualname__ = loss_class.__name__
    return Loss


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
    """Upstream's task-aligned assigner, its indices on the device and its branch on the host removed."""

    @torch.no_grad()
    def forward(self, pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt):
        self.bs, self.n_max_boxes = pd_scores.shape[0], gt_bboxes.shape[1]
        if self.n_max_boxes == 0:
            return (torch.full_like(pd_scores[..., 0], self.bg_idx), torch.zeros_like(pd_bboxes),
                    torch.zeros_like(pd_scores), torch.zeros_like(pd_scores[..., 0]).bool())
        mask_pos, align_metric, overlaps = self.get_pos_mask(pd_scores, pd_bboxes, gt_labels, gt_bboxes, anc_points,
                                                             mask_gt)
        target_gt_idx, fg_mask, mask_pos = highest_overlaps(mask_pos, overlaps, self.n_max_boxes)
        target_labels, target_bboxes, target_scores = self.get_targets(gt_labels, gt_bboxes, target_gt_idx, fg_mask)
        align_metric *= mask_pos
        pos_align_metrics = align_metric.amax(axis=-1, keepdim=True)
        pos_overlaps = (overlaps * mask_pos).amax(axis=-1, keepdim=True)
        norm_align_metric = (align_metric * pos_overlaps / (pos_align_metrics + self.eps)).amax(-2).unsqueeze(-1)
        return target_labels, target_bboxes, target_scores * norm_align_metric, fg_mask.bool()

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
        batch_size, (h, w) = feats[0].shape[0], feats[0].shape[2:]
        pred_distri, pred_scores = torch.cat([xi.view(batch_size, self.no, -1) for xi in feats], 2).split(
            (self.reg_max * 4, self.nc), 1)
        pred_scores = pred_scores.permute(0, 2, 1).contiguous()
        pred_distri = pred_distri.permute(0, 2, 1).contiguous()
        anchor_points, stride_tensor = make_anchors(feats, self.strides, 0.5)
        scale = torch.tensor([w, h, w, h], dtype=torch.float32) * self.strides[0]  # the image size, on the host
        gt_labels, gt_bboxes = padded_targets(targets, batch_size, scale, self.device).split((1, 4), 2)
        mask_gt = gt_bboxes.sum(2, keepdim=True).gt_(0)
        pred_bboxes = self.bbox_decode(anchor_points, pred_distri)
        target_labels, target_bboxes, target_scores, fg_mask = self.assigner(
            pred_scores.detach().sigmoid(), (pred_bboxes.detach() * stride_tensor).type(gt_bboxes.dtype),
            anchor_points * stride_tensor, gt_labels, gt_bboxes, mask_gt)
        target_bboxes /= stride_tensor
        target_scores_sum = target_scores.sum().clamp_min(1)
        cls = self.BCEcls(pred_scores, target_scores.to(pred_scores.dtype)).sum() / target_scores_sum
        box, dfl, _ = self.bbox_loss(pred_distri, pred_bboxes, anchor_points, target_bboxes, target_scores,
                                     target_scores_sum, fg_mask)
        loss = torch.stack((box.float() * 7.5, cls.float() * 0.5, dfl.float() * 1.5))  # upstream's gains
        return loss.sum() * batch_size, loss.detach()
