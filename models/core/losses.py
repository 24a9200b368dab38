"""What a quantized detector is taught, and judged, by: the difference between its head's outputs and the float
model's. QAT distils with it (models/finetuning/finetune.py); the per-quantizer ranges are chosen by it
(models/quantization/ranges.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def feature_maps(out) -> list[torch.Tensor]:
    """A layer's output as a list of tensors; a head's as what training mode returns (raw per-level maps, then
    the mask coefficients and prototypes of a segmentation head), whichever mode produced it."""
    maps, coef, proto = split_head_output(out)
    return maps + [t for t in (coef, proto) if t is not None]


def split_head_output(out) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """(raw per-level maps, mask coefficients (B, nm, A), prototypes (B, nm, H, W)) of a detection or segmentation
    head's output in train or eval mode; the mask parts are None for detection (and any other layer)."""
    if isinstance(out, torch.Tensor):
        return [out], None, None
    if len(out) == 2 and isinstance(out[1], (list, tuple)):
        out = out[1]  # eval mode: (decoded predictions, what training mode returns)
    if len(out) == 3 and isinstance(out[0], (list, tuple)):
        return list(out[0]), out[1], out[2]
    return [t for t in out if isinstance(t, torch.Tensor)], None, None


def head_distill_loss(student: list[torch.Tensor], teacher: list[torch.Tensor], nc: int, reg_max: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Distillation on what the detector outputs, per anchor of every level (B, 4*reg_max + nc, H, W):

    - class scores: binary cross-entropy of the student's logits against the teacher's probabilities, minus
      the teacher's own entropy (0 when they agree). Unlike MSE on logits, background anchors whose scores
      are saturated near 0 contribute (almost) nothing;
    - boxes: KL divergence of the student's DFL distributions (4 sides x reg_max bins) from the teacher's,
      weighted by the teacher's highest class probability, so boxes count where the teacher sees objects.
    Both are normalised by the summed weights, as upstream's loss is by its target scores. Returns the loss and
    the weights (B, A), which pick the anchors whose masks are distilled.
    """
    cls_loss = box_loss = 0.0
    weight_sum = 0.0
    weights = []
    for s, t in zip(student, teacher):
        b = s.shape[0]
        s, t = s.float().flatten(2), t.float().flatten(2)  # (B, C, A)
        s_box, s_cls = s.split((4 * reg_max, nc), 1)
        t_box, t_cls = t.split((4 * reg_max, nc), 1)
        t_prob = t_cls.sigmoid()
        cls_loss = cls_loss + (F.binary_cross_entropy_with_logits(s_cls, t_prob, reduction="sum")
                               - F.binary_cross_entropy_with_logits(t_cls, t_prob, reduction="sum"))
        weight = t_prob.amax(1)  # (B, A)
        t_dist = t_box.view(b, 4, reg_max, -1).softmax(2)
        s_logp = s_box.view(b, 4, reg_max, -1).log_softmax(2)
        kl = (t_dist * (t_dist.clamp_min(1e-9).log() - s_logp)).sum((1, 2))  # (B, A)
        box_loss = box_loss + (kl * weight).sum()
        weight_sum = weight_sum + weight.sum()
        weights.append(weight)
    return (cls_loss + box_loss) / weight_sum.clamp_min(1.0), torch.cat(weights, 1)


def mask_distill_loss(s_coef: torch.Tensor, t_coef: torch.Tensor, s_proto: torch.Tensor, t_proto: torch.Tensor,
                      weight: torch.Tensor, top_k: int = 32) -> torch.Tensor:
    """Distillation on the masks a segmentation head outputs: for the `top_k` anchors per image where the teacher
    is most confident, the student's mask logits (its coefficients times its prototypes) against the teacher's
    mask probabilities, binary cross-entropy minus the teacher's entropy, weighted by that confidence. The masks
    themselves, not coefficients and prototypes apart: either can drift wherever the product stays the same."""
    k = min(top_k, weight.shape[1])
    conf, idx = weight.topk(k, dim=1)  # (B, k)

    def masks(coef, proto):
        picked = coef.float().gather(2, idx.unsqueeze(1).expand(-1, coef.shape[1], -1))  # (B, nm, k)
        return torch.einsum("bnk,bnhw->bkhw", picked, proto.float())

    s_logit, t_logit = masks(s_coef, s_proto), masks(t_coef, t_proto)
    t_prob = t_logit.sigmoid()
    bce = (F.binary_cross_entropy_with_logits(s_logit, t_prob, reduction="none")
           - F.binary_cross_entropy_with_logits(t_logit, t_prob, reduction="none")).mean((2, 3))  # (B, k)
    return (bce * conf).sum() / conf.sum().clamp_min(1e-6)


def head_distillation(student_out, teacher_out, nc: int, reg_max: int
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distillation loss between two heads' outputs (training or eval mode): `head_distill_loss`, plus
    `mask_distill_loss` for a segmentation head (returned apart as well; None for detection)."""
    s_maps, s_coef, s_proto = split_head_output(student_out)
    t_maps, t_coef, t_proto = split_head_output(teacher_out)
    loss, weights = head_distill_loss(s_maps, t_maps, nc, reg_max)
    if s_coef is None:
        return loss, None
    mask_loss = mask_distill_loss(s_coef, t_coef, s_proto, t_proto, weights)
    return loss + mask_loss, mask_loss
