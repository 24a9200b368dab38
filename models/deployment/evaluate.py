"""The one evaluation loop: COCO-style box (and mask) mAP of any runner (models/deployment/runners.py) on a dataset.

PyTorch, ONNX Runtime and TensorRT are measured through the same code: the same square letterbox (the input a
deployed engine of fixed height and width sees), the same NMS, the same matching and upstream's `ap_per_class`.
A graph with NMS inside (`num_dets`, `det_boxes`, ...) is read through those outputs.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from tqdm import tqdm

from models.core.task import Task
from utils.general import LOGGER, TQDM_BAR_FORMAT, colorstr, scale_boxes, xywh2xyxy
from utils.metrics import ap_per_class, box_iou

IOU_THRESHOLDS = torch.linspace(0.5, 0.95, 10)
END_TO_END = ("num_dets", "det_boxes", "det_scores", "det_classes")


@dataclass(frozen=True)
class NMSConfig:
    """Post-processing of raw predictions: upstream val's defaults (every box that could count for mAP)."""
    conf_thres: float = 0.001
    iou_thres: float = 0.7
    max_det: int = 300
    nms_free: bool = False  # take the best class per anchor, no NMS (NMS-free heads)


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
class FirstBatches:
    """The first `n` batches of a loader, with a length; the same images on every pass; each batch through `prepare`
    (a pure function of the batch) if given."""

    def __init__(self, loader, n: int | None, prepare: Callable[[tuple], tuple] | None = None):
        self.loader, self.n = loader, (len(loader) if n is None else min(n, len(loader)))
        self.batch_size, self.prepare = loader.batch_size, prepare

    def __iter__(self):
        batches = itertools.islice(iter(self.loader), self.n)
        return batches if self.prepare is None else map(self.prepare, batches)

    def __len__(self):
        return self.n


class KeptBatches:
    """A FirstBatches whose batches are decoded on the first whole pass and kept for every later one. A run evaluates
    on its select images again and again (the float model, each calibration candidate, each mixed-precision set,
    each epoch), and decoding them each time costs more than a GPU's forward of them. Valid while the image files
    are those of the first pass: a run does not expect its data to change under it. Nobody may modify a batch in
    place (evaluate() does not). A pass left early (`next(iter(...))`) keeps nothing."""

    def __init__(self, loader: FirstBatches):
        self.loader, self.batch_size = loader, loader.batch_size
        self.batches: list | None = None

    def __iter__(self):
        return iter(self.batches) if self.batches is not None else self._first_pass()

    def _first_pass(self):
        batches = []
        for batch in self.loader:
            batches.append(batch)
            yield batch
        self.batches = batches

    def __len__(self):
        return len(self.loader)


KEEP_BYTES = 1 << 30  # decoded images kept in memory up to this size (1,000 images at 640 px: 1.2 GB)


def kept_in_memory(loader: FirstBatches, imgsz: int, limit: int = KEEP_BYTES) -> FirstBatches | KeptBatches:
    """`loader` with its batches kept after the first pass (KeptBatches) if its images fit in `limit` bytes."""
    return KeptBatches(loader) if len(loader) * loader.batch_size * 3 * imgsz * imgsz <= limit else loader


def val_loader(task: Task, data_dict: dict, imgsz: int, batch_size: int, workers: int, num_image: int | None = None,
               data: str | Path = "", split: str = "val") -> FirstBatches:
    """Square letterboxed batches of the `split` images (pad 0.5 of a stride, as upstream val); for segmentation
    with every instance's full mask, as segment/val.py scores (Task.scored_masks). Refuses a split without images or
    without a single label: every metric would be 0 and a 'best' epoch picked on noise."""
    try:
        loader, dataset = task.dataloader(data_dict[split], imgsz, batch_size, 32, scoring=True, pad=0.5, rect=False,
                                          workers=workers, close_mosaic=True, prefix=colorstr(f"{split}: "))
    except Exception as e:  # upstream raises a bare Exception for an empty or unreadable image folder
        raise ValueError(f"--data {data}: {split} {data_dict[split]}: {e}".split("\n")[0]) from None
    if sum(len(labels) for labels in dataset.labels) == 0:
        raise ValueError(f"--data {data}: the {len(dataset)} {split} images have no labels (looked for "
                         f"{Path(dataset.label_files[0]).parent}/*.txt); mAP would be 0 for every model")
    prepare = (lambda b: (*b[:4], task.scored_masks(b[4], b[0].shape[2:]), *b[5:])) if task.has_masks else None
    return FirstBatches(loader, None if num_image is None else math.ceil(num_image / batch_size), prepare)


def check_outputs(runner, task: Task, nc: int, model: str | Path) -> None:
    """Refuse a model whose outputs this loop cannot read for `nc` classes: predictions must be
    [batch, 4 + nc (+ nm mask coefficients), anchors] (not DeepStream's [batch, anchors, 6]), with the
    prototypes [batch, nm, h, w] for segmentation; or the end-to-end outputs (num_dets, det_boxes, ...)."""
    names = list(runner.output_names)
    if "num_dets" in names:
        return
    shapes = getattr(runner, "output_shapes", {})
    pred = shapes.get(names[0])
    if pred is None:  # PyTorch: shapes follow from the model, which was checked against --data
        return
    if len(pred) != 3:
        raise ValueError(f"{model}: output {names[0]} has shape {pred}; expected [batch, 4 + {nc}, anchors]")
    nm = 0
    if task.has_masks:
        proto = shapes.get(task.output_names[1])
        if proto is None or len(proto) != 4:
            raise ValueError(f"{model}: a segmentation model needs the prototypes [batch, nm, h, w] as "
                             f"{task.output_names[1]}; its outputs are {names}")
        nm = proto[1] if isinstance(proto[1], int) else 0
    channels = pred[1]
    if isinstance(channels, int) and nm is not None and channels != 4 + nc + nm:
        hint = (" (DeepStream's [batch, anchors, 6] layout: evaluate export_qat.py's ONNX instead)"
                if pred[2] == 6 else "")
        raise ValueError(f"{model}: output {names[0]} has shape {pred}, expected [batch, {4 + nc + nm} "
                         f"(4 + nc{f' + {nm} mask coefficients' if nm else ''}), anchors] for the --data's {nc} "
                         f"classes{hint}")


# --------------------------------------------------------------------------------------------------
# Detections and matching
# --------------------------------------------------------------------------------------------------
def detections(outputs: dict[str, torch.Tensor], nms: NMSConfig, nm: int = 0) -> list[torch.Tensor]:
    """Per image (n, 6 + nm): x1, y1, x2, y2, confidence, class, mask coefficients, in network-input pixels."""
    if "num_dets" in outputs:  # NMS inside the graph
        n, boxes, scores, classes = (outputs[k] for k in END_TO_END)
        return [torch.cat([boxes[i, :int(n[i])], scores[i, :int(n[i]), None], classes[i, :int(n[i]), None].float()], 1)
                for i in range(len(n))]
    pred = outputs[next(iter(outputs))]
    if not nms.nms_free:
        return [multi_label_nms(x, nms, nm) for x in pred]
    out = []
    for x in pred.transpose(1, 2):  # best class per anchor, confidence filter, top max_det
        conf, cls = x[:, 4:].max(1)
        keep = conf > nms.conf_thres
        det = torch.cat([xywh2xyxy(x[keep, :4]), conf[keep, None], cls[keep, None].float()], 1)
        out.append(det[det[:, 4].argsort(descending=True)[:nms.max_det]])
    return out


MAX_NMS_BOXES = 30000  # upstream's cap on the boxes one image sends into NMS (highest confidence first)
CLASS_OFFSET = 7680     # upstream's per-class box offset: one NMS call keeps classes apart


def multi_label_nms(x: torch.Tensor, nms: NMSConfig, nm: int = 0) -> torch.Tensor:
    """Upstream val's NMS of one image's raw output (4 + nc + nm, anchors): every (box, class) pair above the
    confidence threshold, per-class NMS, the top max_det. The same result as upstream's `non_max_suppression(...,
    multi_label=True)`, without its wall-clock limit: that one stops mid-batch on a busy machine and returns no
    boxes for the remaining images, so the mAP (and every choice made on it) would depend on the machine's load."""
    nc = x.shape[0] - 4 - nm
    x = x.T[x[4:4 + nc].amax(0) > nms.conf_thres]
    box, cls, mask = x.split((4, nc, nm), 1)
    if nc > 1:
        i, j = (cls > nms.conf_thres).nonzero(as_tuple=False).T
        det = torch.cat((xywh2xyxy(box[i]), cls[i, j, None], j[:, None].float(), mask[i]), 1)
    else:
        det = torch.cat((xywh2xyxy(box), cls, torch.zeros_like(cls), mask), 1)
    det = det[det[:, 4].argsort(descending=True)[:MAX_NMS_BOXES]]
    keep = torchvision.ops.nms(det[:, :4] + det[:, 5:6] * CLASS_OFFSET, det[:, 4], nms.iou_thres)
    return det[keep[:nms.max_det]]


def match(iou: torch.Tensor, label_cls: torch.Tensor, pred_cls: torch.Tensor,
          thresholds: torch.Tensor = IOU_THRESHOLDS) -> torch.Tensor:
    """(n_pred, n_thresholds) booleans: prediction j is a true positive at threshold t. At each threshold,
    same-class (label, prediction) pairs with IoU >= t are taken greedily by IoU, each label and each prediction
    at most once: the COCO / upstream rule. `iou` is (n_labels, n_pred)."""
    correct = np.zeros((len(pred_cls), len(thresholds)), dtype=bool)
    same = label_cls[:, None] == pred_cls[None, :]
    for k, t in enumerate(thresholds):
        li, pi = torch.where((iou >= t) & same)
        if not len(li):
            continue
        pairs = np.stack([li.numpy(), pi.numpy(), iou[li, pi].numpy()], 1)
        pairs = pairs[pairs[:, 2].argsort()[::-1]]  # best IoU first
        pairs = pairs[np.unique(pairs[:, 1], return_index=True)[1]]  # one label per prediction
        pairs = pairs[np.unique(pairs[:, 0], return_index=True)[1]]  # one prediction per label
        correct[pairs[:, 1].astype(int), k] = True
    return torch.from_numpy(correct)


def mask_iou_instances(gt: torch.Tensor, pred_masks: torch.Tensor) -> torch.Tensor:
    """IoU (n_labels, n_pred) of predicted masks with each labelled instance's full mask, resized to the
    predictions' resolution if needed (segment/val.py's rule)."""
    from utils.segment.general import mask_iou
    gt = gt.float()
    if gt.shape[1:] != pred_masks.shape[1:]:
        gt = F.interpolate(gt[None], pred_masks.shape[1:], mode="bilinear", align_corners=False)[0].gt_(0.5)
    return mask_iou(gt.view(len(gt), -1), pred_masks.view(len(pred_masks), -1))


def summary(stats: list[np.ndarray], column: int, nc: int, prefix: str = "") -> dict:
    """Mean P, R, mAP50 and mAP50-95 of the true-positive column `column` (0: boxes, 1: masks)."""
    mp = mr = map50 = map_ = 0.0
    if len(stats) and stats[column].any():
        _, _, p, r, _, ap, _ = ap_per_class(stats[column], *stats[2:], plot=False, names={i: str(i) for i in range(nc)})
        mp, mr, map50, map_ = p.mean(), r.mean(), ap[:, 0].mean(), ap.mean(1).mean()
    return {f"{prefix}ap": round(float(map_), 5), f"{prefix}ap50": round(float(map50), 5),
            f"{prefix}precision": round(float(mp), 5), f"{prefix}recall": round(float(mr), 5)}


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
def evaluate(runner, loader, task: Task, nc: int, nms: NMSConfig = NMSConfig(), desc: str = "",
             keep_predictions: bool = False) -> dict:
    """Box (and mask) metrics of `runner` over `loader`'s batches, images/s of the runner alone, and with
    `keep_predictions` the COCO-json style box predictions (key "predictions")."""
    if desc:
        LOGGER.info(colorstr("eval: ") + desc)
    fixed_batch = runner.input_shape[0]
    stats, jdict, seen, t_infer = [], [] if keep_predictions else None, 0, 0.0
    with getattr(runner, "held", contextlib.nullcontext)(), _progress(loader, desc) as batches:
        for batch in batches:
            images = batch[0].float() / 255
            nb = len(images)
            if fixed_batch and nb < fixed_batch:  # an engine of fixed batch takes full batches only
                images = torch.cat([images, images.new_zeros(fixed_batch - nb, *images.shape[1:])])
            t0 = time.perf_counter()
            outputs = runner(images)
            t_infer += time.perf_counter() - t0
            stats += _batch_stats({k: v[:nb] for k, v in outputs.items()}, batch, task, nms, jdict)
            seen += nb
    metrics = _summaries(stats, task, nc)
    metrics.update({"images": seen, "ms_per_image": round(1000 * t_infer / max(seen, 1), 3)})
    if keep_predictions:
        metrics["predictions"] = jdict
    return metrics


def evaluate_each(outputs_of: Callable[[torch.Tensor], Iterator[tuple[str, dict]]], loader, task: Task, nc: int,
                  nms: NMSConfig = NMSConfig(), desc: str = "") -> dict[str, dict]:
    """The metrics of several variants of one model over the same batches, in one pass over `loader`:
    `outputs_of(images)` yields each variant's name and its outputs on a batch (as a runner returns them), in the
    same order for every batch. Each variant's metrics equal `evaluate`'s for a runner giving its outputs."""
    if desc:
        LOGGER.info(colorstr("eval: ") + desc)
    stats: dict[str, list] = {}
    seen = 0
    with _progress(loader, desc) as batches:
        for batch in batches:
            named = set()
            for name, outputs in outputs_of(batch[0].float() / 255):
                if name in named:  # its statistics would count this batch twice
                    raise ValueError(f"evaluate_each: variant {name!r} given twice for one batch")
                named.add(name)
                stats.setdefault(name, []).extend(_batch_stats(outputs, batch, task, nms, None))
            seen += len(batch[0])
    return {name: {**_summaries(s, task, nc), "images": seen} for name, s in stats.items()}


def _progress(loader, desc: str) -> tqdm:
    """The loader behind a bar; used as a context manager, so an interrupted loop closes it in place (a bar left to
    its __del__ at interpreter exit printed a traceback after Ctrl-C)."""
    return tqdm(loader, desc=colorstr("eval: ") + (desc or "evaluating"), bar_format=TQDM_BAR_FORMAT, leave=False)


def _summaries(stats: list[tuple], task: Task, nc: int) -> dict:
    stats = [torch.cat(x, 0).numpy() for x in zip(*stats)] if stats else []
    metrics = summary(stats, 0, nc)
    if task.has_masks:
        metrics.update(summary(stats, 1, nc, "mask_"))
    return metrics


def _batch_stats(outputs: dict[str, torch.Tensor], batch, task: Task, nms: NMSConfig, jdict: list | None
                 ) -> list[tuple]:
    """Per-image match statistics of one batch's outputs against its labels; its COCO-json predictions appended
    to `jdict` unless None. On one CPU thread: NMS, masks and IoUs are many small operations, which more threads
    barely speed up and slow down badly where the cores are shared (a segmenter's 32 cardamage images: 0.7 s on one
    thread, 4.9 s on two, on a 2-core CPU running one other process; on an H200 host running four trainings a
    select evaluation of 101 images took 72 s, its model's forward passes under a second)."""
    with _one_cpu_thread():
        return _match_batch(outputs, batch, task, nms, jdict)


@contextlib.contextmanager
def _one_cpu_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _match_batch(outputs: dict[str, torch.Tensor], batch, task: Task, nms: NMSConfig, jdict: list | None
                 ) -> list[tuple]:
    from utils.segment.general import process_mask
    im, targets, paths, shapes = batch[:4]
    _, _, height, width = im.shape
    instance_masks = batch[4] if task.has_masks else None  # in the order of the labels (segment/val.py's)
    outputs = dict(outputs)
    protos = outputs.pop(task.output_names[1]) if task.has_masks and "num_dets" not in outputs else None
    preds = detections(outputs, nms, nm=0 if protos is None else protos.shape[1])
    targets = targets.clone()
    targets[:, 2:] *= torch.tensor((width, height, width, height))
    stats = []
    for si, pred in enumerate(preds):
        labels = targets[targets[:, 0] == si, 1:]
        correct = correct_masks = torch.zeros(len(pred), len(IOU_THRESHOLDS), dtype=torch.bool)
        if len(pred) == 0:
            if len(labels):
                stats.append((correct, correct_masks, torch.zeros(0), torch.zeros(0), labels[:, 0]))
            continue
        predn = pred.clone()
        scale_boxes(im[si].shape[1:], predn[:, :4], shapes[si][0], shapes[si][1])
        if len(labels):
            tbox = xywh2xyxy(labels[:, 1:5])
            scale_boxes(im[si].shape[1:], tbox, shapes[si][0], shapes[si][1])
            correct = match(box_iou(tbox, predn[:, :4]), labels[:, 0], predn[:, 5])
            # masks: only a prediction of a labelled class can match (match pairs one class), so only those are
            # made and compared; the same result, where making every mask was most of a segmenter's evaluation
            if task.has_masks and (keep := torch.isin(pred[:, 5], labels[:, 0])).any():
                masks = outputs["det_masks"][si, :len(pred)][keep] if "det_masks" in outputs else \
                    process_mask(protos[si], pred[keep, 6:], pred[keep, :4], shape=im[si].shape[1:])
                gt = instance_masks[targets[:, 0] == si]
                correct_masks = torch.zeros_like(correct)
                correct_masks[keep] = match(mask_iou_instances(gt, masks), labels[:, 0], predn[keep, 5])
        stats.append((correct, correct_masks, pred[:, 4], pred[:, 5], labels[:, 0]))
        if jdict is not None:
            jdict.extend(_coco_json(Path(paths[si]).stem, predn))
    return stats


def _coco_json(stem: str, predn: torch.Tensor) -> list[dict]:
    image_id = int(stem) if stem.isnumeric() else stem
    return [{"image_id": image_id, "category_id": int(p[5]),
             "bbox": [round(p[0], 3), round(p[1], 3), round(p[2] - p[0], 3), round(p[3] - p[1], 3)],
             "score": round(p[4], 5)} for p in predn.tolist()]


def coco_map(predictions: list[dict], data_dict: dict) -> dict | None:
    """pycocotools mAP where the dataset ships COCO annotations (annotations/instances_val2017.json)."""
    anno = Path(data_dict.get("path", "")) / "annotations" / "instances_val2017.json"
    if not anno.is_file() or not predictions:
        return None
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from utils.general import coco80_to_coco91_class
    c91 = coco80_to_coco91_class()
    gt = COCO(str(anno))
    ev = COCOeval(gt, gt.loadRes([{**d, "category_id": c91[d["category_id"]]} for d in predictions]), "bbox")
    ev.params.imgIds = sorted({d["image_id"] for d in predictions})
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return {"coco_ap": round(float(ev.stats[0]), 5), "coco_ap50": round(float(ev.stats[1]), 5)}


def metrics_table(rows: list[tuple[str, dict | None]]) -> str:
    """Markdown: one row per model, AP / AP50 / Precision / Recall (boxes), and the same for masks when any
    row has them."""
    masks = any(m and "mask_ap" in m for _, m in rows)
    keys = ("ap", "ap50", "precision", "recall") + (("mask_ap", "mask_ap50", "mask_precision", "mask_recall")
                                                    if masks else ())
    head = ["AP", "AP50", "Precision", "Recall"]
    head = [f"Box {h}" for h in head] + [f"Mask {h}" for h in head] if masks else head
    lines = ["| Eval Model | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, m in rows:
        cells = [f"{m[k]:.4f}" if m and k in m else "-" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
