"""Mixed precision to an accuracy budget: which INT8 tensors a run keeps in float (FP16 in the TensorRT graph).

The unit that can go float is an INT8 tensor class: one activation quantizer (after the TensorRT scale-sharing
rules, one object per tensor class) together with the weight quantizers of every conv that reads it. A whole class
moves at once, so a join never mixes scales and no conv reads a float input with INT8 weights; what is left is a
consistent Q/DQ graph whose float convs TensorRT runs in FP16.

`qat.py quantize --max-loss X` chooses on the select split, after PTQ calibration (models/pipeline.py):
1. rank every candidate by how much of the PTQ model's output error (against the float model, on one batch of
   select images) goes away with that candidate alone in float: one forward pass each (from the first layer the
   candidate is used in, models/core/layer_outputs.py), no evaluation;
2. measure `measured` of them on select, each alone in float (its cost: select mAP gained): half the ones that
   remove the most error per MAC (the cheap wins), half the ones that remove the most error at all (what a budget
   out of the cheap ones' reach needs); in one pass over select, each candidate's forward again from its first
   layer (candidate_metrics);
3. add them, most mAP per MAC first, measuring the growing set, until PTQ is within X of the float model.
If no set reaches X, the best set found is kept and the report says so. `qat.py sensitive` measures every
candidate the same way (step 2 over all of them).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn

from models.core.layer_outputs import LayerOutputs
from models.core.task import Task
from models.deployment.evaluate import NMSConfig, evaluate_each
from models.deployment.export import float_conv_nodes
from models.deployment.runners import TorchRunner
from models.quantization.held_state import held
from models.quantization.quantize import (float_convs, is_conv, is_enabled, named_quantizers, quantization_disabled,
                                          quantized_convs)
from utils.onnx_utils import model_to_onnx
from utils.qdq_lint import lint



@dataclass(frozen=True)
class MixedPrecision:
    """`max_loss`: select mAP50-95 the PTQ model may lose against the float model; `measured`: how many of the
    candidates ranked by output error are measured on select."""
    max_loss: float
    measured: int = 16

    def __post_init__(self):
        if self.max_loss < 0:
            raise ValueError(f"--max-loss must be >= 0 (mAP below the float model), got {self.max_loss}")
        if self.measured < 1:
            raise ValueError(f"mixed precision must measure at least one candidate, got {self.measured}")


@dataclass(frozen=True)
class Candidate:
    name: str                # the activation quantizer of the INT8 tensor class
    convs: tuple[str, ...]   # the convs that read it: they go float with it
    macs: int                # their multiply-accumulates per image at the run's image size


def conv_macs(model: nn.Module, imgsz: int) -> dict[str, int]:
    """Multiply-accumulates per image of every conv (quantized or not), at `imgsz`."""
    macs: dict[str, int] = {}
    hooks = [m.register_forward_hook(lambda mod, _, out, name=name: macs.__setitem__(
        name, out[0].numel() * mod.in_channels // mod.groups * mod.kernel_size[0] * mod.kernel_size[1]))
             for name, m in model.named_modules() if is_conv(m)]
    device = next(model.parameters()).device
    try:
        with torch.no_grad(), quantization_disabled(q for _, q in named_quantizers(model)):
            was_training = model.training
            model.eval()
            model(torch.zeros(1, 3, imgsz, imgsz, device=device))
            model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    return macs


def float_candidates(model: nn.Module, imgsz: int) -> list[Candidate]:
    """Every INT8 tensor class read by a quantized conv, in model order."""
    names = {id(q): n for n, q in named_quantizers(model, activations_only=True)}
    readers: dict[int, list[str]] = {}
    for name, _, reads, _ in quantized_convs(model):
        if is_enabled(reads):
            readers.setdefault(id(reads), []).append(name)
    macs = conv_macs(model, imgsz)
    return [Candidate(names[k], tuple(convs), sum(macs[c] for c in convs)) for k, convs in readers.items()]


def candidate_quantizers(model: nn.Module, candidates: list[Candidate]) -> list[nn.Module]:
    weights = {name: w for name, _, _, w in quantized_convs(model)}
    out = []
    for c in candidates:
        out.append(model.get_submodule(c.name))
        out += [weights[conv] for conv in c.convs]
    return out


@contextlib.contextmanager
def kept_float(model: nn.Module, candidates: list[Candidate]) -> Iterator[None]:
    """The model with `candidates` in float for the duration (their quantizers as identity)."""
    with quantization_disabled(candidate_quantizers(model, candidates)):
        yield


def keep_float(model: nn.Module, candidates: list[Candidate]) -> None:
    """Disable the candidates' quantizers for good: checkpoints, QAT and the export see them as float."""
    for q in candidate_quantizers(model, candidates):
        q.disable()


def output_error(outputs: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Relative squared error per output channel (box coordinates, class scores, mask coefficients each weigh the
    same whatever their units), summed."""
    total = 0.0
    for k, ref in reference.items():
        ref, out = ref.transpose(0, 1).flatten(1).double(), outputs[k].transpose(0, 1).flatten(1).double()
        total += float((((out - ref) ** 2).mean(1) / (ref ** 2).mean(1).clamp_min(1e-12)).sum())
    return total


def rank_by_output_error(passes: LayerOutputs, model: nn.Module, candidates: list[Candidate]
                         ) -> tuple[float, dict[str, float]]:
    """The all-INT8 model's output error, and each candidate's with it alone in float (lower: it caused more of
    the PTQ error), on the images of `passes`. A candidate's pass starts at the first layer that uses it, on the
    all-INT8 pass's outputs of the layers before; the weights are quantized once for all passes (none changes)."""
    runner = TorchRunner(model)

    def outputs(start: int, keep: bool = False) -> dict[str, torch.Tensor]:
        return runner.run(lambda: passes.run(start, keep=keep))
    with runner.held():
        with quantization_disabled(q for _, q in named_quantizers(model)):
            reference = outputs(0)
        errors = {"all INT8": output_error(outputs(0, keep=True), reference)}
        for c in candidates:
            with kept_float(model, [c]):
                errors[c.name] = output_error(outputs(passes.first_layer(candidate_quantizers(model, [c]))),
                                              reference)
    return errors.pop("all INT8"), errors


def int8_mac_share(model: nn.Module, imgsz: int) -> float:
    """The share of the convs' multiply-accumulates that run in INT8."""
    macs = conv_macs(model, imgsz)
    int8_convs = {name for name, _, _, weights in quantized_convs(model) if is_enabled(weights)}
    int8 = sum(v for k, v in macs.items() if k in int8_convs)
    return int8 / max(sum(macs.values()), 1)


def candidate_metrics(model: nn.Module, candidates: list[Candidate], loader, task: Task, nc: int, nms: NMSConfig,
                      desc: str) -> dict[str, dict]:
    """Each candidate's metrics over `loader` with it alone in float, in one pass over the images: per batch, one
    all-INT8 forward keeps its layer outputs and each candidate reruns from the first layer that uses it
    (models/core/layer_outputs.py: the layers before compute the same numbers either way); the weights are quantized
    once for all (none changes). One batch's layer outputs are held at a time."""
    runner = TorchRunner(model)

    def outputs_of(images: torch.Tensor) -> Iterator[tuple[str, dict]]:
        passes = LayerOutputs(model, runner.inputs(images))
        runner.run(lambda: passes.run(0))
        for c in candidates:
            with kept_float(model, [c]):
                outputs = runner.run(lambda: passes.run(passes.first_layer(candidate_quantizers(model, [c])),
                                                        keep=False))
            yield c.name, outputs
    with runner.held():
        return evaluate_each(outputs_of, loader, task, nc, nms, desc)


def costs_of(candidates: list[Candidate], measure_each: Callable[[list[Candidate]], dict[str, dict]],
             score: Callable[[dict], float], baseline: float) -> dict[str, float]:
    """Each candidate's cost in INT8: select mAP with it alone in float minus the all-INT8 model's."""
    metrics = measure_each(candidates)
    return {c.name: round(score(metrics[c.name]) - baseline, 6) for c in candidates}


def shortlist(candidates: list[Candidate], reduction: dict[str, float], n: int) -> list[Candidate]:
    """`n` candidates to measure: alternately the next best by output error removed per MAC and by output error
    removed, each once."""
    per_mac = sorted(candidates, key=lambda c: reduction[c.name] / max(c.macs, 1), reverse=True)
    overall = sorted(candidates, key=lambda c: reduction[c.name], reverse=True)
    picked: dict[str, Candidate] = {}
    for a, b in zip(per_mac, overall):
        for c in (a, b):
            if len(picked) < n:
                picked.setdefault(c.name, c)
    return list(picked.values())


def choose_float_set(model: nn.Module, candidates: list[Candidate], plan: MixedPrecision, origin: float, ptq: float,
                     measure: Callable[[str], dict], measure_each: Callable[[list[Candidate]], dict[str, dict]],
                     score: Callable[[dict], float], passes: LayerOutputs) -> tuple[dict, dict | None]:
    """The candidates to keep in float (see the module's docstring) and the record of the choice: the budget, the
    candidates measured and their costs, the sets tried, and whether the budget was reached; with the select
    metrics of the set kept (`measure`'s, already taken: None where nothing is kept). `measure(desc)`: the model's
    select metrics as it is; `measure_each(cs)`: each of `cs` alone in float (candidate_metrics)."""
    t0 = time.perf_counter()
    target = origin - plan.max_loss
    record = {"max_loss": plan.max_loss, "origin_select": origin, "all_int8_select": ptq, "candidates": len(candidates)}
    if ptq >= target:
        return {**record, "reached": True, "kept_float": [], "mixed_select": ptq, "measured": {}, "tried": [],
                "seconds": round(time.perf_counter() - t0, 2)}, None
    all_int8_error, errors = rank_by_output_error(passes, model, candidates)
    ranked = shortlist(candidates, {c.name: all_int8_error - errors[c.name] for c in candidates}, plan.measured)
    costs = costs_of(ranked, measure_each, score, ptq)
    gainful = sorted((c for c in ranked if costs[c.name] > 0), key=lambda c: costs[c.name] / c.macs, reverse=True)
    best, chosen, tried = (ptq, [], None), [], []
    for c in gainful:
        chosen.append(c)
        with kept_float(model, chosen):
            metrics = measure(f"{len(chosen)} tensor class(es) in float")
        s = score(metrics)
        tried.append({"kept_float": [x.name for x in chosen], "select": s})
        if s > best[0]:
            best = (s, list(chosen), metrics)
        if s >= target:
            break
    return {**record, "reached": best[0] >= target, "kept_float": [asdict(c) | {"cost": costs[c.name]}
                                                                   for c in best[1]],
            "mixed_select": best[0], "measured": {c.name: {"cost": costs[c.name], "output_error": errors[c.name]}
                                                  for c in ranked},
            "tried": tried, "output_error_all_int8": all_int8_error,
            "seconds": round(time.perf_counter() - t0, 2)}, best[2]


def deployment_summary(model: nn.Module, imgsz: int) -> dict:
    """What the engine of `model` will hold: the convs in float, the share of conv MACs in INT8, the INT8/float
    boundaries (from the Q/DQ lint of the graph the export writes, traced small: the topology is the same) and
    the lint's problem count (0: every join shares its scale, every float conv is float on purpose)."""
    convs = float_convs(model)
    with held(model):
        proto = model_to_onnx(model)
    report = lint(proto, kept_float=tuple(float_conv_nodes(proto.graph, convs)))
    return {"float_convs": convs, "int8_mac_share": round(int8_mac_share(model, imgsz), 4),
            "boundaries": len(report.boundaries), "lint_problems": report.problems}
