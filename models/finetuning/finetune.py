"""Quantization-aware fine-tuning (QAT) of a calibrated INT8 model: the recipe and its parts.

A `QATRecipe` says what the fake-quantized student learns from (the float teacher's layer outputs, the
teacher's detections, the dataset's labels, or a mix), with which learning-rate schedule, and whether
activation ranges (amax) are learned and weights averaged (EMA). `QATObjective` turns a recipe into a loss;
a `FineTuner` runs epochs of it. Presets: `RECIPES["default"]` (the measured best, see
docs/RESULTS.md) and `RECIPES["reference"]` (NVIDIA's YOLOv9 QAT recipe: per-layer MSE, Adam 1e-5, which
on real photographs lost accuracy against PTQ).
"""
from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from models.core.losses import feature_maps, head_distillation
from models.core.task import Task, task_of
from models.finetuning.fast_step import EAGER, StepPlan, begin_step, compile_counts, teacher_mode
from models.quantization.held_state import held
from models.quantization.quantize import learnable_amax_parameters
from utils.general import TQDM_BAR_FORMAT

DISTILL_TARGETS = ("head", "layers", "none")
LR_SCHEDULES = ("cosine", "step")


@dataclass(frozen=True)
class QATRecipe:
    """What QAT optimises. Every field has a CLI flag of the same name in `qat.py quantize`."""

    distill: str = "head"          # head: teacher's class scores + box distributions; layers: per-layer MSE; none
    supervision_stride: int = 1    # layers: distil every N-th top-level layer's output (and the head's)
    det_loss: float = 1.0          # weight of upstream's detection loss on the dataset's labels (0: off)
    lr: float = 1e-4               # peak learning rate (Adam)
    lr_schedule: str = "cosine"    # cosine: warm-up then cosine decay per iteration; step: the reference's
    learn_amax: bool = False       # activation amax as trained parameters (LSQ gradient)
    ema: float = 0.0               # decay of an exponential moving average of the weights (0: off)

    def __post_init__(self):
        if self.distill not in DISTILL_TARGETS:
            raise ValueError(f"--distill must be one of {DISTILL_TARGETS}, got {self.distill!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.distill == "none" and self.det_loss <= 0:
            raise ValueError("--distill none needs --det-loss > 0: the student would learn from nothing")
        if self.lr < 0 or self.det_loss < 0 or not 0 <= self.ema < 1 or self.supervision_stride < 1:
            raise ValueError("--lr and --det-loss must be >= 0, --ema in [0, 1), --supervision-stride >= 1")

    def to_dict(self) -> dict:
        return asdict(self)

    def with_overrides(self, **overrides) -> "QATRecipe":
        """This recipe with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


# default: the best of the ablation on real photographs (docs/RESULTS.md, helmet-416, H100): head distillation
# plus the detection loss, Adam 1e-4 with cosine decay. Learned amax and EMA measured no gain on top of it.
RECIPES = {
    "default": QATRecipe(),
    "reference": QATRecipe(distill="layers", det_loss=0.0, lr=1e-5, lr_schedule="step"),
}


# --------------------------------------------------------------------------------------------------
# Learning-rate schedules
# --------------------------------------------------------------------------------------------------
def lr_at(step: int, total: int, epochs: int, recipe: QATRecipe) -> float:
    """Learning rate of iteration `step` of `total` (over `epochs` epochs)."""
    lr = recipe.lr
    if recipe.lr_schedule == "step":  # reference: lr/10 for the first 30 % of epochs and the last 20 %
        if epochs <= 2:
            return lr
        epoch = step * epochs // max(total, 1)
        warm, cool = max(1, round(0.3 * epochs)), round(0.8 * epochs)
        return lr / 10 if epoch < warm or epoch >= cool else lr
    warmup = max(1, total // 20)
    if step < warmup:  # linear warm-up from lr/10: the first steps see freshly quantized, noisy gradients
        return lr * (0.1 + 0.9 * step / warmup)
    progress = (step - warmup) / max(total - warmup, 1)
    return lr * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * progress)))


# --------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------
def supervised_layers(n_layers: int, stride: int) -> list[int]:
    """Every `stride`-th top-level layer, and always the head."""
    if stride < 1:
        raise ValueError(f"--supervision-stride must be >= 1, got {stride}")
    return sorted(set(range(0, n_layers, stride)) | {n_layers - 1})


class LayerTap:
    """Forward hooks recording the outputs of chosen top-level layers.

    Empty the tap (`clear`) before each forward: a compiled forward traces the hooks with the dict as it finds it
    and guards on its keys, so a forward that found last step's outputs there would be traced a second time."""

    def __init__(self, model: nn.Module, layers: Iterable[int]):
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self._handles = [model.model[i].register_forward_hook(self._hook(i)) for i in layers]

    def _hook(self, i):
        def record(_module, _inputs, out):
            self.outputs[i] = out
        return record

    def clear(self) -> None:
        self.outputs.clear()

    def remove(self):
        for h in self._handles:
            h.remove()


class QATObjective:
    """The loss of a recipe: distillation from the float teacher and/or upstream's detection (segmentation) loss
    on labels. Segmentation heads distil their masks too (`mask_distill_loss`).

    Call with a batch (images 0-1, upstream targets, instance masks for segmentation); returns the total loss
    and its parts (floats). `forward` runs the student (a DistributedDataParallel wrapper of it, in a distributed
    job); the layer taps and the loss read the student itself. `teacher_forward` runs the teacher (compiled, in
    the fast step: models/finetuning/fast_step.py). `task`: the run's (its training masks, which the loss reads as
    the loader makes them); by default the student's, with upstream's default masks. Use as a context manager: the
    layer hooks are removed on exit.
    """

    def __init__(self, recipe: QATRecipe, student: nn.Module, teacher: nn.Module, hyp: dict | None = None,
                 forward: nn.Module | None = None, teacher_forward: nn.Module | None = None, task: Task | None = None):
        self.recipe, self.student, self.teacher = recipe, student, teacher
        self.forward = student if forward is None else forward  # DistributedDataParallel(student) when distributed
        self.teacher_forward = teacher if teacher_forward is None else teacher_forward
        head = student.model[-1]
        self.nc, self.reg_max = int(head.nc), int(getattr(head, "reg_max", 16))
        n = len(student.model)
        self.layers = supervised_layers(n, recipe.supervision_stride) if recipe.distill == "layers" else [n - 1]
        self.s_tap, self.t_tap = LayerTap(student, self.layers), LayerTap(teacher, self.layers)
        self.det_loss = None
        if recipe.det_loss > 0:
            if hyp is None:
                raise ValueError("--det-loss needs the training hyperparameters (--hyp)")
            student.hyp = hyp  # upstream's loss reads its class-loss settings from model.hyp
            self.det_loss = (task or task_of(student)).loss(student)  # the run's task: its loader's masks

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.s_tap.remove()
        self.t_tap.remove()

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, masks: torch.Tensor | None = None,
                 clock: "StepClock | None" = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The total loss and its parts (detached tensors: reading them waits for the device, so the caller reads
        them when it needs them)."""
        recipe, mark = self.recipe, (clock or NO_CLOCK).mark
        self.s_tap.clear()
        self.t_tap.clear()
        with torch.no_grad():
            self.teacher_forward(images)
        mark("teacher forward")
        preds = self.forward(images)
        mark("student forward")
        parts, total = {}, images.new_zeros(())
        if recipe.distill == "layers":
            loss = sum(F.mse_loss(s.float(), t.float()) for i in self.layers
                       for s, t in zip(feature_maps(self.s_tap.outputs[i]), feature_maps(self.t_tap.outputs[i])))
            parts["distill"], total = loss.detach(), total + loss
        elif recipe.distill == "head":
            head = self.layers[-1]
            loss, mask_loss = head_distillation(self.s_tap.outputs[head], self.t_tap.outputs[head], self.nc,
                                                self.reg_max)
            if mask_loss is not None:
                parts["distill_mask"] = mask_loss.detach()
            parts["distill"], total = loss.detach(), total + loss
        if self.det_loss is not None:
            loss = self.det_loss(preds, targets, None if masks is None else masks.to(images.device))
            loss = loss / images.shape[0]  # upstream scales by the batch size; per image here
            parts["det"], total = loss.detach(), total + recipe.det_loss * loss
        mark("losses")
        return total, parts


class StepClock:
    """Where a training step's time goes: wall time per phase, the device synchronized at every boundary so that
    phases do not overlap (a breakdown; it slows the step, so throughput is measured without it)."""

    def __init__(self, device: torch.device | None, enabled: bool = True):
        self.sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)
        self._last = None

    def start(self) -> None:
        if not self.enabled:
            return
        self.sync()
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self._last is None:
            return
        self.sync()
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now


NO_CLOCK = StepClock(None, enabled=False)  # never starts: its marks cost nothing


# --------------------------------------------------------------------------------------------------
# Weight averaging
# --------------------------------------------------------------------------------------------------
class WeightEMA:
    """Exponential moving average of a model's parameters and floating buffers (amax included).

    Shared quantizers are one object, so tensors are walked once each (`parameters()` and `buffers()`
    skip duplicates; a state_dict would list a shared amax under every name and decay it several times).
    The decay ramps up over the first `tau` updates, as upstream's ModelEMA.
    """

    def __init__(self, model: nn.Module, decay: float, tau: float = 200.0, updates: int = 0):
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.decay, self.tau, self.updates = decay, tau, updates

    @staticmethod
    def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
        """By name, so a learned amax (a parameter) pairs with a frozen one (a buffer) of a resumed copy."""
        out = dict(model.named_parameters())
        out.update((n, b) for n, b in model.named_buffers() if b.is_floating_point())
        return out

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau))
        current = self._tensors(model)
        averaged = self._tensors(self.model)
        new = [current[name].detach().to(e.dtype) for name, e in averaged.items()]
        torch._foreach_lerp_(list(averaged.values()), new, 1 - d)  # e += (1 - d)(new - e): a launch per group


# --------------------------------------------------------------------------------------------------
# The epoch
# --------------------------------------------------------------------------------------------------
def optimizer_for(model: nn.Module, recipe: QATRecipe, fused: bool = False) -> torch.optim.Optimizer:
    """Adam over the weights (and the activation amax when learned): scale-free, so losses of different
    magnitudes (distillation, detection) need no per-model tuning of the learning rate. `fused` (GPU): one kernel
    launch for all parameters instead of several per parameter."""
    params = [p for p in model.parameters() if p.requires_grad]
    if recipe.learn_amax:
        params += learnable_amax_parameters(model)
    unique = list({id(p): p for p in params}.values())
    return torch.optim.Adam(unique, lr=recipe.lr, fused=fused or None)


class FineTuner:
    """One fine-tuning run of a recipe: the optimizer, the AMP scaler (on CUDA), the weight EMA and the learning-rate
    schedule over `epochs` x `iters` iterations. `epoch()` runs the next epoch; the state resumes a run."""

    def __init__(self, objective: QATObjective, epochs: int, iters: int, amp: bool, clock: StepClock | None = None,
                 plan: StepPlan = EAGER):
        self.objective, self.epochs, self.iters, self.plan = objective, epochs, iters, plan
        self.clock = clock or NO_CLOCK
        self.first_step_s: float | None = None  # of a compiled step: tracing and compiling included
        self.first_step_compiled: dict[str, int] = {}  # what its first step compiled (fast_step.compile_counts)
        recipe, student = objective.recipe, objective.student
        self.optimizer = optimizer_for(student, recipe, fused=plan.fused_optimizer)
        self.scaler = torch.amp.GradScaler("cuda") if amp else None
        self.ema = WeightEMA(student, recipe.ema) if recipe.ema else None
        self.step_count = 0

    @property
    def trained(self) -> nn.Module:
        """What is evaluated and saved: the EMA of the weights where the recipe keeps one."""
        return self.ema.model if self.ema is not None else self.objective.student

    def state(self) -> dict:
        return {"step": self.step_count, "optimizer": self.optimizer.state_dict(),
                "scaler": None if self.scaler is None else self.scaler.state_dict(),
                **({} if self.ema is None else {"ema": self.ema.model, "ema_updates": self.ema.updates})}

    def load_state(self, state: dict, device: torch.device) -> None:
        self.step_count = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            self.ema.model, self.ema.updates = state["ema"].to(device), state["ema_updates"]

    def step(self, images: torch.Tensor, targets: torch.Tensor, masks: torch.Tensor | None
             ) -> dict[str, torch.Tensor | float]:
        """One optimizer step at the schedule's learning rate; the loss parts (detached tensors) and the rate."""
        objective, mark = self.objective, self.clock.mark
        begin_step(self.plan)
        images = images.contiguous(memory_format=self.plan.memory_format)
        lr = lr_at(self.step_count, self.epochs * self.iters, self.epochs, objective.recipe)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        autocast = torch.autocast("cuda", dtype=torch.float16) if self.scaler is not None else nullcontext()
        with autocast:
            loss, parts = objective(images, targets, masks, self.clock)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            mark("backward (+ gradient all-reduce)")
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            mark("backward (+ gradient all-reduce)")
            self.optimizer.step()
        mark("optimizer")
        if self.ema is not None:
            self.ema.update(objective.student)
            mark("ema")
        self.step_count += 1
        return {**parts, "loss": loss.detach(), "lr": lr}

    def epoch(self, batches: Iterator[tuple], desc: str, show_every: int = 10) -> dict[str, float]:
        """One epoch of `iters` iterations over (images 0-1, targets, masks or None, ...) batches; the mean of each
        loss part."""
        self.objective.student.train()
        self.objective.teacher.train(teacher_mode(self.objective.teacher, self.plan))
        # the ranges' scales for this epoch, computed from amax now (it may have been calibrated anew since)
        with held(self.objective.student, self.objective.teacher, fusable=self.plan.fused_quantizers):
            sums, n = self._steps(batches, desc, show_every)
        self.objective.teacher.eval()
        return {k: float(v) / max(n, 1) for k, v in sums.items()}

    def _steps(self, batches: Iterator[tuple], desc: str, show_every: int) -> tuple[dict[str, torch.Tensor], int]:
        """The epoch's steps: the sums of the loss parts and the step count. The losses stay on the device (summed
        there) and are read every `show_every` steps for the progress bar: a read waits for the device, and a wait
        every step stalls the GPU."""
        sums: dict[str, torch.Tensor] = {}
        n = 0
        pbar = tqdm(total=self.iters, desc=desc, bar_format=TQDM_BAR_FORMAT, disable=not desc)
        batches = iter(batches)
        while True:
            self.clock.start()
            batch = next(batches, None)
            if batch is None:
                break
            self.clock.mark("data (wait + host-to-device)")
            first = self.first_step_s is None and self.plan.compiled
            t0, counts = time.perf_counter(), compile_counts() if first else {}
            parts = self.step(*batch[:3])
            if first:
                parts["loss"].item()  # waits for the device, once
                self.first_step_s = time.perf_counter() - t0
                self.first_step_compiled = {k: v - counts[k] for k, v in compile_counts().items()}
            lr = parts.pop("lr")
            n += 1
            for k, v in parts.items():
                sums[k] = sums[k] + v if k in sums else v.clone()
            pbar.update()
            if desc and (n % show_every == 0 or n == self.iters):
                pbar.set_postfix(loss=f"{float(parts['loss']):.5f}", lr=f"{lr:.2e}")
            self.clock.mark("progress and bookkeeping")
        pbar.close()
        return sums, n
