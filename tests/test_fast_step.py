"""The compiled fine-tuning step (models/finetuning/fast_step.py) against the eager one, on real upstream GELAN blocks
and real quantizers: the same loss, gradients, updated weights and quantized outputs; and where the fast step applies."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import yaml
from conftest import CHECKOUT, REDUCED_SIZE, TRAINED_T, NothingHeld, tiny_gelan

from models.finetuning.fast_step import EAGER, AutoRule, StepPlan, compiled, plan_step, repeat_pixels, teacher_mode
from models.finetuning.finetune import RECIPES, FineTuner, QATObjective
from models.quantization.held_state import held
from models.quantization.quantize import QuantRecipe, calibrate, copy_float, quantize_model

NC = 3


def _batches(n: int, size: int = 64) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(images, targets, overlap masks at 1/4 resolution) as upstream's segmentation loader gives them: 2 images,
    2 boxes each, each mask pixel the 1-based index of the image's box covering it (the larger box drawn first)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        boxes = torch.cat([torch.tensor([[0.0], [0.0], [1.0], [1.0]]), torch.randint(0, NC, (4, 1), generator=g).float(),
                           torch.rand(4, 2, generator=g) * 0.5 + 0.25, torch.rand(4, 2, generator=g) * 0.3 + 0.1], 1)
        masks = torch.zeros(2, size // 4, size // 4)
        for image in range(2):
            mine = boxes[boxes[:, 0] == image]
            for index in (mine[:, 4] * mine[:, 5]).argsort(descending=True).tolist():
                x0, y0, x1, y1 = ((mine[index, 2:4] - mine[index, 4:6] / 2).tolist()
                                  + (mine[index, 2:4] + mine[index, 4:6] / 2).tolist())
                masks[image, int(y0 * size / 4):int(y1 * size / 4), int(x0 * size / 4):int(x1 * size / 4)] = index + 1
        out.append((torch.rand(2, 3, size, size, generator=g), boxes, masks))
    return out


@pytest.fixture(scope="module")
def tiny_ptq(tmp_path_factory):
    """A tiny segmenter, fused, quantized and calibrated, and its float teacher: the segmentation head computes the
    detection head's maps as well (Segment runs Detect's forward), so one model covers both tasks' compiled steps."""
    from models.yolo import SegmentationModel
    cfg = tmp_path_factory.mktemp("tiny") / "tiny-gelan-seg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_gelan(NC, segment=True)))
    torch.manual_seed(0)
    model = SegmentationModel(str(cfg), nc=NC).eval()
    model.fuse()
    teacher = copy_float(model)
    quantize_model(model)
    calibrate(model, QuantRecipe(calib_method="max"), [b[0] for b in _batches(2)])
    return model, teacher


def _train(model, teacher, plan: StepPlan, batches) -> tuple[list[float], dict, torch.nn.Module]:
    """Losses of each step, the gradients after the first, and the student after all of them."""
    from models.finetuning.fast_step import to_layout
    student, teacher = copy.deepcopy(model), copy.deepcopy(teacher)
    to_layout(student, plan)
    to_layout(teacher, plan)
    hyp = yaml.safe_load((CHECKOUT / "data/hyps/hyp.scratch-high.yaml").read_text())
    losses, grads = [], {}
    with QATObjective(RECIPES["default"], student, teacher, hyp, compiled(student, plan),
                      compiled(teacher, plan)) as objective:
        tuner = FineTuner(objective, 1, len(batches), amp=False, plan=plan)
        student.train()
        teacher.train(teacher_mode(teacher, plan))
        with held(student, teacher, fusable=plan.fused_quantizers):  # as FineTuner.epoch does
            for i, (images, targets, masks) in enumerate(batches):
                parts = tuner.step(images, targets, masks)
                losses.append(float(parts["loss"]))
                if i == 0:
                    assert {"distill", "distill_mask", "det"} <= parts.keys()  # masks distilled; upstream's segment loss
                    grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    return losses, grads, student.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def test_compiled_step_gives_the_eager_steps_numbers(tiny_ptq):
    """The backend is aot_eager_decomp_partition: what inductor does with the step before it writes kernels (the
    traced graphs, its decompositions, the forward/backward partition with its recomputations, the held scales as
    graph inputs) run by eager kernels. Inductor's own code generation is left out: on a CPU it writes C++ (minutes
    of compiling here), on the GPU Triton, so these would not be the GPU's kernels anyway; those are measured by the
    GPU step benchmark (results/fast-step/). Tolerances: the compiled step computes the same function in another
    order (decomposed ops, channels-last convolutions), so float32 sums differ in their last bits: ~2e-7 relative in
    the loss, the gradients and the outputs here. An activation that lands that close to an INT8 rounding boundary
    moves by one quantization step; the bounds leave room for a few such flips on other CPUs' kernels. Adam's update
    is ~lr per weight whatever the gradient's size, so a weight whose gradient is ~0 can move differently: the
    updates (4.8e-4 relative here) get a looser bound. So do the prototypes: this untrained model's are ~4e-5, so
    one flipped INT8 step of their input is a larger share of them (1.3e-4 relative with the suite's threads, 1.2e-3
    with one thread and AVX2 kernels). Tried: every input quantizer skipped in the compiled copy moves the updates
    by 0.17; only the prototype branch's input, by 0.014."""
    model, teacher = tiny_ptq
    batches = _batches(3)
    plan = StepPlan(compiled=True, channels_last=True, fused_optimizer=False, reason="test",
                    backend="aot_eager_decomp_partition", mode=None, fused_quantizers=True)  # as inductor's
    eager_losses, eager_grads, eager = _train(model, teacher, EAGER, batches)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the counters are the process's: another test's traces count there too
    fast_losses, fast_grads, fast = _train(model, teacher, plan, batches)
    stats = torch._dynamo.utils.counters
    assert not stats["graph_break"], dict(stats["graph_break"])  # whole graphs: nothing fell back to eager
    assert stats["stats"]["unique_graphs"] == 2  # the student's forward and the teacher's, each traced once
    assert eager_losses[0] > 0
    for e, f in zip(eager_losses, fast_losses):
        assert abs(e - f) <= 1e-5 * abs(e), (eager_losses, fast_losses)
    assert eager_grads.keys() == fast_grads.keys() and len(eager_grads) > 20
    total = _rel(torch.cat([g.flatten() for g in fast_grads.values()]),
                 torch.cat([g.flatten() for g in eager_grads.values()]))
    assert total < 1e-4, total
    moved = _rel(torch.cat([p.flatten() for p in fast.parameters()]) - torch.cat([p.flatten() for p in model.parameters()]),
                 torch.cat([p.flatten() for p in eager.parameters()]) - torch.cat([p.flatten() for p in model.parameters()]))
    assert moved < 1e-2, moved
    with torch.no_grad():
        image = batches[0][0]
        (out_e, (_, _, proto_e)), (out_f, (_, _, proto_f)) = eager(image), fast(image.contiguous(
            memory_format=torch.channels_last))
    assert _rel(out_f, out_e) < 1e-4  # boxes, class scores, mask coefficients
    assert _rel(proto_f, proto_e) < 1e-2  # prototypes


@pytest.mark.parametrize("fused", [False, True])
def test_an_epoch_quantizes_as_its_plan_says(tiny_ptq, fused):
    """A fine-tuning epoch's quantizers run the native fake-quantize kernels, or, where the plan fuses them (an
    inductor step), the elementwise ops: the kernels that run in an epoch, eagerly here, are those traced into its
    compiled graphs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))
    model, teacher = copy.deepcopy(tiny_ptq[0]), copy.deepcopy(tiny_ptq[1])
    plan = StepPlan(compiled=False, channels_last=False, fused_optimizer=False, reason="test", fused_quantizers=fused)
    hyp = yaml.safe_load((CHECKOUT / "data/hyps/hyp.scratch-high.yaml").read_text())
    with QATObjective(RECIPES["default"], model, teacher, hyp) as objective, Ops() as ops:
        FineTuner(objective, 1, 1, amp=False, plan=plan).epoch(iter(_batches(1)), "")
    native = {op for op in ops.seen if "fake_quantize" in op}
    assert (not native and "aten.round.default" in ops.seen) if fused else native, native


def test_the_fast_step_where_it_applies():
    """`auto` by what the run plans: inductor from enough images (its fused kernels save time per image), else
    cudagraphs from enough iterations (its replays save launches per step), else eager."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    rule = AutoRule(inductor_images=50_000, cudagraphs_iterations=500)
    for iterations, batch, backend, mode in ((500, 10, "cudagraphs", None), (4999, 10, "cudagraphs", None),
                                             (5000, 10, "inductor", "reduce-overhead"),
                                             (2000, 32, "inductor", "reduce-overhead"),  # the issue-68 case
                                             (1562, 32, "cudagraphs", None), (2000, None, "cudagraphs", None),
                                             (None, 10, "inductor", "reduce-overhead")):
        plan = plan_step("auto", cuda, learn_amax=False, iterations=iterations, batch=batch, rule=rule)
        assert plan.compiled and (plan.backend, plan.mode) == (backend, mode), (iterations, batch, plan)
        assert plan.fused_quantizers == (backend == "inductor")  # unfused, the elementwise ops cost more
    assert "2000 iterations of 32 images planned" in plan_step("auto", cuda, False, 2000, 32, rule).reason
    for requested, device, learn, iterations in (("eager", cuda, False, None), ("auto", cpu, False, None),
                                                 ("auto", cuda, True, None), ("auto", cuda, False, 499)):
        plan = plan_step(requested, device, learn, iterations, 10, rule)
        assert not plan.compiled and plan.reason.startswith("eager (")
    assert "499 iterations planned" in plan.reason and plan.fused_optimizer  # too short to compile; the rest applies
    forced = plan_step("inductor", cuda, False, iterations=1, batch=1, rule=rule)  # asked for: compiled however short
    assert forced.compiled and (forced.backend, forced.mode) == ("inductor", "reduce-overhead")
    assert not plan_step("eager", cuda, False).fused_optimizer  # --step eager: the step as it always was
    with pytest.raises(ValueError, match="--step"):
        plan_step("fast", cuda, False)


def test_upsampling_is_compiled_as_a_repeat_with_the_same_values_and_gradients():
    """The compiled step's graph has upstream's nearest upsampling (nn.Upsample) by whole factors as a repeat of each
    pixel (fast_step.upsample_by_repeat: its gradient a sum per block, not an indexed accumulation); other resizings
    stay as they are. The forward copies values: equal to the last bit, in the input's memory format. The gradient
    adds each block's values in another order than the native kernel: float32 rounding, ~1e-7 relative."""
    seen: list[tuple[int, int]] = []  # (repeats, F.interpolate calls) in each graph the backend was given

    def recording(gm, example_inputs):
        targets = [n.target for n in gm.graph.nodes]
        seen.append((targets.count(repeat_pixels), targets.count(torch.nn.functional.interpolate)))
        return gm.forward

    if "recording" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(recording, "recording")
    plan = StepPlan(compiled=True, channels_last=False, fused_optimizer=False, reason="test", backend="recording",
                    mode=None)
    cases = ((nn.Upsample(scale_factor=2, mode="nearest"), True), (nn.Upsample(scale_factor=(3, 2)), True),
             (nn.Upsample(scale_factor=2, mode="bilinear"), False), (nn.Upsample(scale_factor=1.5), False),
             (nn.Upsample(size=(12, 12)), False))
    for upsample, rewritten in cases:
        for memory_format in (torch.contiguous_format, torch.channels_last):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Conv2d(3, 4, 1), upsample).to(memory_format=memory_format)
            x = torch.randn(2, 3, 6, 5).contiguous(memory_format=memory_format)
            outputs, grads = [], []
            for forward in (net, compiled(net, plan)):
                net.zero_grad()
                out = forward(x)
                (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).square().sum().backward()
                outputs.append(out)
                grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
            torch._dynamo.reset()
            assert seen == [(1, 0) if rewritten else (0, 1)], (upsample, memory_format, seen)
            seen.clear()
            assert torch.equal(outputs[1], outputs[0]), (upsample, memory_format)
            assert outputs[1].is_contiguous(memory_format=memory_format), (upsample, memory_format)
            assert _rel(grads[1], grads[0]) < 1e-6, (upsample, memory_format)


def test_each_epoch_is_judged_on_the_weights_it_trained(demo_data320):
    """The GPU's default fine-tuning in miniature: the trained demo gelan-t, PTQ, two epochs of two steps each through
    a compiled student forward with fused Adam (CPU has it: like the GPU's, it writes the weights without bumping
    their version counters). After each epoch the select evaluation equals that of a copy evaluated with nothing held
    or cached, to the last digit, and differs from the evaluation before it: the curve follows the weights. (A
    version-keyed weight cache judged every epoch on the first evaluation's weights.) torch.compile's "eager" backend:
    the traced forward runs none of the quantizers' Python, as inductor's does, and traces in a fraction of the time;
    the teacher stays eager for the same reason."""
    from models.core.task import DETECT
    from models.deployment.evaluate import evaluate, val_loader
    from models.deployment.runners import TorchRunner
    from models.quantization.checkpoint import load_float_model
    from utils.batches import load_data
    data = load_data(demo_data320)
    teacher = copy_float(load_float_model(TRAINED_T))
    model = quantize_model(load_float_model(TRAINED_T), QuantRecipe())
    select = val_loader(DETECT, data, REDUCED_SIZE, 8, 0, num_image=8)
    train = val_loader(DETECT, {"val": data["train"]}, REDUCED_SIZE, 4, 0, num_image=16)  # the 4 batches it uses
    train = [(b[0].float() / 255, b[1], None) for b in train]
    calibrate(model, QuantRecipe(calib_method="percentile"), [b[0] for b in train[:2]])
    hyp = yaml.safe_load((CHECKOUT / "data/hyps/hyp.scratch-high.yaml").read_text())
    plan = StepPlan(compiled=True, channels_last=False, fused_optimizer=True, reason="test")

    def select_map(runner) -> dict:
        metrics = evaluate(runner, select, DETECT, data["nc"])
        metrics.pop("ms_per_image")
        return metrics
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the counters are the process's: another test's traces count there too
    curve = [select_map(TorchRunner(model))]
    with QATObjective(RECIPES["default"].with_overrides(lr=1e-3), model, teacher, hyp,
                      torch.compile(model, backend="eager")) as objective:
        tuner = FineTuner(objective, epochs=2, iters=2, amp=False, plan=plan)
        assert isinstance(tuner.optimizer, torch.optim.Adam) and tuner.optimizer.defaults["fused"]
        graphs = []
        for epoch in range(2):
            tuner.epoch(iter(train[2 * epoch:2 * epoch + 2]), "")
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            curve.append(select_map(TorchRunner(model)))
            assert curve[-1] == select_map(NothingHeld(TorchRunner(copy.deepcopy(model)))), curve
            assert curve[-1] != curve[-2], curve
    assert not torch._dynamo.utils.counters["graph_break"]  # the forward ran as one traced graph
    # traced once for the whole run: the second step found the layer taps empty, as the first did (a tap holding
    # the last step's outputs failed the trace's guard on them: a second trace, ~40 % of this test), and the second
    # epoch's scales matched
    assert graphs == [1, 1], graphs
    assert curve[0]["ap50"] > 0.1  # a trained model: the curve is not of empty results


def test_benchmark_step_runs_each_mode_side_by_side(demo_data, tmp_path):
    """scripts/benchmark_step.py on the CPU: one qat.py run per --step mode, started together, each run's curve,
    delivered stage, plan and wall time recorded. On a CPU both modes run the same eager step (seeded: the same
    curve), and each plan says why; each run logs to a file of its own, whatever dots the weights' name has."""
    import json
    import shutil
    from conftest import IMGSZ, run_cli
    out = tmp_path / "step.json"
    weights = shutil.copy(TRAINED_T, tmp_path / "gelan-t-demo.v2.pt")
    r = run_cli("scripts/benchmark_step.py", "--weights", weights, "--data", demo_data, "--imgsz", IMGSZ,
                "--seeds", 0, "--steps", "auto", "eager", "--devices", "cpu", "--project", tmp_path / "runs",
                "--out", out, "--", "--epochs", 2, "--iters", 1, "--calib-method", "max", "--calib-batches", 1,
                "--batch-size", 4, "--workers", 0, "--num-image", 4, "--select-min", 4, "--no-eval-origin")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    auto, eager = result["runs"]
    assert (auto["step"], eager["step"]) == ("auto", "eager")
    assert auto["plan"] == "eager (not a CUDA device)" and eager["plan"] == "eager (--step eager)"
    assert len(auto["select_curve"]) == 2 and auto["select_curve"] == eager["select_curve"]
    assert all(run["wall_s"] > 0 and run["delivered"]["stage"] in ("ptq", "qat") for run in (auto, eager))
    assert set(result["by_step"]) == {"auto", "eager"} and "| 0 | auto |" in result["table"]
    for run in (auto, eager):
        assert run["plan"] in (tmp_path / "runs" / f"gelan-t-demo.v2-{IMGSZ}-seed0-{run['step']}.log").read_text()
    png = out.with_suffix(".png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    png.unlink()
    r = run_cli("scripts/benchmark_step.py", "--render", out)  # the curves of a recorded result, drawn again
    assert r.returncode == 0 and png.is_file(), r.stderr[-2000:]
