"""models/weight_cache.py: in no-grad evaluation a fake-quantized weight is computed once per model state, and a
changed weight or range is seen."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import TRAINED_T

from models.checkpoint import load_float_model
from models.quantize import QuantRecipe, calibrate, calibrate_weights, fake_quant, quantize_model

SIZE = 320  # the trained demo model's size


@pytest.fixture()
def conv():
    """The trained demo gelan-t's first conv, quantized (real QuantConv2d, real Int8Quantizer), weights calibrated."""
    model = quantize_model(load_float_model(TRAINED_T), QuantRecipe())
    calibrate_weights(model)
    return model.model[0].conv


def _expected(conv) -> torch.Tensor:
    return fake_quant(conv.weight.detach(), conv._weight_quantizer.amax)


def test_a_weight_is_quantized_once_per_state_and_every_change_is_seen(conv):
    q = conv._weight_quantizer
    with torch.no_grad():
        first = q(conv.weight)
        assert q(conv.weight) is first and torch.equal(first, _expected(conv))  # once per state
        conv.weight.mul_(0.5)  # in place, as an optimizer step or load_state_dict writes
        halved = q(conv.weight)
        assert halved is not first and torch.equal(halved, _expected(conv))
        q.set_amax(q.amax * 0.25)  # a new range tensor (calibration)
        clipped = q(conv.weight)
        assert not torch.equal(clipped, halved) and torch.equal(clipped, _expected(conv))
        q._amax.mul_(2)  # a range changed in place (a learned amax's optimizer step)
        assert torch.equal(q(conv.weight), _expected(conv)) and not torch.equal(q(conv.weight), clipped)
        conv.weight.data = conv.weight.detach() + 0.01  # a new storage (`.to()`, the search's held weights)
        assert torch.equal(q(conv.weight), _expected(conv))
    torch.optim.SGD([conv.weight], lr=1.0).zero_grad()
    conv.weight.grad = torch.ones_like(conv.weight)
    torch.optim.SGD([conv.weight], lr=0.5).step()
    with torch.no_grad():
        assert torch.equal(q(conv.weight), _expected(conv))


def test_training_gets_the_graph_and_copies_carry_no_cache(conv):
    q = conv._weight_quantizer
    with torch.no_grad():
        q(conv.weight)
    out = q(conv.weight)  # grad enabled: the rounding is in the graph, the weight gets its gradient
    assert out.requires_grad and q._weight_cache._entry is None
    out.sum().backward()
    assert conv.weight.grad is not None
    with torch.no_grad():
        q(conv.weight)
    assert q._weight_cache._entry is not None and "_weight_cache" not in copy.deepcopy(q).__dict__


def test_evaluation_with_the_cache_gives_the_same_map_to_the_last_digit(demo_data320):
    """The trained demo model, PTQ: evaluated with each weight quantized once, and with the cache emptied before
    every batch (each weight quantized per batch, as before the cache): the same metrics, every digit."""
    from models.evaluate import evaluate, val_loader
    from models.runners import TorchRunner
    from models.task import DETECT
    from models.weight_cache import WeightCache
    from utils.batches import load_data
    data = load_data(demo_data320)
    model = quantize_model(load_float_model(TRAINED_T), QuantRecipe())
    loader = val_loader(DETECT, data, SIZE, 8, 0, num_image=16)
    calibrate(model, QuantRecipe(calib_method="percentile"), [b[0].float() / 255 for b in loader][:2])
    weights = [m._weight_quantizer for m in model.modules() if hasattr(m, "_weight_quantizer")]
    runner = TorchRunner(model)

    class Uncached:  # the same runner, every weight quantized again at every batch
        input_shape, task, output_names, max_batch = runner.input_shape, runner.task, runner.output_names, None

        def __call__(self, images):
            for q in weights:
                q._weight_cache = WeightCache()
            return runner(images)

    cached = evaluate(runner, loader, DETECT, data["nc"])
    assert all(q._weight_cache._entry is not None for q in weights)
    uncached = evaluate(Uncached(), loader, DETECT, data["nc"])
    assert cached["ap50"] > 0.1  # a trained model: not two empty results
    timing = "ms_per_image"
    assert cached.pop(timing) > 0 and uncached.pop(timing) > 0 and cached == uncached
