"""Activation ranges chosen per quantizer (models/quantization/ranges.py) on the trained demo gelan-t and the demo
dataset's images: a range that hurts the detector is replaced, and each choice is the one a full forward pass
would make (the layer-by-layer shortcut changes nothing)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import TRAINED_T

from models.core.losses import head_distillation
from models.quantization.calibration import PER_QUANTIZER
from models.quantization.checkpoint import load_float_model
from models.quantization.quantize import (HISTOGRAM_CANDIDATES, QuantRecipe, collect_statistics, named_quantizers,
                                          quantize_model)
from models.quantization.ranges import SEARCH_IMAGES, call_order, search


@pytest.fixture(scope="module")
def calibrated(demo_data320):
    """The trained demo gelan-t quantized from layer 15 on (the neck's last blocks and the detection head: joins,
    residual adds, ADown, Concat and DDetect, and passes that start late, as a search costs a pass per quantizer and
    candidate), its statistics from 4 batches of demo images, and those images."""
    import cv2
    import numpy as np
    files = sorted((demo_data320.parent / "images" / "train").glob("*"))[:16]
    images = torch.from_numpy(np.stack([cv2.resize(cv2.imread(str(f))[:, :, ::-1], (160, 160)) for f in files]))
    images = images.permute(0, 3, 1, 2).float().div(255)
    model = quantize_model(load_float_model(TRAINED_T), QuantRecipe(skip=(r"^model\.([0-9]|1[0-4])\.",)))
    stats = collect_statistics(model, QuantRecipe(calib_method=PER_QUANTIZER), images.split(4))
    return model, stats, images


def _loss(model, quantizers, images, reference) -> float:
    head = model.model[-1]
    with torch.no_grad():
        return float(head_distillation(model(images), reference, int(head.nc), int(head.reg_max))[0])


def _float_output(model, images):
    everything = [q for _, q in named_quantizers(model)]
    for q in everything:
        q.disable()
    with torch.no_grad():
        out = model(images)
    for q in everything:
        q.enable()
    return out


def test_the_search_images_are_the_first_calibration_images(calibrated):
    _, stats, images = calibrated
    assert torch.equal(stats.images, images[:SEARCH_IMAGES])
    assert stats.candidates[PER_QUANTIZER] == (PER_QUANTIZER, None)


def test_a_range_that_hurts_the_detector_is_replaced(calibrated):
    """Candidates equal but at three quantizers (the first, a middle and the last the forward calls), where "hurt"
    clips at a twentieth of the mse range: "hurt" is listed first, so it wins every tie, and loses exactly there."""
    model, stats, images = calibrated
    model = copy.deepcopy(model)
    quantizers = [q for _, q in named_quantizers(model, activations_only=True)]
    order = call_order(model, quantizers, images)
    picked = {order[0], order[len(order) // 2], order[-1]}
    fine = [a.clone() for a in stats.ranges("mse")]
    hurt = [a / 20 if k in picked else a.clone() for k, a in enumerate(fine)]
    ranges, chosen, _ = search(model, quantizers, {"hurt": hurt, "fine": fine}, images[:4])
    assert {k for k, m in enumerate(chosen) if m == "fine"} == picked
    assert all(torch.equal(r, f) for r, f in zip(ranges, fine))
    assert all(float(q.amax) == float(f) for q, f in zip(quantizers, fine))  # left at the chosen ranges, on
    assert not any(q._disabled for q in quantizers)


def test_each_choice_is_the_least_loss_of_a_full_forward_pass(calibrated):
    """At a quantizer in the middle of the forward: the earlier ones at their chosen ranges, the later ones off,
    every candidate range through the whole model; the least distillation loss is the search's choice."""
    model, stats, images = calibrated
    model = copy.deepcopy(model)
    quantizers = [q for _, q in named_quantizers(model, activations_only=True)]
    pool = {m: stats.ranges(m) for m in HISTOGRAM_CANDIDATES}
    images = images[:4]  # a pass per quantizer and candidate: the fewest images that still tell the ranges apart
    reference = _float_output(model, images)
    ranges, chosen, order = search(model, quantizers, pool, images)
    assert order == call_order(model, quantizers, images)
    for position in (len(order) // 3, 2 * len(order) // 3):
        k = order[position]
        for j in order[position + 1:]:
            quantizers[j].disable()
        for j in order[:position]:
            quantizers[j].set_amax(ranges[j].reshape(()))
        losses = {}
        for m in pool:
            quantizers[k].set_amax(pool[m][k].reshape(()))
            losses[m] = _loss(model, quantizers, images, reference)
        for q in quantizers:
            q.enable()
        best = min(losses.values())
        # equal ranges give equal losses; the search takes the first listed of the least
        assert chosen[k] == next(m for m in pool if losses[m] == best), (position, losses, chosen[k])
        assert len(set(losses.values())) > 1  # the candidates do differ here: the choice was a real one
