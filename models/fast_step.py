"""The QAT step at the speed of its GPU kernels rather than of Python.

Eagerly, a fake-quantized step launches one kernel per op from Python (several per quantizer and conv, forward and
backward), and on a GPU the kernels are shorter than their launches: the GPU waits on the host. The fast step
- keeps the student, the teacher and the images channels-last: cuDNN's FP16 convolutions are NHWC, and NCHW tensors
  cost a transpose on each side of every conv;
- compiles the student's and the teacher's forward (and so the student's backward) with torch.compile: fake
  quantization (TensorRT's symmetric ranges, one op each), activations, residual adds and average pooling fuse
  into few kernels, replayed as CUDA graphs (one launch for a whole graph) in mode "reduce-overhead";
- steps Adam with its fused kernel (models/finetune.py `optimizer_for`).
Between the compiled forward and backward, the loss runs eagerly: upstream's target assignment reads counts back to
the host and changes shape with every batch. Where the step cannot be compiled it runs eagerly, and the log says
why once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from models.quantize import Int8Quantizer

STEP_MODES = ("auto", "eager")
COMPILE_MODE = "reduce-overhead"  # CUDA graphs over the compiled graphs: the launches were the cost


@dataclass(frozen=True)
class StepPlan:
    """How the fine-tuning step runs, and why (logged once)."""

    compiled: bool
    channels_last: bool
    fused_optimizer: bool
    reason: str

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format


EAGER = StepPlan(compiled=False, channels_last=False, fused_optimizer=False, reason="eager")


def plan_step(requested: str, device: torch.device, segmentation: bool, learn_amax: bool) -> StepPlan:
    """The fast step where it applies: a CUDA device, a detection model, calibrated (not learned) ranges."""
    if requested not in STEP_MODES:
        raise ValueError(f"--step must be one of {STEP_MODES}, got {requested!r}")
    why_not = ("--step eager" if requested == "eager" else
               "not a CUDA device" if device.type != "cuda" else
               "segmentation heads are not compiled yet" if segmentation else
               "--learn-amax changes the ranges every step" if learn_amax else "")
    if why_not:  # on a GPU, what needs no compiler still applies, unless the eager step was asked for
        gpu = device.type == "cuda" and requested != "eager"
        return StepPlan(False, gpu, gpu, f"eager ({why_not})" + (", channels-last, fused Adam" if gpu else ""))
    return StepPlan(True, True, True, f"compiled ({COMPILE_MODE}), channels-last, fused Adam")


def to_layout(model: nn.Module, plan: StepPlan) -> nn.Module:
    """The model's 4-D weights in the plan's memory format, in place (the parameters stay the same objects)."""
    return model.to(memory_format=plan.memory_format) if plan.channels_last else model


def compiled(forward: nn.Module, plan: StepPlan) -> nn.Module:
    """`forward` compiled for the plan (traced at its first call), or itself when the step is eager."""
    return torch.compile(forward, mode=COMPILE_MODE) if plan.compiled else forward


def refresh_scales(*models: nn.Module) -> None:
    """Every calibrated quantizer's scale computed eagerly: a compiled forward reads them as constants (and traces
    again when one is replaced), it cannot read amax back to the host itself."""
    for model in models:
        for m in model.modules():
            if isinstance(m, Int8Quantizer) and getattr(m, "_amax", None) is not None:
                m.scale_params()


def begin_step(plan: StepPlan) -> None:
    """Marks a new iteration for the CUDA graphs: the last step's graph outputs may be overwritten from here."""
    if plan.compiled:
        torch.compiler.cudagraph_mark_step_begin()


def teacher_mode(teacher: nn.Module, plan: StepPlan) -> bool:
    """Whether the teacher runs in training mode: in the compiled step, when it has no batch norm or dropout (a fused
    model), for then it computes the same maps without the eval head's box decoding, which keeps its anchors on the
    module: graph outputs that the next CUDA-graph replay overwrites."""
    stateful = (nn.modules.batchnorm._BatchNorm, nn.Dropout)
    return plan.compiled and not any(isinstance(m, stateful) for m in teacher.modules())
