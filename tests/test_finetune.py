"""The QAT recipe parts on real upstream models and real quantizers: head distillation, the detection loss,
learned amax, weight EMA, schedules, and what a trained model still exports as (one scale per shared group)."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CHECKOUT, build_model, tiny_gelan
from torch.utils._python_dispatch import TorchDispatchMode

from models.core.losses import head_distill_loss
from models.finetuning.finetune import RECIPES, FineTuner, QATObjective, QATRecipe, WeightEMA, lr_at
from models.pipeline import CONTROL_PARTS, controlled_quantizers
from models.quantization.checkpoint import read_checkpoint, save_checkpoint
from models.quantization.fake_quant import fake_quant
from models.quantization.quantize import (QuantRecipe, calibrate, copy_float, learnable_amax_parameters,
                                          named_quantizers, quantization_disabled, quantize_model)
from utils.onnx_utils import model_to_onnx, unshared_joins

NC, REG_MAX = 3, 16


def _images(n=2, size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(2, 3, size, size, generator=g) for _ in range(n)]


def _targets(batch=2, seed=0):
    """Upstream targets [image, class, x, y, w, h], two boxes per image."""
    g = torch.Generator().manual_seed(seed)
    img = torch.arange(batch).repeat_interleave(2).float()
    cls = torch.randint(0, NC, (2 * batch,), generator=g).float()
    return torch.cat([img[:, None], cls[:, None], torch.rand(2 * batch, 2, generator=g) * 0.6 + 0.2,
                      torch.rand(2 * batch, 2, generator=g) * 0.3 + 0.1], 1)


@pytest.fixture(scope="module")
def ptq_pair():
    """A calibrated tiny GELAN (nc=3; every block type the quantizers meet) and its float teacher."""
    model = build_model(tiny_gelan(NC), nc=NC)
    model.fuse()
    teacher = copy_float(model)
    quantize_model(model)
    calibrate(model, QuantRecipe(calib_method="mse"), _images())
    return model, teacher


def _hyp():
    return yaml.safe_load((CHECKOUT / "data/hyps/hyp.scratch-high.yaml").read_text())


def _maps(b=2, a=(8, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, 4 * REG_MAX + NC, s, s, generator=g) * 3 for s in a]


def test_head_loss_is_zero_at_agreement_and_flows_back():
    teacher = _maps()
    student = [t.clone().requires_grad_(True) for t in teacher]
    assert float(head_distill_loss(student, teacher, NC, REG_MAX)[0]) == pytest.approx(0.0, abs=1e-5)
    moved = [(t + 0.3 * torch.randn_like(t)).requires_grad_(True) for t in teacher]
    loss = head_distill_loss(moved, teacher, NC, REG_MAX)[0]
    assert float(loss) > 1e-3
    loss.backward()
    assert all(m.grad is not None and float(m.grad.abs().sum()) > 0 for m in moved)


def test_head_loss_ignores_saturated_background_that_mse_punishes():
    """The same logit error, once on background anchors that both models score near 0 (changes no detection)
    and once where the teacher sees an object: MSE on raw maps (the reference recipe's target) weighs both
    alike; the head loss puts (almost) all its weight on the second."""
    def case(teacher_logit):
        teacher = _maps()
        for t in teacher:
            t[:, 4 * REG_MAX:] = teacher_logit
        student = [t.clone() for t in teacher]
        for s in student:
            s[:, 4 * REG_MAX:] -= 4.0
        mse = sum(torch.nn.functional.mse_loss(s, t) for s, t in zip(student, teacher))
        return float(mse), float(head_distill_loss(student, teacher, NC, REG_MAX)[0])
    mse_background, head_background = case(-12.0)
    mse_object, head_object = case(2.0)
    assert mse_background == pytest.approx(mse_object)
    assert head_object > 100 * head_background


def test_a_step_has_the_loss_and_gradients_of_the_recipe_and_the_epoch_their_means(ptq_pair):
    """FineTuner.step (losses kept on the device, phase marks) computes what the recipe's
    loss and its backward give directly: the same total and the same gradient of every parameter (the same
    arithmetic in the same order, so equal to float rounding); the epoch's reported means are the steps' means."""
    from models.finetuning.finetune import StepClock
    model, teacher = ptq_pair
    recipe, images, targets = RECIPES["default"], _images(2), _targets()
    direct = copy.deepcopy(model).train()
    with QATObjective(recipe, direct, teacher, _hyp()) as objective:
        loss, parts = objective(images[0], targets)
        loss.backward()
    stepped = copy.deepcopy(model).train()
    clock = StepClock(torch.device("cpu"))
    with QATObjective(recipe, stepped, teacher, _hyp()) as objective:
        tuner = FineTuner(objective, epochs=1, iters=2, amp=False, clock=clock)
        clock.start()
        out = tuner.step(images[0], targets, None)
    assert float(out["loss"]) == pytest.approx(float(loss), rel=1e-6)
    assert {k: float(v) for k, v in parts.items()} == pytest.approx({k: float(out[k]) for k in parts}, rel=1e-6)
    grads = dict(direct.named_parameters())
    for name, p in stepped.named_parameters():
        if grads[name].grad is not None:
            assert torch.allclose(p.grad, grads[name].grad, rtol=1e-5, atol=1e-8), name
    assert {"teacher forward", "student forward", "losses", "backward (+ gradient all-reduce)",
            "optimizer"} <= set(clock.seconds)
    epoch_model = copy.deepcopy(model).train()
    with QATObjective(recipe, epoch_model, teacher, _hyp()) as objective:
        means = FineTuner(objective, epochs=1, iters=2, amp=False).epoch(((im, targets, None) for im in images), "")
    steps_model = copy.deepcopy(model).train()
    with QATObjective(recipe, steps_model, teacher, _hyp()) as objective:
        tuner = FineTuner(objective, epochs=1, iters=2, amp=False)
        steps = [tuner.step(im, targets, None) for im in images]
    assert means["loss"] == pytest.approx(sum(float(s["loss"]) for s in steps) / 2, rel=1e-6)


def test_objective_with_detection_loss_trains_the_quantized_model(ptq_pair):
    model, teacher = copy.deepcopy(ptq_pair[0]), ptq_pair[1]
    recipe = RECIPES["default"]
    assert recipe.distill == "head" and recipe.det_loss > 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with QATObjective(recipe, model, teacher, _hyp()) as objective:
        tuner = FineTuner(objective, epochs=1, iters=3, amp=False)
        losses = tuner.epoch(iter([(im, _targets(), None) for im in _images(3)]), "")
    assert tuner.step_count == 3 and {"distill", "det", "loss"} <= set(losses)
    assert all(math.isfinite(v) for v in losses.values())
    changed = sum(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert changed > 0.9 * len(before)
    assert not model.model[-1]._forward_hooks  # the objective's taps are gone


def test_lr_zero_changes_nothing(ptq_pair):
    model, teacher = copy.deepcopy(ptq_pair[0]), ptq_pair[1]
    recipe = RECIPES["reference"].with_overrides(lr=0.0)
    before = copy.deepcopy(model.state_dict())
    with QATObjective(recipe, model, teacher) as objective:
        FineTuner(objective, epochs=1, iters=2, amp=False).epoch(((im, _targets(), None) for im in _images(2)), "")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_learned_amax_gets_gradients_and_exports_one_scale_per_shared_group(ptq_pair, tmp_path):
    model, teacher = copy.deepcopy(ptq_pair[0]), ptq_pair[1]
    params = learnable_amax_parameters(model)
    assert len(params) == sum(1 for _ in named_quantizers(model, activations_only=True))
    x = _images(1)[0]
    q = next(q for _, q in named_quantizers(model, activations_only=True))
    with torch.no_grad():  # the learnable path computes the same values as deployment's fake quantization
        reference = fake_quant(x, q.amax.detach())
    assert torch.equal(q(x), reference)
    recipe = RECIPES["default"].with_overrides(learn_amax=True, lr=1e-2)
    before = [float(p) for p in params]
    with QATObjective(recipe, model, teacher, _hyp()) as objective:
        FineTuner(objective, epochs=1, iters=2, amp=False).epoch(((im, _targets(), None) for im in _images(2)), "")
    moved = sum(float(p) != b for p, b in zip(params, before))
    assert moved > 0.9 * len(params)
    assert unshared_joins(model_to_onnx(model, 64).graph) == []  # shared quantizers stayed one object
    loaded = read_checkpoint(save_checkpoint(model, tmp_path / "q.pt"))["model"]  # frozen, safe to load
    assert not any(isinstance(q._amax, torch.nn.Parameter) for _, q in named_quantizers(loaded, True))
    assert torch.equal(loaded.model[-1].cv2[0][0].conv._input_quantizer.amax.reshape(()),
                       model.model[-1].cv2[0][0].conv._input_quantizer.amax.detach().reshape(()))


def test_partial_controls_split_the_quantizers(ptq_pair):
    """--float-control weights / activations disable exactly one kind (together: every quantizer, once); with all
    disabled the student computes what its float teacher does, and each part alone computes neither."""
    model, teacher = copy.deepcopy(ptq_pair[0]), ptq_pair[1]
    everything = {id(q) for _, q in named_quantizers(model)}
    parts = {p: {id(q) for q in controlled_quantizers(model, p)} for p in CONTROL_PARTS}
    assert parts["weights"] and parts["activations"] and not parts["weights"] & parts["activations"]
    assert parts["weights"] | parts["activations"] == parts["all"] == everything
    assert all(q.axis is not None for q in controlled_quantizers(model, "weights")) and not controlled_quantizers(
        model, "")
    x = _images(1, seed=3)[0]
    with torch.no_grad():
        int8, float_ = model(x)[0], teacher(x)[0]
        outputs = {}
        for part in CONTROL_PARTS:
            with quantization_disabled(controlled_quantizers(model, part)):
                outputs[part] = model(x)[0]
    assert torch.equal(outputs["all"], float_)
    for part in ("weights", "activations"):
        assert not torch.equal(outputs[part], int8) and not torch.equal(outputs[part], float_)


def test_ema_decays_a_shared_quantizer_once(ptq_pair):
    model = copy.deepcopy(ptq_pair[0])
    ema = WeightEMA(model, decay=0.5, tau=1e-9)  # decay 0.5 from the first update
    i = next(i for i, m in enumerate(model.model) if type(m).__name__ == "QuantConcat")
    shared = model.model[i]._input_quantizer  # shared with the conv that reads the concat
    assert shared is model.model[i + 1].cv1.conv._input_quantizer
    start = float(shared.amax)
    shared.set_amax(torch.tensor(start + 2.0))
    ema.update(model)
    assert float(ema.model.model[i]._input_quantizer.amax) == pytest.approx(start + 1.0)


def test_schedules():
    cosine, step = RECIPES["default"], RECIPES["reference"]
    total = 1000
    lrs = [lr_at(i, total, 5, cosine) for i in range(total)]
    assert lrs[0] == pytest.approx(cosine.lr / 10) and max(lrs) == pytest.approx(cosine.lr, rel=1e-3)
    assert lrs[-1] < cosine.lr / 50 and all(a >= b for a, b in zip(lrs[60:], lrs[61:]))  # decays after warm-up
    # the reference: lr/10 for the first 30 % and the last 20 % of epochs, lr between
    per_epoch = [lr_at(e * 100, 1000, 10, step) for e in range(10)]
    assert per_epoch == [step.lr / 10] * 3 + [step.lr] * 5 + [step.lr / 10] * 2


@pytest.mark.parametrize("bad", [dict(distill="none", det_loss=0.0), dict(distill="logits"), dict(lr=-1.0),
                                 dict(ema=1.0), dict(lr_schedule="linear")])
def test_recipe_refuses_meaningless_settings(bad):
    with pytest.raises(ValueError):
        QATRecipe(**bad)


# the detection loss's files: on a CPU they read the targets' count (host memory, padded there) and torch's
# one_hot checks its indices' range (on a GPU it does not); that the loss reads nothing of the device is shown
# on the meta device (test_the_detection_loss_is_upstreams_and_reads_nothing_back)
LOSS_FILES = ("utils/loss_tal.py", "utils/segment/loss_tal.py", "utils/tal/assigner.py",
              "utils/tal/anchor_generator.py", "models/core/sync_free_loss.py")
# The operators that hand a value to the host, or whose result's size depends on values (so the host must wait for
# them on a GPU): whatever Python spelling reached them (.item(), float(), bool(), `if t:`, torch.equal,
# torch.allclose, boolean-mask indexing, .nonzero(), .tolist()).
SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "tolist")


class _HostReads(TorchDispatchMode):
    """Every host read during a block: the synchronising operators above at the dispatcher, and copies to the CPU
    (`.to("cpu")`, `.cpu()`, `.numpy()`, `.tolist()`: no-ops for a CPU tensor, so caught where they are called). Each
    is named by
    the first frame of this toolkit's checkout that caused it ('torch.optim' for the optimizer's own step
    counters, which torch keeps on the host by design), with the line's text."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def note(self):
        import traceback
        frames = traceback.extract_stack()[:-2]
        if any("torch/optim" in Path(f.filename).as_posix() for f in frames):
            self.reads.append(("torch.optim", ""))
            return
        for f in reversed(frames):
            path = Path(f.filename)
            if path.is_relative_to(CHECKOUT) and "torch" not in path.parts:
                self.reads.append((path.relative_to(CHECKOUT).as_posix(), (f.line or "").strip()))
                return

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in (args[1] if len(args) > 1 else ()) or ())
        if name in SYNC_OPS or bool_index:
            self.note()
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.patched = []
        for name in ("to", "cpu", "numpy", "tolist"):
            original = getattr(torch.Tensor, name)

            def wrapped(t, *a, _f=original, _name=name, **k):
                # .to("cpu") spelled out; .to(images.device) moves to the compute device (the CPU here, too)
                to_host = _name != "to" or "cpu" in (*a, *k.values())
                if to_host:
                    self.note()
                return _f(t, *a, **k)
            setattr(torch.Tensor, name, wrapped)
            self.patched.append((name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.patched:
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def test_an_epoch_reads_back_its_ranges_once_and_its_losses_once(ptq_pair):
    """An epoch of QAT steps of the default recipe (no progress bar) reads back to the host, in this toolkit's code,
    each range once as the epoch opens (models/quantization/held_state.py: its scale, held for the epoch, so the
    weights' ranges are read whatever changed them since) and each loss part's sum once, at its end; nothing per step.
    The reads left are the detection loss's on a CPU (`LOSS_FILES`) and torch.optim's host-resident step counters.
    Traced at the dispatcher, so any spelling of a read counts (a boolean mask, .to("cpu"), torch.equal), not only
    the methods one thought of."""
    import inspect
    model, teacher = copy.deepcopy(ptq_pair[0]).train(), ptq_pair[1]
    images, targets = _images(3), _targets()
    batches = [(im, targets, None) for im in images]
    with QATObjective(RECIPES["default"], model, teacher, _hyp()) as objective:
        tuner = FineTuner(objective, epochs=2, iters=2, amp=False)
        tuner.epoch(batches[:1], "")
        with _HostReads() as traced:
            losses = tuner.epoch(batches[1:], "")
    source, start = inspect.getsourcelines(FineTuner.epoch)
    closing = next(line.strip() for line in source if line.strip().startswith("return {k: float(v)"))
    ours = [r for r in traced.reads if r[0] != "torch.optim" and r[0] not in LOSS_FILES]
    ranges = len({id(q) for _, q in named_quantizers(model)})  # shared quantizers once
    opening, ending = ours[:-len(losses)], ours[-len(losses):]
    assert {r[0] for r in opening} == {"models/quantization/fake_quant.py"}, opening
    assert all("amax" in r[1] for r in opening), opening
    # each range read once (its tensor and its numpy view may both count), not once per step (the epoch has two)
    assert ranges <= len(opening) <= 2 * ranges, (len(opening), ranges)
    assert ending == [("models/finetuning/finetune.py", closing)] * len(losses), ending
    assert any(r[0] in LOSS_FILES for r in traced.reads)  # the trace sees the reads it is meant to see


def _crowded_targets(batch: int, seed: int) -> torch.Tensor:
    """Three boxes an image in a shuffled order, no box in image 1, and image 0's first box again with another
    class: anchors inside two boxes, which the assigner resolves."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.cat([_targets(batch, seed), _targets(batch, seed + 1)])[: 3 * batch]
    targets = targets[torch.randperm(len(targets), generator=g)]
    targets = targets[targets[:, 0] != 1]
    twin = targets[targets[:, 0] == 0][:1].clone()
    twin[:, 1] = (twin[:, 1] + 1) % NC
    return torch.cat([targets, twin])


def test_the_detection_loss_is_upstreams_and_reads_nothing_back():
    """Fine-tuning's detection loss (models/core/sync_free_loss.py) gives upstream's loss and gradients without a
    read of the device, where upstream's reads it a few times a step plus three times an image (each a wait for the
    GPU to finish the compiled forward). Its padded targets are upstream's bit for bit (rows in the order they came,
    an image without targets all zeros, a crowded image, an empty batch). Its loss equals upstream's within float32
    rounding, as do the gradients of the head's maps, with anchors inside two boxes, an image without boxes and an
    empty batch: the same terms, summed over every anchor with zero weights off the foreground instead of over the
    foreground selected (1e-5 relative: a sum of a few thousand float32 terms in another order). On the meta device,
    where a tensor has no values and every read raises, it runs forward and backward; upstream's does not."""
    from types import SimpleNamespace

    from models.core.sync_free_loss import DetectionLoss, padded_targets
    from utils.loss_tal import ComputeLoss
    upstream = SimpleNamespace(device=torch.device("cpu"))
    scale = torch.tensor([64.0, 48.0, 64.0, 48.0])
    crowded = _targets(4)[torch.randperm(8, generator=torch.Generator().manual_seed(0))]
    crowded = torch.cat([crowded[crowded[:, 0] != 1], _targets(3, seed=1)[:5].index_fill(1, torch.tensor([0]), 2)])
    for targets, batch in ((crowded, 4), (_targets(1), 3), (torch.zeros(0, 6), 2)):
        want = ComputeLoss.preprocess(upstream, targets.clone(), batch, scale)
        got = padded_targets(targets.clone(), batch, scale, "cpu")
        assert got.shape == want.shape and torch.equal(got, want), (got, want)

    model = build_model("gelan-t", nc=NC).train()  # upstream's loss reads three detection levels
    model.hyp = _hyp()
    ours, theirs = DetectionLoss(model), ComputeLoss(model)
    cases = ((4, 96, _crowded_targets(4, 0)), (2, 64, _targets(2, 1)), (2, 64, torch.zeros(0, 6)))
    for batch, size, targets in cases:
        maps = model(torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(size)))
        results = []
        for loss in (theirs, ours):
            leaves = [m.detach().clone().requires_grad_(True) for m in maps]
            value, parts = loss(leaves, targets.clone())
            value.backward()
            results.append((value, parts, [t.grad for t in leaves]))
        (want, want_parts, want_grads), (got, got_parts, got_grads) = results
        assert torch.allclose(got, want, rtol=1e-5) and torch.allclose(got_parts, want_parts, rtol=1e-5, atol=1e-9)
        for g, w in zip(got_grads, want_grads):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max())), float((g - w).abs().max())
        assert (float(want_parts[0]) > 0) == (len(targets) > 0)  # a box loss wherever there are boxes
        if size == 96:  # the twin box put anchors inside two boxes: upstream's branch for them was taken
            with torch.no_grad():
                assert _candidates(theirs, maps, targets).sum(-2).max() > 1

    stride = model.model[-1].stride
    meta = copy.deepcopy(model).to("meta")
    meta.model[-1].stride = stride  # constants of the architecture, read once when the loss is made
    maps = [torch.empty(2, 4 * REG_MAX + NC, s, s, device="meta", requires_grad=True) for s in (8, 4, 2)]
    value, _ = DetectionLoss(meta)(maps, _crowded_targets(2, 0))
    value.backward()
    assert value.device.type == "meta" and all(m.grad is not None for m in maps)
    with pytest.raises((RuntimeError, NotImplementedError)):
        ComputeLoss(meta)(maps, _crowded_targets(2, 0))


def _instance_masks(targets: torch.Tensor, batch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's box filled, at a quarter of the image size as the loader gives masks: one mask per instance in
    the targets' order, and one per image with each pixel its instance's number there (later instances on top)."""
    side = size // 4
    instances = torch.zeros(len(targets), side, side)
    per_image = torch.zeros(batch, side, side)
    number = [0] * batch
    for i, (image, _, x, y, w, h) in enumerate(targets.tolist()):
        x1, x2, y1, y2 = (round(v * side) for v in (x - w / 2, x + w / 2, y - h / 2, y + h / 2))
        instances[i, y1:y2, x1:x2] = 1
        number[int(image)] += 1
        per_image[int(image), y1:y2, x1:x2] = number[int(image)]
    return instances, per_image


def test_the_segmentation_loss_is_upstreams_and_reads_nothing_back():
    """Fine-tuning's segmentation loss (models/core/sync_free_loss.py) gives upstream's loss and gradients without a
    read of the device, where upstream's reads each image's foreground in a loop (a wait for the GPU an image). Its
    mask term takes as many anchors an image as it can have in the foreground (`topk` a box), the rest weighted out,
    and keeps its per-pixel part for the backward pass as upstream does: the backward pass has as many matrix
    products as upstream's (computing them again there made QAT 24 % slower than upstream's loss on an H200).
    Within float32 rounding of upstream's (1e-5 relative) on a tiny Segment head: loss, parts and the gradients of
    the maps, the mask coefficients and the prototypes, with one mask an image (upstream's default) and one an
    instance (rows of several images interleaved), anchors inside two boxes, an image without boxes, a box of no
    width, and a sum of target scores below 1 (which upstream's segmentation loss divides by as it is, its detection
    loss by 1). On an empty batch upstream's class term is infinite (it divides by a sum of target scores of 0): ours
    is finite there. On the meta device, where every read raises, it runs forward and backward; upstream's does
    not."""
    from models.core.sync_free_loss import SegmentationLoss
    from utils.segment.loss_tal import ComputeLoss
    class Seen(SegmentationLoss):  # notes the sum of target scores each call divides by
        def normaliser(self, target_scores_sum):
            self.seen = float(target_scores_sum)
            return super().normaliser(target_scores_sum)

    model = build_model(tiny_gelan(NC, segment=True), nc=NC).train()
    model.hyp = _hyp()
    sums = []
    flat = torch.tensor([[0.0, 1, 0.5, 0.5, 0.0, 0.2]])  # a box of no width first: no anchor is inside it
    for batch, size, targets in ((4, 96, _crowded_targets(4, 0)), (2, 64, torch.cat([flat, _targets(1, 0)[:1]]))):
        instances, per_image = _instance_masks(targets, batch, size)
        outputs = model(torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(size)))
        for overlap, masks in ((True, per_image), (False, instances)):
            results = []
            for loss in (ComputeLoss(model, overlap=overlap), Seen(model, overlap=overlap)):
                maps, coefficients, protos = [[t.detach().clone().requires_grad_(True) for t in ts] for ts in
                                              (outputs[0], outputs[1:2], outputs[2:])]
                value, parts = loss((maps, coefficients[0], protos[0]), targets.clone(), masks.clone())
                with torch.profiler.profile() as backward:
                    value.backward()
                products = sum(e.name == "aten::mm" for e in backward.events())
                results.append((value, parts, [t.grad for t in (*maps, *coefficients, *protos)], products))
            (want, want_parts, want_grads, want_products), *ours = results
            assert float(want_parts[1]) > 0 and want_products > 0  # a mask term, its products' gradients
            for got, got_parts, got_grads, got_products in ours:
                assert got_products == want_products
                assert torch.allclose(got, want, rtol=1e-5) and torch.allclose(got_parts, want_parts, rtol=1e-5), \
                    (got_parts, want_parts)
                for g, w in zip(got_grads, want_grads):
                    assert torch.allclose(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max())), \
                        float((g - w).abs().max())
            sums.append(loss.seen)
        if batch == 4:
            with torch.no_grad():  # the twin box put anchors inside two boxes
                assert _candidates(ComputeLoss(model), outputs[0], targets).sum(-2).max() > 1
    assert min(sums) < 1 < max(sums)  # upstream's segmentation loss divides by a sum below 1 as it is

    empty = torch.zeros(0, 6)
    _, want_parts = ComputeLoss(model)(outputs, empty, per_image)
    value, parts = SegmentationLoss(model)(outputs, empty, per_image)
    assert torch.isinf(want_parts[2]) and torch.isfinite(value) and float(parts[0]) == float(parts[1]) == 0

    stride = model.model[-1].stride
    meta = copy.deepcopy(model).to("meta")
    meta.model[-1].stride = stride  # constants of the architecture, read once when the loss is made
    meta_outputs = [[torch.empty(t.shape, device="meta", requires_grad=True) for t in outputs[0]],
                    torch.empty(outputs[1].shape, device="meta", requires_grad=True),
                    torch.empty(outputs[2].shape, device="meta", requires_grad=True)]
    for overlap, masks in ((True, per_image), (False, instances)):
        value, _ = SegmentationLoss(meta, overlap=overlap)(meta_outputs, targets, masks.to("meta"))
        value.backward()
        assert value.device.type == "meta" and meta_outputs[2].grad is not None
    with pytest.raises(TypeError) as raised:  # upstream wraps what its target padding raised
        ComputeLoss(meta)(meta_outputs, targets, per_image.to("meta"))
    assert isinstance(raised.value.__cause__, (RuntimeError, NotImplementedError))


def _candidates(loss, maps, targets: torch.Tensor) -> torch.Tensor:
    """Upstream's assigner's candidate anchors of each box (b, boxes, anchors), before it resolves those in two."""
    from utils.tal.anchor_generator import make_anchors
    b = maps[0].shape[0]
    distri, scores = torch.cat([x.view(b, loss.no, -1) for x in maps], 2).split((loss.reg_max * 4, loss.nc), 1)
    scores, distri = scores.permute(0, 2, 1), distri.permute(0, 2, 1)
    anchors, strides = make_anchors(maps, loss.stride, 0.5)
    size = torch.tensor(maps[0].shape[2:], dtype=torch.float32) * loss.stride[0]
    labels, boxes = loss.preprocess(targets, b, size[[1, 0, 1, 0]]).split((1, 4), 2)
    loss.assigner.bs, loss.assigner.n_max_boxes = b, boxes.shape[1]
    pos, _, _ = loss.assigner.get_pos_mask(scores.sigmoid(), loss.bbox_decode(anchors, distri) * strides, labels,
                                           boxes, anchors * strides, boxes.sum(2, keepdim=True).gt(0))
    return pos
