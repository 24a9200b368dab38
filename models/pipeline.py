"""The quantization pipeline behind `qat.py quantize`: PTQ (insert quantizers, calibrate), QAT (fine-tune) and
resume (`qat.py eval` and `sensitive`: models/analysis.py). One frozen `RunConfig` says everything a run does; it is
stored in the run's report.json, so `--resume` continues with exactly the same settings.

Every choice is made on a select split held out from the training images (utils/datasplit.py; the choices:
models/core/selection.py): the calibration method (`auto`: every candidate range from one pass of statistics, each
measured), with `--max-loss` the tensors kept in float (models/mixed_precision.py), and the delivered model
`weights/best_{stem}.pt`, the best of the PTQ model and every QAT epoch, so a run never ships an INT8 model worse
on select than the PTQ model it already had. The val images are measured, never chosen on: the float model
before, the delivered model after.

Under torchrun the same run is spread over several processes (models/core/distributed.py): --batch-size is the global
batch, calibration statistics are combined across ranks, the student trains under DistributedDataParallel, and
rank 0 alone evaluates and writes. --iters 0 makes an epoch one pass over the training images.

A run with `control="all"` is the float control of a QAT run: the identical fine-tune (recipe, losses, teacher,
iterations, learning-rate schedule, seed, data) with every quantizer disabled. QAT minus control is what
quantization costs; QAT minus the float model is what the user gains. `control="weights"` ("activations") keeps
only those in float, the other quantizers INT8: the two halves of that cost, apart (a measurement, not a model to
deploy).
"""
from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from tqdm import tqdm

from models.core.distributed import World, data_parallel, init, same_on_every_rank, shutdown_after, world_from_env
from models.core.layer_outputs import LayerOutputs
from models.core.selection import choose, choose_calibration
from models.core.task import Task, task_of
from models.deployment.evaluate import NMSConfig, evaluate, kept_in_memory, metrics_table, val_loader
from models.deployment.runners import TorchRunner
from models.finetuning.fast_step import STEP_MODES, compiled, plan_step, to_layout
from models.finetuning.finetune import FineTuner, QATObjective, QATRecipe, learnable_amax_parameters
from models.mixed_precision import (Candidate, MixedPrecision, candidate_metrics, choose_float_set, deployment_summary,
                                    float_candidates, keep_float)
from models.quantization.checkpoint import (copy_checkpoint, load_float_model, load_quantized_model, read_checkpoint,
                                            save_checkpoint, trained_overlap)
from models.quantization.quantize import (QuantRecipe, collect_statistics, copy_float, holds_scales, is_enabled,
                                          named_quantizers, quantize_model, quantizer_counts)
from utils.batches import (CACHE_CHOICES, cache_choice, load_data, load_hyp, seeded_batches, seeded_epochs,
                           seeded_indices, seeded_rank_loader)
from utils.datasplit import SelectConfig, SelectSplit, split_for
from utils.general import LOGGER, colorstr
from utils.interrupts import Interrupted, StopBetweenSteps
from utils.io_utils import OutputDir, write_json
from utils.torch_utils import select_device

PREFIX = colorstr("qat: ")
CONTROL_PARTS = ("all", "weights", "activations")  # what --float-control keeps in float
STATE_FILE = "qat_state.pt"  # model and fine-tuning state after the last completed epoch (for --resume)


@dataclass(frozen=True)
class RunConfig:
    """Everything a `qat.py quantize` run does."""

    weights: str
    data: str
    hyp: str
    device: str = "cpu"
    imgsz: int = 640
    batch_size: int = 10
    workers: int = 8
    cache: str | None = "auto"        # the fine-tuning loader's images: utils/batches.py `cache_choice`
    overlap: bool | None = None       # segmentation training masks (--overlap/--no-overlap); None: as the float model's
    step: str = "auto"                # fine-tuning step: compiled where it can be (finetuning/fast_step.py) or eager
    num_image: int | None = None      # evaluate on the first N validation images only
    seed: int = 57                    # calibration sample, data order and augmentation of every epoch
    quant: QuantRecipe = field(default_factory=QuantRecipe)
    qat: QATRecipe = field(default_factory=QATRecipe)
    select: SelectConfig = field(default_factory=SelectConfig)
    epochs: int = 10
    iters: int = 200                  # per epoch; 0: one pass over the training images
    float_epochs: int = 0             # the first N epochs in float, then calibrated anew (one schedule over all)
    control: str = ""                 # float control: "all" quantizers disabled, or only "weights"/"activations"
    max_loss: float | None = None     # mixed precision: tensors kept in float until PTQ is within this of float
    nms: NMSConfig = field(default_factory=NMSConfig)
    eval_origin: bool = True
    eval_ptq: bool = True
    save_candidates: bool = False     # every calibration candidate's PTQ model saved (the benchmark measures each)
    trust_checkpoint: bool = False

    def __post_init__(self):
        if self.epochs < 0 or self.iters < 0:
            raise ValueError("--epochs and --iters must be >= 0")
        if self.cache not in (*CACHE_CHOICES, None):  # None: off (report.json of a run started before auto)
            raise ValueError(f"--cache {self.cache}: one of {', '.join(CACHE_CHOICES)}")
        if self.step not in STEP_MODES:
            raise ValueError(f"--step must be one of {STEP_MODES}, got {self.step!r}")
        if self.control and self.control not in CONTROL_PARTS:
            raise ValueError(f"--float-control must be one of {CONTROL_PARTS}, got {self.control!r}")
        if self.control and not self.epochs:
            raise ValueError("--float-control fine-tunes: it needs --epochs > 0")
        if not 0 <= self.float_epochs < max(self.epochs, 1):
            raise ValueError(f"--float-epochs {self.float_epochs}: must be >= 0 and leave QAT epochs of --epochs "
                             f"{self.epochs}")
        if self.float_epochs and self.control:
            raise ValueError("--float-epochs with --float-control: the float control of a run with float epochs is "
                             "the plain --float-control run (the same schedule)")
        if self.max_loss is not None:
            MixedPrecision(self.max_loss)  # checks the value
            if self.control or self.float_epochs:
                raise ValueError("--max-loss chooses after the first calibration: not with --float-control or "
                                 "--float-epochs")
        if self.float_epochs and (self.qat.learn_amax or self.qat.ema):
            raise ValueError("--float-epochs calibrates the ranges anew after the float epochs: not with "
                             "--learn-amax or --ema, whose learned ranges and averaged copy would not follow")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        nested = {"quant": QuantRecipe, "qat": QATRecipe, "nms": NMSConfig, "select": SelectConfig}
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if isinstance(d.get("control"), bool):  # report.json of a run started before partial controls existed
            d["control"] = "all" if d["control"] else ""
        for key, kind in nested.items():
            if isinstance(d.get(key), dict):
                d[key] = kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in d[key].items()})
        return cls(**d)

    @property
    def finetunes(self) -> bool:
        return self.epochs > 0


@dataclass
class Inputs:
    """What a run reads, checked before its folder exists."""
    device: torch.device
    data_dict: dict
    model: nn.Module
    task: Task
    val: object
    split: SelectSplit | None = None  # where choices are made (quantize runs)
    hyp_dict: dict | None = None
    world: World = field(default_factory=World)
    select: object = None   # the select split's loader, made once the run folder exists (its image lists live there)


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------
def stride_of(model: nn.Module) -> int:
    return max(int(model.stride.max()), 32)


def check_classes(model: nn.Module, data_dict: dict, weights, data) -> None:
    model_nc, data_nc = int(model.model[-1].nc), int(data_dict["nc"])
    if model_nc != data_nc:
        raise ValueError(f"--weights {weights} predicts {model_nc} classes but --data {data} has nc={data_nc}: "
                         "evaluate a model on the dataset it was trained for")


def check_skip(model: nn.Module, recipe: QuantRecipe, flag_values: list[str]) -> None:
    """Every --skip-layers entry must match a module: a typo would silently quantize what was meant to stay float."""
    names = [n for n, _ in model.named_modules()]
    unmatched = [v for v, pattern in zip(flag_values, recipe.skip) if not any(re.search(pattern, n) for n in names)]
    if unmatched:
        raise ValueError(f"--skip-layers {' '.join(map(str, unmatched))}: matches no module of the model "
                         f"(layers are 0-{len(model.model) - 1}, or regexes over names like 'model.22.cv2')")


def training_task(task: Task, flag: bool | None, recorded: bool | None, weights: str) -> tuple[Task, str]:
    """The task with the masks its fine-tune trains on, and why: --overlap/--no-overlap, else as the float model was
    trained (its checkpoint's record), else one mask per image (upstream's default)."""
    given = None if flag is None else f"--{'' if flag else 'no-'}overlap"
    if not task.has_masks:
        if given:
            raise ValueError(f"{given}: --weights {weights} is a detector; the flag chooses a segmenter's masks")
        return task, ""
    if given:
        return task.trained_with(flag), given
    if recorded is not None:
        return task.trained_with(recorded), "as the float model was trained: its checkpoint's opt.no_overlap"
    return task, "upstream's default; the checkpoint does not say how its masks were trained"


def load_inputs(cfg: RunConfig, skip_values: list[str] = (), choices: bool = True) -> Inputs:
    """Files, class counts, labels and layer patterns, all checked before anything is written; in a torchrun job,
    the process group joined."""
    world = world_from_env()
    if cfg.batch_size % world.size:
        raise ValueError(f"--batch-size {cfg.batch_size} is the global batch: it must divide by the {world.size} "
                         "processes")
    device = select_device(cfg.device)
    if world.distributed and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    init(world, device)
    data_dict = load_data(cfg.data)
    hyp_dict = load_hyp(cfg.hyp)
    ckpt = read_checkpoint(cfg.weights, cfg.trust_checkpoint)
    model = load_float_model(cfg.weights, device, ckpt=ckpt)
    check_classes(model, data_dict, cfg.weights, cfg.data)
    check_skip(model, cfg.quant, list(skip_values))
    task, why = training_task(task_of(model), cfg.overlap, trained_overlap(ckpt), cfg.weights)
    if task.has_masks and world.main and cfg.finetunes:
        LOGGER.info(f"{PREFIX}fine-tuning on {'one mask per image' if task.overlap else 'full instance masks'} ({why})")
    val = val_loader(task, data_dict, cfg.imgsz, cfg.batch_size * 2, cfg.workers, cfg.num_image, cfg.data)
    if cfg.finetunes:  # the training images must load too
        train_loader(task, data_dict, cfg, hyp_dict, augment=False)
    split = split_for(data_dict, cfg.select, cfg.data) if choices else None
    return Inputs(device, data_dict, model, task, val, split, hyp_dict, world)


def open_select_split(inputs: Inputs, cfg: RunConfig, folder: Path) -> None:
    """The select loader, and the training images narrowed to the fit share: their lists are written to `folder`
    (the run's own, so `--resume` reads the same split)."""
    world = inputs.world
    select, fit = inputs.split.write(folder, world.main)
    world.barrier()  # rank 0 wrote the lists
    if fit is not None:
        inputs.data_dict = {**inputs.data_dict, "train": fit}
    if world.main:  # the rank that evaluates
        inputs.select = kept_in_memory(val_loader(inputs.task, {"val": select}, cfg.imgsz, cfg.batch_size * 2,
                                                  cfg.workers, cfg.num_image, cfg.select.data or cfg.data), cfg.imgsz)


def train_loader(task: Task, data_dict: dict, cfg: RunConfig, hyp: dict, augment: bool, world: World = World(),
                 cache: str | None = None):
    """Shuffled training batches: this rank's share of each global batch (utils/batches.py `seeded_rank_loader`), a
    plain DataLoader (upstream's `close_mosaic` switch; mosaic follows `hyp`; `cache`: `training_cache`): each pass
    re-draws its order from `loader.generator`, which `seeded_batches` seeds, the same on every rank."""
    loader, _ = task.dataloader(data_dict["train"], cfg.imgsz, cfg.batch_size // world.size, 32, hyp=hyp,
                                augment=augment, workers=cfg.workers, cache=cache, shuffle=True, close_mosaic=True,
                                prefix=colorstr("train: "))
    return seeded_rank_loader(loader, world.size, world.rank)


def training_cache(inputs: Inputs, cfg: RunConfig) -> tuple[str | None, str]:
    """What the fine-tuning loader keeps of the training images, and why (their sizes: upstream's label cache)."""
    return cache_choice(cfg.cache, inputs.device.type == "cuda", cfg.imgsz, inputs.world.local_size,
                        lambda: train_loader(inputs.task, inputs.data_dict, cfg, {}, False).dataset.shapes)


def calibration_sample(task: Task, fit: str | Path, cfg: RunConfig) -> list[str]:
    """The names of the images a run of `cfg` calibrates on (`calibrate_ranges`, one process), in the order drawn,
    from the seeded sampler over the fit images (`fit`: their list) alone: no image is read."""
    loader = train_loader(task, {"train": str(fit)}, cfg, {}, augment=False)
    files = loader.dataset.im_files
    n = min(cfg.quant.calib_batches, len(loader))
    return [Path(files[i]).name for batch in seeded_indices(loader, n, cfg.seed) for i in batch]


def controlled_quantizers(model: nn.Module, part: str) -> list[nn.Module]:
    """The quantizers a float control of `part` ("all", "weights", "activations"; "": none) disables."""
    if not part:
        return []
    return [q for _, q in named_quantizers(model) if part == "all" or (q.axis is not None) == (part == "weights")]


def measure(model: nn.Module, inputs: Inputs, cfg_nms: NMSConfig, desc: str, split: str = "val",
            stop: StopBetweenSteps | None = None) -> dict:
    """The task's metrics of an in-memory model on the val or the select images (models/deployment/evaluate.py);
    with `stop`, a Ctrl-C stops it between batches."""
    loader = inputs.select if split == "select" else inputs.val
    loader = loader if stop is None else stop.between(loader)
    m = evaluate(TorchRunner(model), loader, inputs.task, int(inputs.data_dict["nc"]), cfg_nms, f"{desc} ({split})")
    return inputs.task.metrics(m)


def measure_each_in_float(model: nn.Module, candidates: list[Candidate], inputs: Inputs, cfg_nms: NMSConfig
                          ) -> dict[str, dict]:
    """The task's metrics on the select images with each candidate alone in float (one pass over them)."""
    desc = f"{len(candidates)} tensor class(es), each alone in float (select)"
    m = candidate_metrics(model, candidates, inputs.select, inputs.task, int(inputs.data_dict["nc"]), cfg_nms, desc)
    return {name: inputs.task.metrics(v) for name, v in m.items()}


# --------------------------------------------------------------------------------------------------
# quantize: PTQ, then QAT (or its float control); resumable
# --------------------------------------------------------------------------------------------------
class RunFolder:
    """One run folder: report.json written after every stage, checkpoints, the delivered model (offered each
    stage's result, kept where it beats the current one on select) and the state --resume reads. `stop`: where a
    Ctrl-C is acted on (between batches, steps and evaluations; utils/interrupts.py)."""

    def __init__(self, cfg: RunConfig, save_dir: Path, report: dict, inputs: Inputs):
        self.cfg, self.save_dir, self.report, self.inputs = cfg, save_dir, report, inputs
        self.stem = Path(cfg.weights).stem
        self.weights_dir = save_dir / "weights"
        self.stop = StopBetweenSteps()
        open_select_split(inputs, cfg, save_dir / "split")
        if inputs.world.main:
            split = inputs.split.info()
            if report.setdefault("select", split) != split:
                raise ValueError(f"--resume {save_dir}: the select images changed since the run started "
                                 f"(fingerprint {report['select']['fingerprint']}, now {split['fingerprint']})")

    def save_report(self) -> None:
        if self.inputs.world.main:
            write_json(self.save_dir / "report.json", self.report)

    def measure(self, model: nn.Module, desc: str, split: str = "select") -> dict | None:
        """Rank 0 evaluates (the loop of one process: the same numbers); the others get None."""
        if not self.inputs.world.main:
            return None
        return measure(model, self.inputs, self.cfg.nms, desc, split, self.stop)

    def measure_val(self, model: Callable[[], nn.Module], desc: str, on_select: dict | None) -> dict | None:
        """The model `model()` gives, on the val images; with --no-select those are the select images, already
        measured (`on_select`): nothing is loaded or run again."""
        if self.inputs.split.source == "val" and on_select is not None:
            return self.inputs.task.metrics(on_select)
        return self.measure(model(), desc, "val")

    def save(self, model: nn.Module, path: Path, **extra) -> Path:
        if self.inputs.world.main:
            save_checkpoint(model, path, **extra)
        return path

    def offer(self, stage: str, epoch: int, saved: Path, metrics: dict) -> None:
        """The model saved in `saved` (with this stage, epoch and metrics) becomes the delivered one
        (weights/best_{stem}.pt, a copy) where it beats the current one on select; the PTQ model is offered first, so
        a tie keeps it."""
        if not self.inputs.world.main:
            return
        final = self.report.get("final")
        score = self.inputs.task.score(metrics)
        if final is not None and choose({"current": final["score"], "new": score}) == "current":
            return
        f = copy_checkpoint(saved, self.weights_dir / f"best_{self.stem}.pt")
        self.report["final"] = {"stage": stage, "epoch": epoch, "score": round(score, 6), **metrics, "file": str(f)}

    def rewind_final(self, start: int) -> None:
        """After a resume from epoch `start`: the delivered model as it was then (later epochs are run again)."""
        final = self.report.get("final")
        if final is None or final["epoch"] <= start or not self.inputs.world.main:
            return
        self.report.pop("final")
        stages = [("ptq", 0, self.report.get("ptq"), self.report["ptq_file"])] if not self.cfg.control else []
        recalibrated = self.report.get("recalibrated")
        if recalibrated is not None:
            stages.append(("ptq", recalibrated["epoch"], recalibrated["metrics"], recalibrated["file"]))
        stages += [(e.get("stage", final["stage"]), e["epoch"], self.inputs.task.metrics(e), e["file"])
                   for e in self.report["qat"] if e.get("stage") != "float"]
        for stage, epoch, metrics, file in stages:
            if metrics is not None:
                self.offer(stage, epoch, Path(file), metrics)

    def finish(self) -> dict:
        report, task = self.report, self.inputs.task
        if not self.inputs.world.main:
            return report
        final = report.get("final")
        if final is not None:
            report.setdefault("val", {})["final"] = self.measure_val(
                lambda: load_quantized_model(final["file"], self.inputs.device), "delivered model", final)
            LOGGER.info(f"{PREFIX}delivered model: {final['stage']}" + (f" epoch {final['epoch']}" if final["epoch"]
                        else "") + f", {colorstr('bold', final['file'])}")
        best = report.get("qat_best")
        fine_tuned = {"": "QAT best epoch (PyTorch INT8)", "all": "FP fine-tune best (control)"}.get(
            self.cfg.control, f"fine-tune with {self.cfg.control} in float, best (control)")
        chosen = report["calibration"]["chosen"]
        val = report.get("val", {})
        recalibrated = report.get("recalibrated") or {}
        mixed = report.get("mixed_precision")
        kept = f" + {len(mixed['float_convs'])} float conv(s)" if mixed and mixed["float_convs"] else ""
        rows = [("Origin (PyTorch), select", report.get("origin")), (f"PTQ {chosen}{kept}, select", report.get("ptq")),
                (f"PTQ {recalibrated.get('chosen')} after {recalibrated.get('epoch')} float epochs, select",
                 recalibrated.get("metrics")),
                (f"{fine_tuned}, select", None if best is None else task.metrics(best)),
                ("Delivered, select", None if final is None else task.metrics(final)),
                ("Origin (PyTorch), val", val.get("origin")), ("Delivered, val", val.get("final"))]
        report["table"] = metrics_table([r for r in rows if r[1] is not None])
        LOGGER.info("\n" + report["table"])
        report["finished"] = True
        self.save_report()
        # only needed to resume an unfinished run; removed after the report says finished, so a run stopped between
        # the two still resumes from its last epoch
        (self.weights_dir / STATE_FILE).unlink(missing_ok=True)
        LOGGER.info(f"{PREFIX}results saved to {colorstr('bold', self.save_dir)}")
        return report




class PTQStage:
    """Post-training quantization: quantizers inserted, calibration statistics collected once, every candidate
    range measured on select and the best kept, mixed precision to a budget; the result offered for delivery."""

    def __init__(self, folder: RunFolder):
        self.folder, self.cfg, self.inputs, self.report = folder, folder.cfg, folder.inputs, folder.report

    def run(self) -> nn.Module:
        """Quantizers inserted, statistics collected once, every candidate range measured on select and the best
        kept (`auto`; a fixed method has one candidate)."""
        cfg, inputs, report = self.cfg, self.inputs, self.report
        model = inputs.model
        if cfg.eval_origin or cfg.max_loss is not None:  # the budget is relative to the float model on select
            report["origin"] = self.folder.measure(model, "origin (float)")
        if cfg.eval_origin:
            report.setdefault("val", {})["origin"] = self.folder.measure_val(lambda: model, "origin (float)",
                                                                             report["origin"])
        self.folder.save_report()
        t0 = time.perf_counter()
        quantize_model(model, cfg.quant)
        report["quantizers"] = quantizer_counts(model)
        insert_s = time.perf_counter() - t0
        # the full control disables every quantizer: its ranges are never used, one cheap candidate is enough
        recipe = replace(cfg.quant, calib_method="max") if cfg.control == "all" else cfg.quant
        calibration, results, seen = self.calibrate_ranges(model, recipe, "PTQ", cfg.save_candidates)
        calibration["seconds"] = {"insert_quantizers": round(insert_s, 2), **calibration["seconds"]}
        report["calibration"] = {
            "method": "max (control: quantizers disabled)" if cfg.control == "all" else cfg.quant.calib_method,
            **calibration}
        report["calibration_images"] = seen
        chosen = calibration["chosen"]
        LOGGER.info(f"{PREFIX}{report['quantizers']['distinct']} quantizers calibrated on {len(seen)} images, "
                    f"{_scores_line(calibration['candidates'], chosen)}")
        report["ptq"] = results[chosen]
        if cfg.max_loss is not None:
            report["ptq"] = self.mix(model, report["origin"], report["ptq"])
        ptq_file = self.folder.weights_dir / f"ptq_ap_{_ap_tag(report['ptq'])}_{self.folder.stem}.pt"
        report["ptq_file"] = str(self.folder.save(model, ptq_file, stage="ptq", epoch=0, metrics=report["ptq"]))
        report["qat"] = []
        if not cfg.control and report["ptq"] is not None:
            self.folder.offer("ptq", 0, ptq_file, report["ptq"])
        self.folder.save_report()
        inputs.world.barrier()
        return model

    def calibrate_ranges(self, model: nn.Module, recipe: QuantRecipe, what: str, save_candidates: bool = False
                         ) -> tuple[dict, dict[str, dict | None], list[str]]:
        """Statistics of the calibration images (the run's seeded sample of the fit images, the same every time),
        every candidate range measured on select and the best applied (with `save_candidates`, each candidate's
        model saved as it was measured). Returns the record for report.json, every candidate's metrics and the
        calibration images' names, in one process's order. Every rank calls it."""
        cfg, inputs, world = self.cfg, self.inputs, self.inputs.world
        loader = train_loader(inputs.task, inputs.data_dict, cfg, inputs.hyp_dict, augment=False, world=world)
        n = min(recipe.calib_batches, len(loader))  # global batches: each rank loads its share of each
        seen: list[list[str]] = []
        images = _images_noting_files(seeded_batches(loader, inputs.device, n, cfg.seed), seen)
        progress = tqdm(self.folder.stop.between(images), total=n, desc=f"{PREFIX}calibrating", disable=not world.main)
        stats = collect_statistics(model, recipe, progress, world)
        t1 = time.perf_counter()
        names, task = list(stats.candidates), inputs.task
        saved: dict[str, str] = {}

        def measure(name: str) -> dict | None:
            metrics = self.folder.measure(model, f"{what} {name}")
            if save_candidates:  # each candidate's model, for measuring it elsewhere (--save-candidates)
                f = self.folder.weights_dir / f"ptq_{name}_{self.folder.stem}.pt"
                saved[name] = str(self.folder.save(model, f, stage="ptq", candidate=name, metrics=metrics))
            return metrics
        if len(names) > 1:
            chosen, results = choose_calibration(stats.apply, measure, task.score, names, world.broadcast)
        else:
            chosen = names[0]
            stats.apply(chosen)
            results = {chosen: measure(chosen) if cfg.eval_ptq else None}
        scores = {k: None if v is None else round(task.score(v), 6) for k, v in results.items()}
        # a peer calibrates on the same images: batch by batch, rank by rank
        seen = [Path(f).name for batch in zip(*world.all_gather(seen)) for share in batch for f in share]
        record = {"chosen": chosen, "candidates": scores, "images": len(seen),
                  "seconds": {"collect": round(stats.collect_s, 2), "ranges": stats.amax_s,
                              "ranges_and_evaluations": round(time.perf_counter() - t1, 2)}}
        if saved:
            record["saved"] = {k: {"file": f, "metrics": results[k]} for k, f in saved.items()}
        if stats.per_quantizer:  # what each quantizer took in the per-quantizer candidate
            record["per_quantizer"] = {"images": len(stats.images), "methods": stats.per_quantizer,
                                       "counts": dict(Counter(stats.per_quantizer.values()).most_common())}
        return record, results, seen

    def mix(self, model: nn.Module, origin: dict | None, ptq: dict | None) -> dict | None:
        """Mixed precision (models/mixed_precision.py): the INT8 tensors kept in float, chosen on select by rank 0
        and applied on every rank; report.json's `mixed_precision`. Returns the select metrics of the PTQ model
        now delivered as the PTQ stage."""
        cfg, inputs, world, task = self.cfg, self.inputs, self.inputs.world, self.inputs.task
        candidates = float_candidates(model, cfg.imgsz)
        record, mixed = None, None
        if world.main:
            ptq = ptq or self.folder.measure(model, "PTQ (all INT8)")
            images = next(iter(inputs.select))[0].float().div(255).to(inputs.device)
            record, mixed = choose_float_set(model, candidates, MixedPrecision(cfg.max_loss), task.score(origin),
                                             task.score(ptq), lambda desc: self.folder.measure(model, desc),
                                             lambda cs: measure_each_in_float(model, cs, inputs, cfg.nms), task.score,
                                             LayerOutputs(model, images))
        record = world.broadcast(record)
        kept = {c["name"] for c in record["kept_float"]}
        keep_float(model, [c for c in candidates if c.name in kept])
        if kept:  # measured while choosing (rank 0; the others hold None, as from measure)
            ptq = mixed
        if world.main:
            record.update(deployment_summary(model, cfg.imgsz))
        self.report["mixed_precision"] = record
        if world.main:
            LOGGER.info(f"{PREFIX}mixed precision: {len(record['float_convs'])} conv(s) kept in float, "
                        f"{record['int8_mac_share']:.1%} of conv MACs in INT8, {record['boundaries']} INT8/float "
                        f"boundaries; select {task.score(ptq):.4f} (all INT8 {record['all_int8_select']:.4f}, float "
                        f"{record['origin_select']:.4f}, budget {cfg.max_loss})"
                        + ("" if record["reached"] else ": NO set of the measured candidates reached the budget; "
                                                         "the best one found is kept"))
        return ptq


class FineTuneStage:
    """QAT (or a float control) epochs from the PTQ model: each evaluated on select, saved, offered for delivery,
    with the state --resume continues from."""

    def __init__(self, folder: RunFolder, ptq: PTQStage):
        self.folder, self.cfg, self.inputs, self.report = folder, folder.cfg, folder.inputs, folder.report
        self.ptq = ptq  # recalibrates after the float epochs

    def run(self, model: nn.Module, teacher: nn.Module) -> None:
        """QAT (or the float control) epochs; after each: evaluation, checkpoints, report.json and the state that
        `--resume` continues from."""
        cfg, inputs, report = self.cfg, self.inputs, self.report
        state_file = self.folder.weights_dir / STATE_FILE
        state = read_checkpoint(state_file, flag="--resume") if state_file.is_file() else None
        if state is not None:
            model = state["model"].to(inputs.device)
        world = inputs.world
        start = 0 if state is None else state["epoch"]
        # the float epochs train with every quantizer off; the saved state past them has them on, recalibrated
        for q in controlled_quantizers(model, cfg.control or ("all" if start < cfg.float_epochs else "")):
            q.disable()
        if cfg.qat.learn_amax:
            learnable_amax_parameters(model)
        cache, why = training_cache(inputs, cfg)
        loader = train_loader(inputs.task, inputs.data_dict, cfg, inputs.hyp_dict, True, world, cache)
        iters = cfg.iters or math.ceil(len(loader.dataset) / cfg.batch_size)  # 0: one pass over the images
        plan = plan_step(cfg.step, inputs.device, cfg.qat.learn_amax, iterations=(cfg.epochs - start) * iters,
                         batch=cfg.batch_size // world.size, held_scales=holds_scales(model))
        if world.main:
            LOGGER.info(f"{PREFIX}fine-tuning step: {plan.reason}; training images {why}")
        to_layout(model, plan)
        to_layout(teacher, plan)
        same_on_every_rank(world, "quantizers turned off",
                           sorted(n for n, q in named_quantizers(model) if not is_enabled(q)))
        forward = compiled(data_parallel(model, world, inputs.device), plan)
        with QATObjective(cfg.qat, model, teacher, inputs.hyp_dict, forward, compiled(teacher, plan),
                          task=inputs.task) as objective:
            tuner = FineTuner(objective, cfg.epochs, iters, amp=inputs.device.type == "cuda", plan=plan)
            report["step"] = {"plan": plan.reason, "cache": cache, "cache_why": why}
            if state is not None:
                tuner.load_state(state, inputs.device)
            # epochs past the saved state are run again (seeded: the same); their entries would be duplicates
            report["qat"] = report.get("qat", [])[:start]
            report["qat_best"] = max((e for e in report["qat"] if e.get("stage") != "float"), key=inputs.task.score,
                                     default=None)
            if report.get("recalibrated", {}).get("epoch", 0) > start:
                report.pop("recalibrated")
            self.folder.rewind_final(start)
            epochs = range(start, cfg.epochs)
            seeded = seeded_epochs(loader, inputs.device, iters, [cfg.seed + 1 + epoch for epoch in epochs])
            for epoch, batches in zip(epochs, seeded):
                t0 = time.perf_counter()
                batches = self.folder.stop.between(batches)
                stage = self.stage_of(epoch + 1)
                desc = f"{PREFIX}{stage} epoch {epoch + 1}/{cfg.epochs}" if world.main else ""  # one progress bar
                losses = tuner.epoch(batches, desc)
                if tuner.first_step_s is not None and "first_step_s" not in report["step"] and world.main:
                    report["step"]["first_step_s"] = round(tuner.first_step_s, 1)
                    report["step"]["compiled"] = compiled_now = tuner.first_step_compiled
                    LOGGER.info(f"{PREFIX}the compiled step's first iteration (tracing and compiling) took "
                                f"{tuner.first_step_s:.1f} s")
                    if compiled_now["cudagraph_skips"]:
                        LOGGER.warning(f"{PREFIX}{compiled_now['cudagraph_skips']} of the compiled step's "
                                       f"{compiled_now['graphs']} graphs run without CUDA graphs, one launch per "
                                       "kernel (TORCH_LOGS=cudagraphs says why): --step eager may be as fast")
                if world.main:
                    self.end_epoch(epoch + 1, tuner, losses, time.perf_counter() - t0)
                if epoch + 1 == cfg.float_epochs:
                    self.recalibrate(model, epoch + 1)
                if world.main:
                    save_checkpoint(model, state_file, epoch=epoch + 1, **tuner.state())
                world.barrier()

    def stage_of(self, epoch: int) -> str:
        """What fine-tuning epoch `epoch` (from 1) is: a float control's, a float epoch before QAT, or QAT."""
        return "control" if self.cfg.control else "float" if epoch <= self.cfg.float_epochs else "qat"

    def recalibrate(self, model: nn.Module, epoch: int) -> None:
        """After the float epochs: every quantizer on again, ranges calibrated anew for the fine-tuned weights (the
        run's method, the same images), the result offered like the first PTQ model. QAT continues from it."""
        for q in controlled_quantizers(model, "all"):
            q.enable()
        record, results, _ = self.ptq.calibrate_ranges(model, self.cfg.quant, f"PTQ after epoch {epoch}")
        metrics = results[record["chosen"]]
        if not self.inputs.world.main:
            return
        LOGGER.info(f"{PREFIX}recalibrated after {epoch} float epoch(s): "
                    f"{_scores_line(record['candidates'], record['chosen'])}")
        folder = self.folder
        f = folder.save(model, folder.weights_dir / f"ptq_ep_{epoch}_ap_{_ap_tag(metrics)}_{folder.stem}.pt",
                      stage="ptq", epoch=epoch, metrics=metrics)
        self.report["recalibrated"] = {"epoch": epoch, **record, "metrics": metrics, "file": str(f)}
        if metrics is not None:
            self.folder.offer("ptq", epoch, f, metrics)
        self.folder.save_report()

    def end_epoch(self, epoch: int, tuner: FineTuner, losses: dict, train_s: float) -> None:
        report, trained, stage = self.report, tuner.trained, self.stage_of(epoch)
        metrics = self.folder.measure(trained, f"epoch {epoch}")
        kind = "float" if stage == "float" else "qat"
        f = self.folder.weights_dir / f"{kind}_ep_{epoch}_ap_{_ap_tag(metrics)}_{self.folder.stem}.pt"
        save_checkpoint(trained, f, stage=stage, epoch=epoch, metrics=metrics)
        entry = {"epoch": epoch, "stage": stage, **{k: round(v, 6) for k, v in losses.items()},
                 "lr_end": tuner.optimizer.param_groups[0]["lr"], "train_s": round(train_s, 2), **metrics,
                 "file": str(f)}
        report["qat"].append(entry)
        if stage == "float":  # a float model: measured, never delivered
            self.folder.save_report()
            return
        best = report.get("qat_best")
        if best is None or self.inputs.task.score(metrics) > self.inputs.task.score(best):
            report["qat_best"] = entry
            best_file = self.folder.weights_dir / f"qat_best_{self.folder.stem}.pt"
            report["qat_best_file"] = str(copy_checkpoint(f, best_file))
        self.folder.offer(stage, epoch, f, metrics)
        # report first: a kill between the two repeats this epoch (the same, it is seeded) rather than lose it
        self.folder.save_report()


def run_stages(folder: RunFolder) -> dict:
    """PTQ (or the PTQ model of a resumed run), then fine-tuning where the configuration asks for it; the report."""
    ptq = PTQStage(folder)
    try:
        with folder.stop:
            teacher = copy_float(folder.inputs.model)
            ptq_file = folder.report.get("ptq_file")
            if ptq_file and Path(ptq_file).is_file():  # resumed after PTQ
                model = load_quantized_model(ptq_file, folder.inputs.device)
            else:
                model = ptq.run()
            if folder.cfg.finetunes:
                FineTuneStage(folder, ptq).run(model, teacher)
        return folder.finish()  # a Ctrl-C here (at once: outside the block) leaves the report unfinished: resumable
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; resume with: python qat.py quantize --resume {folder.save_dir}") from None


def quantize(cfg: RunConfig, out: OutputDir, skip_values: list[str] = ()) -> dict:
    """`qat.py quantize`: a new run."""
    inputs = load_inputs(cfg, skip_values)
    save_dir = inputs.world.broadcast(out.create() if inputs.world.main else None)  # one folder for all ranks
    report = {"config": cfg.to_dict(), "task": inputs.task.name, "training_masks": inputs.task.training_masks,
              "world_size": inputs.world.size, "save_dir": str(save_dir)}
    with shutdown_after(inputs.world):
        return run_stages(RunFolder(cfg, save_dir, report, inputs))


def resume(save_dir: str | Path, **keep) -> dict:
    """`qat.py quantize --resume`: the run folder's own configuration, with `keep` (device, workers,
    trust_checkpoint) taken anew."""
    save_dir = Path(save_dir)
    report_file = save_dir / "report.json"
    if not report_file.is_file():
        raise FileNotFoundError(f"--resume {save_dir}: no report.json there; is it a `qat.py quantize` run folder?")
    report = json.loads(report_file.read_text())
    if "config" not in report:
        raise ValueError(f"--resume {save_dir}: its report.json was written by an older version (no config)")
    if report.get("finished"):
        raise ValueError(f"--resume {save_dir}: this run finished all its epochs; nothing to resume")
    started, now = report.get("world_size", 1), world_from_env().size
    if started != now:
        raise ValueError(f"--resume {save_dir}: the run was started on {started} process(es), this job has {now}: "
                         f"resume it with torchrun --nproc_per_node {started} (or --nnodes M --nproc_per_node "
                         f"{started}/M over M machines; without torchrun for 1)")
    cfg = replace(RunConfig.from_dict(report["config"]), **{k: v for k, v in keep.items() if v is not None})
    inputs = load_inputs(cfg)
    if inputs.world.main:
        for leftover in save_dir.rglob(".*.tmp"):  # half-written files of the interrupted run
            leftover.unlink()
    LOGGER.info(f"{PREFIX}resuming {save_dir} after {len(report.get('qat', []))} completed epoch(s)")
    with shutdown_after(inputs.world):
        return run_stages(RunFolder(cfg, save_dir, report, inputs))


def _images_noting_files(batches, files: list[list[str]]):
    """The images of `batches`, appending each batch's file names to `files` as it goes."""
    for b in batches:
        files.append(list(b.paths))
        yield b.images


def _scores_line(scores: dict[str, float | None], chosen: str) -> str:
    """'mse chosen on select (max 0.5120, mse 0.5311, ...)', or the one method where nothing was measured."""
    if len(scores) == 1 and scores[chosen] is None:
        return f"ranges by {chosen}"
    return f"{chosen} chosen on select (" + ", ".join(f"{k} {v:.4f}" if v is not None else f"{k} -"
                                                      for k, v in scores.items()) + ")"


def _ap_tag(metrics: dict | None) -> str:
    return "na" if metrics is None else f"{metrics['ap']:.4f}"
