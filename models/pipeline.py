"""The quantization pipeline behind `qat.py`: PTQ (insert quantizers, calibrate), QAT (fine-tune, keep the best
epoch), resume, evaluation of a checkpoint and per-layer sensitivity. One frozen `RunConfig` says everything a
run does; it is stored in the run's report.json, so `--resume` continues with exactly the same settings.

Under torchrun the same run is spread over several processes (models/distributed.py): --batch-size is the global
batch, calibration statistics are combined across ranks, the student trains under DistributedDataParallel, and
rank 0 alone evaluates and writes. --iters 0 makes an epoch one pass over the training images.

A run with `control=True` is the float control of a QAT run: the identical fine-tune (recipe, losses, teacher,
iterations, learning-rate schedule, seed, data) with every quantizer disabled. QAT minus control is what
quantization costs; QAT minus the float model is what the user gains.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

from models.distributed import World, data_parallel, init, rank_batches, shutdown_after, world_from_env
from models.checkpoint import load_float_model, load_quantized_model, read_checkpoint, save_checkpoint
from models.evaluate import NMSConfig, evaluate, metrics_table, val_loader
from models.finetune import FineTuner, QATObjective, QATRecipe, learnable_amax_parameters
from models.quantize import (QuantRecipe, calibrate, copy_float, is_quantized, layer_quantizers, named_quantizers,
                             quantization_disabled, quantize_model, quantizer_counts)
from models.runners import TorchRunner
from models.task import Task, task_of
from utils.batches import load_data, load_hyp, seeded_batches
from utils.general import LOGGER, colorstr
from utils.io_utils import Interrupted, OutputDir, atomic_write, write_json
from utils.torch_utils import select_device

PREFIX = colorstr("qat: ")
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
    num_image: int | None = None      # evaluate on the first N validation images only
    seed: int = 57                    # calibration sample, data order and augmentation of every epoch
    quant: QuantRecipe = field(default_factory=QuantRecipe)
    qat: QATRecipe = field(default_factory=QATRecipe)
    epochs: int = 10
    iters: int = 200                  # per epoch; 0: one pass over the training images
    control: bool = False             # the float control: the same fine-tune with every quantizer disabled
    nms: NMSConfig = field(default_factory=NMSConfig)
    eval_origin: bool = True
    eval_ptq: bool = True
    trust_checkpoint: bool = False

    def __post_init__(self):
        if self.epochs < 0 or self.iters < 0:
            raise ValueError("--epochs and --iters must be >= 0")
        if self.control and not self.epochs:
            raise ValueError("--float-control fine-tunes: it needs --epochs > 0")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        nested = {"quant": QuantRecipe, "qat": QATRecipe, "nms": NMSConfig}
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
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
    hyp_dict: dict | None = None
    world: World = field(default_factory=World)


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


def load_inputs(cfg: RunConfig, skip_values: list[str] = ()) -> Inputs:
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
    model = load_float_model(cfg.weights, device, cfg.trust_checkpoint)
    check_classes(model, data_dict, cfg.weights, cfg.data)
    check_skip(model, cfg.quant, list(skip_values))
    task = task_of(model)
    val = val_loader(task, data_dict, cfg.imgsz, cfg.batch_size * 2, cfg.workers, cfg.num_image, cfg.data)
    if cfg.finetunes:  # the training images must load too
        train_loader(task, data_dict, cfg, hyp_dict, augment=False)
    return Inputs(device, data_dict, model, task, val, hyp_dict, world)


def train_loader(task: Task, data_dict: dict, cfg: RunConfig, hyp: dict, augment: bool, world: World = World()):
    """Shuffled training batches of this rank's size (the global batch over the ranks). A plain DataLoader
    (upstream's `close_mosaic` switch selects it; mosaic itself follows `hyp`): each pass re-draws its order from
    `loader.generator`, which `seeded_batches` seeds, the same on every rank."""
    loader, _ = task.dataloader(data_dict["train"], cfg.imgsz, cfg.batch_size // world.size, 32, hyp=hyp,
                                augment=augment, workers=cfg.workers, shuffle=True, close_mosaic=True,
                                prefix=colorstr("train: "))
    return loader


def measure(model: nn.Module, inputs: Inputs, cfg_nms: NMSConfig, desc: str) -> dict:
    """The task's metrics of an in-memory model through the evaluation loop (models/evaluate.py)."""
    m = evaluate(TorchRunner(model), inputs.val, inputs.task, int(inputs.data_dict["nc"]), cfg_nms, desc)
    return inputs.task.metrics(m)


# --------------------------------------------------------------------------------------------------
# quantize: PTQ, then QAT (or its float control); resumable
# --------------------------------------------------------------------------------------------------
class QuantizeRun:
    """One run folder: report.json written after every stage, checkpoints, and the state --resume reads."""

    def __init__(self, cfg: RunConfig, save_dir: Path, report: dict, inputs: Inputs):
        self.cfg, self.save_dir, self.report, self.inputs = cfg, save_dir, report, inputs
        self.stem = Path(cfg.weights).stem
        self.weights_dir = save_dir / "weights"

    def save_report(self) -> None:
        if self.inputs.world.main:
            write_json(self.save_dir / "report.json", self.report)

    def measure(self, model: nn.Module, desc: str) -> dict | None:
        """Rank 0 evaluates (the loop of one process: the same numbers); the others get None."""
        return measure(model, self.inputs, self.cfg.nms, desc) if self.inputs.world.main else None

    def save(self, model: nn.Module, path: Path, **extra) -> Path:
        if self.inputs.world.main:
            save_checkpoint(model, path, **extra)
        return path

    def run(self) -> dict:
        try:
            teacher = copy_float(self.inputs.model)
            ptq_file = self.report.get("ptq_file")
            if ptq_file and Path(ptq_file).is_file():  # resumed after PTQ
                model = load_quantized_model(ptq_file, self.inputs.device)
            else:
                model = self.ptq()
            if self.cfg.finetunes:
                self.finetune(model, teacher)
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted; resume with: python qat.py quantize --resume {self.save_dir}") from None
        return self.finish()

    def ptq(self) -> nn.Module:
        cfg, inputs, report = self.cfg, self.inputs, self.report
        model = inputs.model
        report["origin"] = self.measure(model, "origin (float)") if cfg.eval_origin else None
        self.save_report()
        t0 = time.perf_counter()
        quantize_model(model, cfg.quant)
        report["quantizers"] = quantizer_counts(model)
        insert_s = time.perf_counter() - t0
        LOGGER.info(f"{PREFIX}inserted {report['quantizers']['distinct']} quantizers in {insert_s:.1f}s")
        world = inputs.world
        loader = train_loader(inputs.task, inputs.data_dict, cfg, inputs.hyp_dict, augment=False, world=world)
        n = min(cfg.quant.calib_batches * world.size, len(loader))  # the same images as one process draws
        seen: list[str] = []
        images = _images_noting_files(seeded_batches(loader, inputs.device, n, cfg.seed), seen)
        progress = tqdm(images, total=n, desc=f"{PREFIX}calibrating ({cfg.quant.calib_method})", disable=not world.main)
        times = calibrate(model, cfg.quant, progress, world)
        report["timing"] = {"insert_quantizers_s": round(insert_s, 2), "calib_collect_s": round(times["collect_s"], 2),
                            "calib_amax_s": round(times["compute_amax_s"], 2)}
        report["calibration_images"] = [Path(f).name for f in seen]  # which images (a peer calibrates on the same)
        report["ptq"] = self.measure(model, "PTQ (int8 fake-quant)") if cfg.eval_ptq else None
        ptq_file = self.weights_dir / f"ptq_ap_{_ap_tag(report['ptq'])}_{self.stem}.pt"
        report["ptq_file"] = str(self.save(model, ptq_file, stage="ptq", metrics=report["ptq"]))
        report["qat"] = []
        self.save_report()
        world.barrier()
        return model

    def finetune(self, model: nn.Module, teacher: nn.Module) -> None:
        """QAT (or the float control) epochs; after each: evaluation, checkpoints, report.json and the state that
        `--resume` continues from."""
        cfg, inputs, report = self.cfg, self.inputs, self.report
        state_file = self.weights_dir / STATE_FILE
        state = read_checkpoint(state_file, flag="--resume") if state_file.is_file() else None
        if state is not None:
            model = state["model"].to(inputs.device)
        if cfg.control:
            for _, q in named_quantizers(model):
                q.disable()
        if cfg.qat.learn_amax:
            learnable_amax_parameters(model)
        stage = "control" if cfg.control else "qat"
        world = inputs.world
        loader = train_loader(inputs.task, inputs.data_dict, cfg, inputs.hyp_dict, augment=True, world=world)
        iters = cfg.iters or math.ceil(len(loader.dataset) / cfg.batch_size)  # 0: one pass over the images
        forward = data_parallel(model, world, inputs.device)
        with QATObjective(cfg.qat, model, teacher, inputs.hyp_dict, forward) as objective:
            tuner = FineTuner(objective, cfg.epochs, iters, amp=inputs.device.type == "cuda")
            start = 0
            if state is not None:
                tuner.load_state(state, inputs.device)
                start = state["epoch"]
            # epochs past the saved state are run again (seeded: the same); their entries would be duplicates
            report["qat"] = report.get("qat", [])[:start]
            report["qat_best"] = max(report["qat"], key=inputs.task.score, default=None)
            for epoch in range(start, cfg.epochs):
                t0 = time.perf_counter()
                batches = seeded_batches(loader, inputs.device, iters * world.size, seed=cfg.seed + 1 + epoch)
                desc = f"{PREFIX}{stage} epoch {epoch + 1}/{cfg.epochs}" if world.main else ""  # one progress bar
                losses = tuner.epoch(rank_batches(batches, world), desc)
                if world.main:
                    self.end_epoch(epoch + 1, tuner, losses, time.perf_counter() - t0)
                    save_checkpoint(model, state_file, epoch=epoch + 1, **tuner.state())
                world.barrier()

    def end_epoch(self, epoch: int, tuner: FineTuner, losses: dict, train_s: float) -> None:
        report, trained = self.report, tuner.trained
        metrics = measure(trained, self.inputs, self.cfg.nms, f"epoch {epoch}")
        f = self.weights_dir / f"qat_ep_{epoch}_ap_{_ap_tag(metrics)}_{self.stem}.pt"
        save_checkpoint(trained, f, stage="qat", epoch=epoch, metrics=metrics)
        entry = {"epoch": epoch, **{k: round(v, 6) for k, v in losses.items()},
                 "lr_end": tuner.optimizer.param_groups[0]["lr"], "train_s": round(train_s, 2), **metrics,
                 "file": str(f)}
        report["qat"].append(entry)
        best = report.get("qat_best")
        if best is None or self.inputs.task.score(metrics) > self.inputs.task.score(best):
            report["qat_best"] = entry
            report["qat_best_file"] = str(save_checkpoint(trained, self.weights_dir / f"qat_best_{self.stem}.pt",
                                                          stage="qat", epoch=epoch, metrics=metrics))
        # report first: a kill between the two repeats this epoch (the same, it is seeded) rather than lose it
        self.save_report()

    def finish(self) -> dict:
        report, task = self.report, self.inputs.task
        if not self.inputs.world.main:
            return report
        best = report.get("qat_best")
        label = "FP fine-tune best (control)" if self.cfg.control else "QAT best (PyTorch INT8)"
        rows = [("Origin (PyTorch)", report.get("origin")), ("PTQ (PyTorch INT8)", report.get("ptq")),
                (label, None if best is None else task.metrics(best))]
        report["table"] = metrics_table(rows)
        LOGGER.info("\n" + report["table"])
        report["finished"] = True
        (self.weights_dir / STATE_FILE).unlink(missing_ok=True)  # only needed to resume an unfinished run
        self.save_report()
        LOGGER.info(f"{PREFIX}results saved to {colorstr('bold', self.save_dir)}")
        return report


def quantize(cfg: RunConfig, out: OutputDir, skip_values: list[str] = ()) -> dict:
    """`qat.py quantize`: a new run."""
    inputs = load_inputs(cfg, skip_values)
    save_dir = inputs.world.broadcast(out.create() if inputs.world.main else None)  # one folder for all ranks
    report = {"config": cfg.to_dict(), "task": inputs.task.name, "world_size": inputs.world.size,
              "save_dir": str(save_dir)}
    with shutdown_after(inputs.world):
        return QuantizeRun(cfg, save_dir, report, inputs).run()


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
                         f"resume it with torchrun --nproc_per_node {started} (or without torchrun for 1)")
    cfg = replace(RunConfig.from_dict(report["config"]), **{k: v for k, v in keep.items() if v is not None})
    inputs = load_inputs(cfg)
    if inputs.world.main:
        for leftover in save_dir.rglob(".*.tmp"):  # half-written files of the interrupted run
            leftover.unlink()
    LOGGER.info(f"{PREFIX}resuming {save_dir} after {len(report.get('qat', []))} completed epoch(s)")
    with shutdown_after(inputs.world):
        return QuantizeRun(cfg, save_dir, report, inputs).run()


# --------------------------------------------------------------------------------------------------
# eval and sensitive
# --------------------------------------------------------------------------------------------------
def single_process(command: str) -> None:
    if world_from_env().distributed:
        raise ValueError(f"qat.py {command} runs in one process: start it without torchrun")


def evaluate_checkpoint(cfg: RunConfig, out: OutputDir) -> dict:
    """`qat.py eval`: the metrics of a quantized checkpoint on the validation images."""
    single_process("eval")
    device = select_device(cfg.device)
    data_dict = load_data(cfg.data)
    model = load_quantized_model(cfg.weights, device, cfg.trust_checkpoint)
    check_classes(model, data_dict, cfg.weights, cfg.data)
    task = task_of(model)
    val = val_loader(task, data_dict, cfg.imgsz, cfg.batch_size, cfg.workers, cfg.num_image, cfg.data)
    save_dir = out.create()
    t0 = time.perf_counter()
    inputs = Inputs(device, data_dict, model, task, val)
    metrics = measure(model, inputs, cfg.nms, str(cfg.weights))
    result = {"weights": str(cfg.weights), "data": str(cfg.data), "imgsz": cfg.imgsz, "task": task.name, **metrics,
              "eval_s": round(time.perf_counter() - t0, 2), "quantizers": quantizer_counts(model)}
    result["table"] = metrics_table([(f"INT8 (PyTorch) {Path(cfg.weights).name}", metrics)])
    LOGGER.info("\n" + result["table"])
    write_json(save_dir / "eval.json", result)
    return result


def sensitivity(cfg: RunConfig, out: OutputDir) -> dict:
    """`qat.py sensitive`: PTQ with every quantizer, then the mAP with one layer's quantizers off at a time."""
    single_process("sensitive")
    if is_quantized(read_checkpoint(cfg.weights, cfg.trust_checkpoint)["model"]):
        raise ValueError(f"--weights {cfg.weights}: sensitivity analysis starts from the float (converted) model, "
                         "not a quantized one")
    inputs = load_inputs(replace(cfg, epochs=0))
    save_dir = out.create()
    model = inputs.model
    quantize_model(model, cfg.quant)
    loader = train_loader(inputs.task, inputs.data_dict, cfg, inputs.hyp_dict, augment=False)
    n = min(cfg.quant.calib_batches, len(loader))
    calibrate(model, cfg.quant, (b.images for b in seeded_batches(loader, inputs.device, n, cfg.seed)))
    baseline = measure(model, inputs, cfg.nms, "PTQ baseline (all layers INT8)")
    layers = []
    for i, layer in enumerate(model.model):
        quantizers = layer_quantizers(model, i)
        if quantizers:
            with quantization_disabled(quantizers):
                metrics = measure(model, inputs, cfg.nms, f"layer {i} ({type(layer).__name__}) in float")
            layers.append({"layer": i, "module": type(layer).__name__, **metrics,
                           "ap_gain": round(metrics["ap"] - baseline["ap"], 5)})
    ranked = sorted(layers, key=lambda d: d["ap"], reverse=True)
    lines = ["| Rank | Layer | Module | AP (layer float) | AP gain vs PTQ | AP50 |", "|---|---|---|---|---|---|"]
    lines += [f"| {k + 1} | {d['layer']} | {d['module']} | {d['ap']:.4f} | {d['ap_gain']:+.4f} | {d['ap50']:.4f} |"
              for k, d in enumerate(ranked[:10])]
    summary = {"weights": str(cfg.weights), "data": str(cfg.data), "calib_method": cfg.quant.calib_method,
               "baseline_ptq": baseline, "layers": ranked, "table": "\n".join(lines)}
    LOGGER.info(f"\nPTQ baseline AP {baseline['ap']:.4f}; the most sensitive layers:\n" + summary["table"])
    write_json(save_dir / "summary-sensitive-analysis.json", summary)
    _bar_chart(ranked, baseline, save_dir / "sensitive-analysis.png")
    LOGGER.info(f"{PREFIX}results saved to {colorstr('bold', save_dir)}")
    return summary


def _bar_chart(layers: list[dict], baseline: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    order = sorted(layers, key=lambda d: d["layer"])
    fig, ax = plt.subplots(figsize=(max(6, len(order) * 0.35), 4))
    ax.bar([str(d["layer"]) for d in order], [d["ap_gain"] for d in order], color="tab:blue")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("layer kept in float")
    ax.set_ylabel("AP gain over full INT8 PTQ")
    ax.set_title(f"Quantization sensitivity (PTQ AP {baseline['ap']:.4f})")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def _images_noting_files(batches, files: list[str]):
    """The images of `batches`, appending each batch's file names to `files` as it goes."""
    for b in batches:
        files.extend(b.paths)
        yield b.images


def _ap_tag(metrics: dict | None) -> str:
    return "na" if metrics is None else f"{metrics['ap']:.4f}"
