"""Calibrated ranges kept apart from the model (models/quantization/saved_ranges.py): saved from a calibration, they
rebuild the
same fake-quantized model from the float weights; ranges that do not fit a model are refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMGSZ, TRAINED_T, build_model, tiny_gelan

from models.deployment.runners import TorchRunner
from models.mixed_precision import float_candidates, keep_float
from models.quantization.checkpoint import load_float_model
from models.quantization.quantize import QuantRecipe, calibrate, named_quantizers, quantize_model
from models.quantization.saved_ranges import read_ranges, rebuild_ptq, save_ranges


@pytest.fixture(scope="module")
def saved(tmp_path_factory, demo_data):
    """The trained demo gelan-t calibrated (mse on two demo batches), one tensor class kept in float, its ranges
    saved; the model and the file."""
    import export_qat
    recipe = QuantRecipe(calib_method="mse")
    model = quantize_model(load_float_model(TRAINED_T), recipe)
    calibrate(model, recipe, export_qat.verification_images(str(demo_data), IMGSZ, 2, 2))
    keep_float(model, [c for c in float_candidates(model, IMGSZ) if len(c.convs) > 1][:1])
    path = save_ranges(model, tmp_path_factory.mktemp("ranges") / "seed0.npz", recipe, calibration_sample="c0ffee",
                       method="mse")
    return model, path


def test_saved_ranges_rebuild_the_same_fake_quantized_outputs(saved, demo_data):
    """The float weights plus the file: every quantizer's range, its on/off state, and so every output, the same to
    the last bit as the calibrated model's (the same arithmetic on the same values)."""
    import export_qat
    model, path = saved
    rebuilt, meta = rebuild_ptq(load_float_model(TRAINED_T), path)
    assert meta["calibration_sample"] == "c0ffee" and meta["method"] == "mse" and len(meta["off"]) >= 2
    theirs, ours = dict(named_quantizers(model)), dict(named_quantizers(rebuilt))
    assert list(theirs) == list(ours)
    assert [n for n, q in ours.items() if q._disabled] == meta["off"]
    images = next(iter(export_qat.verification_images(str(demo_data), IMGSZ, 2, 1)))
    want, got = TorchRunner(model)(images), TorchRunner(rebuilt)(images)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ranges, _ = read_ranges(path)
    assert {n for n, q in theirs.items() if q.amax is not None} == set(ranges)
    assert path.stat().st_size < 200_000  # beside a benchmark entry: kilobytes, not a checkpoint


def test_ranges_of_another_model_or_no_ranges_file_are_refused_in_one_line(saved, tmp_path):
    """Another class count (same names, other weight shapes), another architecture (other names), a file that is
    not a ranges file, a pickled array: each a ValueError of one line that names the file."""
    import yaml

    from models.yolo import Model
    _, path = saved
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(yaml.safe_dump(tiny_gelan(12)))
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **{"__meta__": np.array([{"format": 1}], dtype=object)})
    checkpoint = tmp_path / "model.pt"
    torch.save({"model": None}, checkpoint)
    cases = [(lambda: rebuild_ptq(build_model("gelan-t", nc=3).fuse().eval(), path), path, "range value(s)"),
             (lambda: rebuild_ptq(Model(str(tiny)).fuse().eval(), path), path, "do not fit this model"),
             (lambda: read_ranges(checkpoint), checkpoint, "not a ranges file"),
             (lambda: read_ranges(pickled), pickled, "not a ranges file")]
    for call, file, words in cases:
        with pytest.raises(ValueError) as e:
            call()
        message = str(e.value)
        assert message.startswith(f"{file}: ") and words in message and "\n" not in message, message
