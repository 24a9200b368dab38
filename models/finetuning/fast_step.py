"""The QAT step at the speed of its GPU kernels rather than of Python.

Eagerly, a fake-quantized step launches one kernel per op from Python (several per quantizer and conv, forward and
backward), and on a GPU the kernels are shorter than their launches: the GPU waits on the host. The fast step
- keeps the student, the teacher and the images channels-last: cuDNN's FP16 convolutions are NHWC, and NCHW tensors
  cost a transpose on each side of every conv;
- compiles the student's and the teacher's forward (and so the student's backward) with torch.compile and replays
  them as CUDA graphs (one launch for a whole graph): with inductor (`--step inductor`, mode "reduce-overhead"),
  fake quantization (TensorRT's symmetric ranges, as elementwise ops: models/quantization/fake_quant.py),
  activations, residual adds and average pooling also fuse into few kernels; the "cudagraphs" backend (`--step
  cudagraphs`) captures the ops unfused (the native fake-quantize kernels, one per quantizer), for a fraction of
  the compile time;
- steps Adam with its fused kernel (models/finetuning/finetune.py `optimizer_for`).
Between the compiled forward and backward, the loss runs eagerly: its shapes change with every batch's targets. It
reads nothing back from the device (models/core/sync_free_loss.py: detection's, and segmentation's, whose mask term
upstream computes in a loop over the images that reads each one's foreground), so the host launches it while the GPU
still runs the forward. The compile costs its first step; `--step auto` compiles only where the planned iterations
and images repay it (`AUTO`). Where the step is not compiled it runs eagerly, and the log says why once.
The scales the compiled forward reads are held per epoch (models/quantization/held_state.py says what invalidates them).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

STEP_MODES = ("auto", "inductor", "cudagraphs", "eager")
COMPILE_MODE = "reduce-overhead"  # inductor's CUDA graphs over the compiled graphs: the launches were the cost


@dataclass(frozen=True)
class StepPlan:
    """How the fine-tuning step runs, and why (logged once)."""

    compiled: bool
    channels_last: bool
    fused_optimizer: bool
    reason: str
    backend: str = "inductor"          # torch.compile's backend
    mode: str | None = COMPILE_MODE    # its mode (inductor's; None for other backends)
    fused_quantizers: bool = False     # quantizers as elementwise ops that the backend fuses (held_state.held)

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format


EAGER = StepPlan(compiled=False, channels_last=False, fused_optimizer=False, reason="eager")


@dataclass(frozen=True)
class AutoRule:
    """What `--step auto` compiles with, from what the run plans. The two compiled steps save time differently:
    CUDA-graph replay saves the kernel launches of a step, the same whatever its batch; inductor's fused kernels save
    memory traffic on every image, on top of that. So inductor where the planned images (iterations x this
    process's batch) repay its longer compile against cudagraphs, else cudagraphs where the planned iterations repay
    its compile against the eager step, else eager. A threshold is where a compile has repaid itself: (first
    epoch's extra seconds) / (seconds saved per image, or per iteration)."""

    inductor_images: int
    cudagraphs_iterations: int

    def backend_for(self, iterations: int | None, batch: int | None = None) -> str | None:
        """The backend for `iterations` planned iterations of `batch` images (None: unknown, the fastest step), or
        None (eager)."""
        if iterations is None or (batch is not None and iterations * batch >= self.inductor_images):
            return "inductor"
        return "cudagraphs" if iterations >= self.cudagraphs_iterations else None


# Measured with scripts/benchmark_step.py (results/fast-step/, gelan-c on helmet, one H200 per run, batch 10, 200
# iterations an epoch): the compile's extra first-epoch seconds and the steady epochs were, at 640 / 416 px,
# inductor 156 / 158 s extra, 14.3 / 12.1 s an epoch; cudagraphs 49 / 44 s extra, 19.4 / 19.4 s; eager 31.5 / 30.3 s.
# cudagraphs repays itself against eager after ~820 iterations at both sizes; inductor against cudagraphs after
# 42,000 / 31,000 images (2.6 / 3.7 ms saved per image). At batch 32 (640 px, scripts/benchmark_throughput.py on an
# H200: results/scaling/gelan-c.json, 202 img/s and a 124 s first step; cudagraphs 138 img/s in issue 68) inductor
# saves 2.3 ms per image and repays ~97 s more compile (124 s against 27) after ~42,000 images: as at batch 10. With
# the quantizers fused under inductor (results/scaling/h200x2/2026-11-29-b/, batch 10, 640 px) its steps took 43.0
# ms against cudagraphs' 84.3 for 136 s more compile: repaid after ~32,000 images on that host. The thresholds leave
# room for slower hosts (the compile runs on the CPU).
AUTO = AutoRule(inductor_images=50_000, cudagraphs_iterations=1000)


def _compiled_plan(backend: str, why: str) -> StepPlan:
    inductor = backend == "inductor"
    mode = COMPILE_MODE if inductor else None
    return StepPlan(True, True, True, f"compiled ({backend}{f', {mode}' if mode else ''}{why}), channels-last, "
                                      "fused Adam", backend, mode, fused_quantizers=inductor)


def plan_step(requested: str, device: torch.device, learn_amax: bool, iterations: int | None = None,
              batch: int | None = None, rule: AutoRule = AUTO, held_scales: bool = True) -> StepPlan:
    """The fast step where it applies: a CUDA device, calibrated (not learned) ranges that the
    quantizers read as held scales (`held_scales`: models/quantization/held_state.py), and for `auto` enough planned
    iterations of `batch` images (this process's) to repay a compile (`rule`; None: unknown, compiled)."""
    if requested not in STEP_MODES:
        raise ValueError(f"--step must be one of {STEP_MODES}, got {requested!r}")
    backend = rule.backend_for(iterations, batch) if requested == "auto" else requested
    why_not = ("--step eager" if requested == "eager" else
               "not a CUDA device" if device.type != "cuda" else
               "--learn-amax changes the ranges every step" if learn_amax else
               "the quantizers compute their scales at every call (--backend modelopt)" if not held_scales else
               f"{iterations} iterations planned: a compile repays its first step from about "
               f"{rule.cudagraphs_iterations}" if backend is None else "")
    if why_not:  # on a GPU, what needs no compiler still applies, unless the eager step was asked for
        gpu = device.type == "cuda" and requested != "eager"
        return StepPlan(False, gpu, gpu, f"eager ({why_not})" + (", channels-last, fused Adam" if gpu else ""))
    planned = (f"; {iterations} iterations{'' if batch is None else f' of {batch} images'} planned"
               if requested == "auto" and iterations is not None else "")
    return _compiled_plan(backend, planned)


def to_layout(model: nn.Module, plan: StepPlan) -> nn.Module:
    """The model's 4-D weights in the plan's memory format, in place (the parameters stay the same objects)."""
    return model.to(memory_format=plan.memory_format) if plan.channels_last else model


def compiled(forward: nn.Module, plan: StepPlan) -> nn.Module:
    """`forward` compiled for the plan (traced at its first call), or itself when the step is eager. Backends other
    than inductor compile the graph with its nearest-neighbour upsampling rewritten (`upsample_by_repeat`)."""
    if not plan.compiled:
        return forward
    backend = plan.backend if plan.backend == "inductor" else _after_rewrites(plan.backend)
    return torch.compile(forward, backend=backend, mode=plan.mode)


def _after_rewrites(name: str):
    """The backend `name`, given the graph after `upsample_by_repeat`."""
    from torch._dynamo import lookup_backend
    inner = lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        upsample_by_repeat(gm)
        return inner(gm, example_inputs)
    return backend


def upsample_by_repeat(gm: torch.fx.GraphModule) -> int:
    """Rewrites, in place, each nearest-neighbour upsampling of a 4-D tensor by whole factors in a graph traced by
    torch.compile (F.interpolate: upstream's nn.Upsample) as `repeat_pixels`; returns how many. AOT autograd traces
    F.interpolate as an indexed read, whose gradient is an indexed accumulation: on the GPU a sort-based kernel, 3.3 ms
    for each of gelan-c's two upsamplings in a step of 10 images at 640 px (~10 % of the cudagraphs step, one H200).
    `repeat_pixels` gives the same values, and its gradient is a sum over each block. Inductor is left as it is: it
    writes the accumulation as one fused kernel (1.6 % of its step's GPU time at 16 images a GPU:
    results/scaling/h200x2/2026-11-30-e/)."""
    rewritten = 0
    for node in gm.graph.nodes:
        factors = _whole_nearest_factors(node)
        if factors is not None:
            node.target, node.args, node.kwargs = repeat_pixels, (node.args[0], *factors), {}
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _whole_nearest_factors(node: torch.fx.Node) -> tuple[int, int] | None:
    """(height, width) factors where `node` upsamples a 4-D tensor to nearest pixels by whole factors, else None."""
    if node.op != "call_function" or node.target is not torch.nn.functional.interpolate:
        return None
    try:
        bound = inspect.signature(torch.nn.functional.interpolate).bind(*node.args, **node.kwargs).arguments
    except TypeError:
        return None
    source = bound["input"].meta.get("example_value") if isinstance(bound["input"], torch.fx.Node) else None
    scale = bound.get("scale_factor")
    scales = tuple(scale) if isinstance(scale, (tuple, list)) else (scale, scale)
    if (bound.get("mode", "nearest") != "nearest" or bound.get("size") is not None or bound.get("antialias")
            or not isinstance(source, torch.Tensor) or source.dim() != 4 or len(scales) != 2
            or not all(isinstance(f, (int, float)) and f >= 1 and float(f).is_integer() for f in scales)):
        return None
    return int(scales[0]), int(scales[1])


def repeat_pixels(x: torch.Tensor, fh: int, fw: int) -> torch.Tensor:
    """Each pixel of an (N, C, H, W) tensor repeated as an fh x fw block (nearest-neighbour upsampling by whole
    factors), in the input's memory format (channels-last stays channels-last)."""
    n, c, h, w = x.shape
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        blocks = x.permute(0, 2, 3, 1)[:, :, None, :, None, :].expand(n, h, fh, w, fw, c)
        return blocks.reshape(n, h * fh, w * fw, c).permute(0, 3, 1, 2)
    return x[:, :, :, None, :, None].expand(n, c, h, fh, w, fw).reshape(n, c, h * fh, w * fw)


def compile_counts() -> dict[str, int]:
    """This process's compiled graphs so far, and how many of them run without CUDA graphs (torch.compile's
    counters; inductor names each skip's reason in its `cudagraphs` log, TORCH_LOGS=cudagraphs). A skipped graph
    launches each of its kernels from Python again: the cost the compiled step exists to remove. More graphs than
    the student's and the teacher's forward: a graph break. DistributedDataParallel's split at its buckets does not
    count here (2 H200s: 2 graphs, while the profile showed about ten compiled pieces of the student's forward)."""
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"], "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


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
