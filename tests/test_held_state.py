"""models/quantization/held_state.py: what a block computes from a quantized model's ranges and weights lives for that
block
only, so every update between blocks is seen, whatever wrote it (fused optimizers included)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import TRAINED_T, NothingHeld

from models.finetuning.finetune import WeightEMA
from models.quantization.checkpoint import load_float_model
from models.quantization.held_state import held
from models.quantization.fake_quant import fake_quant
from models.quantization.quantize import QuantRecipe, calibrate, calibrate_weights, quantize_model

SIZE = 320  # the trained demo model's size


@pytest.fixture(scope="module")
def quantized_t():
    """The trained demo gelan-t, quantized (real QuantConv2d, real Int8Quantizer), weights calibrated."""
    model = quantize_model(load_float_model(TRAINED_T), QuantRecipe())
    calibrate_weights(model)
    return model


@pytest.fixture()
def conv(quantized_t):
    """A copy of its first conv."""
    return copy.deepcopy(quantized_t.model[0].conv)


def _expected(conv) -> torch.Tensor:
    return fake_quant(conv.weight.detach(), conv._weight_quantizer.amax)


def _step(optimizer: torch.optim.Optimizer, conv) -> None:
    conv.weight.grad = torch.full_like(conv.weight, 0.1)
    optimizer.step()


UPDATES = {  # every way a weight changes between two evaluations, including those that skip `_version`
    "adam fused": lambda c: _step(torch.optim.Adam([c.weight], lr=0.01, fused=True), c),
    "adam foreach": lambda c: _step(torch.optim.Adam([c.weight], lr=0.01, foreach=True), c),
    "adam for-loop": lambda c: _step(torch.optim.Adam([c.weight], lr=0.01, foreach=False), c),
    "sgd": lambda c: _step(torch.optim.SGD([c.weight], lr=0.01), c),
    "load_state_dict": lambda c: c.load_state_dict({**c.state_dict(), "weight": c.weight.detach() * 0.5}),
    "in place through .data": lambda c: c.weight.data.mul_(0.5),
    "new storage": lambda c: setattr(c.weight, "data", c.weight.detach() + 0.01),
}


@pytest.mark.parametrize("update", list(UPDATES))
def test_a_weight_is_quantized_once_per_block_and_every_update_between_blocks_is_seen(conv, update):
    q = conv._weight_quantizer
    with torch.no_grad(), held(conv, weights=True):
        first = q(conv.weight)
        assert q(conv.weight) is first and torch.equal(first, _expected(conv))  # once per block
    before = conv.weight.detach().clone()
    UPDATES[update](conv)
    assert not torch.equal(conv.weight, before)  # the update did change the weight
    with torch.no_grad(), held(conv, weights=True):
        assert torch.equal(q(conv.weight), _expected(conv)) and not torch.equal(q(conv.weight), first)


def test_an_averaged_copy_is_seen_after_each_update(conv):
    """The EMA updates its copy in place with one foreach lerp; its evaluation after each update sees the new values."""
    ema = WeightEMA(conv, 0.5)
    target = copy.deepcopy(conv).requires_grad_(False)
    q = ema.model._weight_quantizer
    with torch.no_grad(), held(ema.model, weights=True):
        first = q(ema.model.weight)
    target.weight.mul_(0.5)
    ema.update(target)
    with torch.no_grad(), held(ema.model, weights=True):
        assert torch.equal(q(ema.model.weight), _expected(ema.model)) and not torch.equal(q(ema.model.weight), first)


def test_a_range_is_held_for_the_block_and_cannot_change_inside_it(conv):
    q = conv._weight_quantizer
    x = torch.linspace(-3, 3, 101)
    act = conv._input_quantizer
    act.set_amax(torch.tensor(2.0))
    with held(act):
        inside = act(x)
        with pytest.raises(RuntimeError, match="held_state"):
            act.set_amax(torch.tensor(1.0))
        with pytest.raises(RuntimeError, match="held_state"):
            act.load_state_dict({"_amax": torch.tensor(1.0)})
        assert "_held" not in copy.deepcopy(act).__dict__ and copy.deepcopy(act)._held is None  # copies hold nothing
    assert act._held is None and torch.equal(inside, fake_quant(x, torch.tensor(2.0)))
    with torch.no_grad():
        act._amax.mul_(0.5)  # outside a block an in-place change is seen at the next call
    assert torch.equal(act(x), fake_quant(x, torch.tensor(1.0)))
    with held(conv, weights=True):  # grad enabled: training gets the rounding in its graph, nothing kept
        out = q(conv.weight)
        assert out.requires_grad and q._held._weight is None
    out.sum().backward()
    assert conv.weight.grad is not None


@pytest.mark.parametrize("switch", ["disable", "disable_quant"])
def test_a_quantizer_switched_off_passes_its_input_through_inside_a_block(conv, switch):
    """Mixed precision keeps convs in float with their (calibrated, so holdable) quantizers switched off; a block
    computes their scales all the same, and the forward must still leave them off."""
    x = torch.randn(1, conv.in_channels, 8, 8)
    with torch.no_grad():
        quantized = conv(x)
        for q in (conv._input_quantizer, conv._weight_quantizer):
            q.set_amax(torch.ones_like(q.amax) if q is conv._weight_quantizer else torch.tensor(1.0))
            getattr(q, switch)()
        with held(conv, weights=True):
            assert conv._weight_quantizer._held is not None
            inside = conv(x)
        expected = torch.nn.functional.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding)
    assert torch.equal(inside, expected) and not torch.equal(inside, quantized)


def test_each_block_writes_its_scales_where_a_compiled_forward_reads_them(conv):
    """A per-channel quantizer's scales are static inputs of a compiled forward (torch.compile takes a tensor reached
    through a module for one that keeps its address, like a weight): CUDA graphs read them there, and new tensors at
    each block re-recorded every graph at each QAT epoch's first step on the GPU (0.6-1.3 s on gelan-c). So each block
    writes its values into the last block's tensors: a range changed between blocks is seen, at the same address."""
    q = conv._weight_quantizer
    forward = torch.compile(conv, backend="aot_eager")
    x = torch.randn(2, conv.in_channels, 16, 16)
    with torch.no_grad(), held(conv):
        first = forward(x)
        kept = q._held.params[:3]
        assert all(isinstance(t, torch.Tensor) and getattr(t, "_dynamo_static_input_type", None) for t in kept[:2])
    q.set_amax(q.amax * 2)
    with torch.no_grad(), held(conv):
        assert all(t is k for t, k in zip(q._held.params[:3], kept))
        second = forward(x)
    with torch.no_grad():
        assert torch.equal(second, conv(x)) and not torch.equal(second, first)  # conv(x): computed from amax now
    assert copy.deepcopy(q)._held_storage is None  # a copy writes into tensors of its own


def test_evaluation_in_one_block_gives_the_same_map_to_the_last_digit(demo_data320):
    """The trained demo model, PTQ: evaluated in one block (each weight quantized once, each scale computed once;
    eval and export mode set once) and with nothing held (every weight and scale computed again at every batch, the
    modes set for each): the same metrics, every digit, and the model left training, as a fine-tuning epoch
    evaluates it."""
    from models.core.task import DETECT
    from models.deployment.evaluate import evaluate, val_loader
    from models.deployment.runners import TorchRunner
    from utils.batches import load_data
    data = load_data(demo_data320)
    model = quantize_model(load_float_model(TRAINED_T), QuantRecipe())
    loader = val_loader(DETECT, data, SIZE, 8, 0, num_image=16)
    calibrate(model, QuantRecipe(calib_method="percentile"), [b[0].float() / 255 for b in loader][:2])
    runner = TorchRunner(model)
    quantized_once = []
    model.model[0].conv._weight_quantizer.register_forward_hook(lambda m, i, o: quantized_once.append(o))

    def left_training() -> bool:
        return all(m.training for m in model.modules()) and not any(getattr(m, "export", False)
                                                                     for m in model.modules())
    model.train()
    in_block = evaluate(runner, loader, DETECT, data["nc"])
    assert len(quantized_once) == 2 and quantized_once[0] is quantized_once[1]  # two batches, one quantization
    assert left_training()
    unheld = evaluate(NothingHeld(runner), loader, DETECT, data["nc"])
    assert quantized_once[2] is not quantized_once[3] and left_training()
    assert in_block["ap50"] > 0.1  # a trained model: not two empty results
    timing = "ms_per_image"
    assert in_block.pop(timing) > 0 and unheld.pop(timing) > 0 and in_block == unheld
