"""NVIDIA Model Optimizer as the second quantization backend (`--backend modelopt`), measured against
pytorch-quantization on the trained demo gelan-t: the same recipe gives the same quantizers and ranges, PTQ and a
few QAT iterations give the same results within what separates the two fake-quant ops, and its models go through
the CLIs, the export, the lint and ONNX Runtime like the default backend's.

Where the two backends differ is one thing: the arithmetic of the fake-quant op. pytorch-quantization's runs this
project's kernels (x / scale as x * float32(1 / scale), dequantized as q * scale, scale = amax / 127); Model
Optimizer's computes x * (127 / amax) and dequantizes by dividing by it. The INT8 code of a value is the same unless
the value lies within a float32 rounding of a rounding boundary (measured below 1e-4 of a step); where one flips,
the next layer sees a value one step away, and through ~180 layers a few boxes move, as between two runtimes
(tests/test_val_trt.py): tolerances are counted in such boxes (conftest.one_box)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CHECKOUT, IMGSZ, REDUCED_SIZE, TRAINED_T, one_box, run_cli, run_preloaded

pytest.importorskip("modelopt.torch.quantization",
                    reason="nvidia-modelopt is not installed (./install_dependencies.sh --modelopt, as CI does)")

from models.finetuning.fast_step import plan_step  # noqa: E402
from models.quantization.backends import get_backend  # noqa: E402
from models.quantization.checkpoint import load_float_model, save_checkpoint  # noqa: E402
from models.quantization.quantize import (QuantRecipe, calibrate, named_quantizers, quantize_model,  # noqa: E402
                                          quantizer_counts)
from utils.batches import load_data  # noqa: E402

SIZE = 320  # the trained demo model's size
BACKENDS = ("pytorch-quantization", "modelopt")


def test_the_two_fake_quant_ops_give_the_same_int8_codes_and_gradients():
    """Per-channel weights and per-tensor activations at the same amax: the same INT8 code for every value, the
    dequantized values apart by float32 rounding only (a wrong scale, bound or rounding mode moves whole steps), and
    the same straight-through gradient, zero where a value is clipped (Model Optimizer's default passes it through
    there, which made QAT lose accuracy every epoch; passed through, this fails)."""
    pq, mo = (get_backend(b) for b in BACKENDS)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, 3, 3, generator=g) * torch.rand(64, 1, 1, 1, generator=g)
    x = torch.randn(8, 32, 20, 20, generator=g) * 3
    for make, value, amax in (("weight_quantizer", w, w.abs().amax((1, 2, 3), keepdim=True) * 0.8),
                              ("activation_quantizer", x, torch.tensor(5.3))):
        a, b = getattr(pq, make)(8), getattr(mo, make)(8)
        a.set_amax(amax)
        b.set_amax(amax)
        step = amax / 127
        xa, xb = value.clone().requires_grad_(), value.clone().requires_grad_()
        ya, yb = a(xa), b(xb)
        assert torch.equal(torch.round(ya / step), torch.round(yb / step))
        assert float(((ya - yb).abs() / step).max()) < 1e-4
        assert torch.round(ya / step).abs().max() >= 127  # clipped values are in the comparison
        upstream = torch.randn(value.shape, generator=g)
        ya.backward(upstream)
        yb.backward(upstream)
        # the two masks differ only within a step and a half beyond amax: PyTorch's kernel passes the gradient of a
        # value that still rounds to the last code (or to -128), Model Optimizer's stops at amax; pytorch-quantization's
        # per-channel gradient is (1 / scale) * scale, 1 within a float32 rounding
        band = (value.abs() > amax) & (value.abs() <= amax + 1.5 * step)
        assert torch.equal(xa.grad[~band] == 0, xb.grad[~band] == 0) and (xb.grad[value.abs() > amax] == 0).all()
        assert torch.allclose(xa.grad[~band], xb.grad[~band], rtol=1e-6, atol=0)
        assert (value.abs() > amax + 1.5 * step).any() and band.float().mean() < 0.01


def test_the_fine_tuning_step_is_eager_where_scales_are_not_held():
    """Model Optimizer's op computes its scale from amax at every call (a host read a compiled step cannot trace):
    its models fine-tune with the eager step, which says why."""
    plan = plan_step("inductor", torch.device("cuda"), False, held_scales=False)
    assert not plan.compiled and "--backend modelopt" in plan.reason
    assert plan_step("inductor", torch.device("cuda"), False).compiled


@pytest.fixture(scope="module")
def ptq(demo_data320, tmp_path_factory) -> dict[str, tuple]:
    """The trained demo gelan-t quantized by each backend with the same recipe and calibrated on the same 8 images
    (`max`: an exact maximum, the same on every machine up to its last bits), saved: {backend: (model, file)}."""
    import export_qat
    images = export_qat.verification_images(str(demo_data320), SIZE, 4, 2)
    d, out = tmp_path_factory.mktemp("backends"), {}
    for backend in BACKENDS:
        model = quantize_model(load_float_model(TRAINED_T), QuantRecipe(backend=backend))
        calibrate(model, QuantRecipe(backend=backend, calib_method="max"), images)
        out[backend] = model, save_checkpoint(model, d / f"{backend}.pt")
    return out


def _amax(model) -> dict[str, torch.Tensor]:
    return {n: q.amax.detach().float() for n, q in named_quantizers(model) if q.amax is not None}


def test_same_recipe_same_quantizers_and_ranges(ptq, demo_data320):
    """The same quantizers in the same places (shared at the same joins: each backend's export read by the same
    rules); weight ranges bit for bit (computed from the weights alone). Activation ranges: the statistics pass runs
    each backend's quantized weights, so an activation's maximum moves by what a flipped rounding upstream adds
    (`max`: within 1 %; measured here median 1.8e-4, largest 1.1e-3), and `mse`, which picks a bin of the histogram
    where its error curve is flat, keeps the same bin for most quantizers (measured: 111 of 151) and moves a few
    by some bins (largest 2.7 %): a median of 0 and at most 10 % (auto's other candidates differ from mse's ranges
    here by a median of 5 % for percentile-99.99 to 34 % for percentile-99.9, 18 % for max)."""
    import export_qat
    (pq, _), (mo, _) = ptq[BACKENDS[0]], ptq[BACKENDS[1]]
    assert quantizer_counts(pq) == quantizer_counts(mo) and quantizer_counts(mo)["distinct"] < quantizer_counts(mo)[
        "placements"]  # shared at joins in both
    images = export_qat.verification_images(str(demo_data320), SIZE, 4, 2)
    for method in ("max", "mse"):
        if method == "mse":
            for model, backend in ((pq, BACKENDS[0]), (mo, BACKENDS[1])):
                calibrate(model, QuantRecipe(backend=backend, calib_method="mse"), images)
        a, b = _amax(pq), _amax(mo)
        assert a.keys() == b.keys()
        weights = [n for n, q in named_quantizers(pq) if q.axis is not None]
        assert all(torch.equal(a[n], b[n].reshape(a[n].shape)) for n in weights)
        rel = np.array([abs(float(b[n]) / float(a[n]) - 1) for n in a if n not in weights])
        print(method, "activation ranges: median", np.median(rel), "largest", rel.max(), "moved", (rel > 0).sum(),
              "of", len(rel), "by > 1 %:", (rel > 0.01).sum())
        if method == "max":
            assert rel.max() < 0.01, rel.max()
        else:
            assert np.median(rel) == 0 and rel.max() < 0.1, (np.median(rel), rel.max())
    for model, backend in ((pq, BACKENDS[0]), (mo, BACKENDS[1])):  # back to the fixture's max ranges
        calibrate(model, QuantRecipe(backend=backend, calib_method="max"), images)


@pytest.fixture(scope="module")
def graphs(ptq, tmp_path_factory) -> dict[str, Path]:
    """Each backend's checkpoint exported by export_qat.py in a new process (the allow-list reads Model Optimizer's
    quantizers), FP32 Q/DQ graph: {backend: onnx file}."""
    out = {}
    for backend, (_, weights) in ptq.items():
        r = run_cli("export_qat.py", "--weights", weights, "--include", "onnx", "--dynamic", "--imgsz", SIZE,
                    "--dtype", "fp32")
        assert r.returncode == 0, r.stderr[-2000:]
        out[backend] = weights.with_suffix(".onnx")
    return out


def test_ptq_map_and_exports_agree_across_backends_and_runtimes(ptq, graphs, demo_data320):
    """PTQ mAP of the two backends in PyTorch, and of their exported graphs in ONNX Runtime, on the 40 val images:
    all four within three boxes of the rarest class of each other (the module docstring; ONNX Runtime against
    PyTorch as tests/test_val_trt.py bounds it). Both graphs lint clean: every conv quantized, no join with two
    scales, the same Q/DQ pairs."""
    from models.core.task import DETECT
    from models.deployment.evaluate import evaluate, val_loader
    from models.deployment.runners import OnnxRuntimeRunner, open_runner
    from utils.qdq_lint import lint_file
    data = load_data(demo_data320)
    loader = val_loader(DETECT, data, SIZE, 4, 0)
    results = {}
    for backend, (_, weights) in ptq.items():
        results[f"{backend} PyTorch"] = evaluate(open_runner(weights, "cpu"), loader, DETECT, data["nc"])
        results[f"{backend} ORT"] = evaluate(OnnxRuntimeRunner(graphs[backend]), loader, DETECT, data["nc"])
    print({k: (v["ap"], v["ap50"]) for k, v in results.items()}, "one box", one_box(data))
    assert min(r["ap50"] for r in results.values()) > 0.1  # a trained model: not a comparison of empty results
    for k in ("ap", "ap50"):
        values = [r[k] for r in results.values()]
        assert max(values) - min(values) <= 3 * one_box(data), (k, values)
    reports = {b: lint_file(f) for b, f in graphs.items()}
    for report in reports.values():
        assert not report.unshared_joins and not report.unquantized_convs and report.quantized_convs > 100
    pq, mo = reports.values()
    assert (mo.quantize_nodes, mo.dequantize_nodes, mo.quantized_convs) == (
        pq.quantize_nodes, pq.dequantize_nodes, pq.quantized_convs)


def _quantize(data: Path, tmp: Path, name: str, backend: str, seed: int) -> dict:
    r = run_cli("qat.py", "quantize", "--backend", backend, "--seed", seed, "--weights", TRAINED_T, "--data", data,
                "--imgsz", REDUCED_SIZE, "--batch-size", 2, "--device", "cpu", "--workers", 0, "--num-image", 8,
                "--epochs", 1, "--iters", 2, "--calib-batches", 1, "--calib-method", "max", "--no-eval-origin",
                "--project", tmp, "--name", name)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads((tmp / name / "report.json").read_text())


def test_qat_losses_within_noise_and_eval_reads_the_backend(demo_data320, tmp_path):
    """`qat.py quantize --backend modelopt`, one epoch of two QAT iterations, against the default backend on the
    same seed (same calibration images, batches and augmentation) and on another seed (what noise is here): the
    backends' epoch losses are closer than the two seeds'. `qat.py eval` of its delivered model says which backend
    it holds and reproduces the run's figure."""
    arms = (("modelopt", 57), ("pytorch-quantization", 57), ("pytorch-quantization", 58))
    runs = {(b, s): _quantize(demo_data320, tmp_path, f"{b}-{s}", b, s) for b, s in arms}
    loss = {k: r["qat"][0]["loss"] for k, r in runs.items()}
    print(loss)
    noise = abs(loss["pytorch-quantization", 58] - loss["pytorch-quantization", 57])
    assert abs(loss["modelopt", 57] - loss["pytorch-quantization", 57]) < noise, (loss, noise)
    mo = runs["modelopt", 57]
    assert mo["config"]["quant"]["backend"] == "modelopt" and mo["step"]["plan"].startswith("eager")
    best = Path(mo["final"]["file"])
    r = run_cli("qat.py", "eval", "--weights", best, "--data", demo_data320, "--imgsz", REDUCED_SIZE, "--batch-size",
                8, "--device", "cpu", "--workers", 0, "--num-image", 8, "--project", tmp_path, "--name", "ev")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert got["backend"] == "modelopt" and "modelopt" in got["table"]
    assert got["ap"] == pytest.approx(mo["val"]["final"]["ap"], abs=1e-4)


def test_sensitivity_with_model_optimizer(tiny_gelan_weights, demo_data, tmp_path):
    """`qat.py sensitive --backend modelopt` measures every tensor class in float, as with the default backend."""
    r = run_cli("qat.py", "sensitive", "--backend", "modelopt", "--weights", tiny_gelan_weights, "--data", demo_data,
                "--imgsz", IMGSZ, "--batch-size", 4, "--device", "cpu", "--workers", 0, "--calib-batches", 1,
                "--calib-method", "max", "--no-select", "--project", tmp_path, "--name", "s")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "s" / "summary-sensitive-analysis.json").read_text())
    assert summary["candidates"] and all("cost" in c for c in summary["candidates"])


def test_without_model_optimizer_the_backend_and_its_checkpoints_are_refused_in_one_line(ptq, demo_data, tmp_path):
    """Where nvidia-modelopt does not import, `--backend modelopt` and a checkpoint holding its quantizers are
    refused before anything is written, naming the flag or the file and the install command."""
    shadow = tmp_path / "shadow" / "modelopt"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('nvidia-modelopt is broken here')\n")
    env = dict(os.environ, PYTHONPATH=f"{shadow.parent}{os.pathsep}{CHECKOUT}", OMP_NUM_THREADS="1")
    for args, names in ((["quantize", "--backend", "modelopt", "--weights", TRAINED_T], "--backend modelopt"),
                        (["eval", "--weights", ptq["modelopt"][1]], str(ptq["modelopt"][1]))):
        # forked from a Python that preloaded this environment's checkout, without modelopt (as a fresh one would)
        r = run_preloaded([str(CHECKOUT / "qat.py"), *map(str, args), "--data", str(demo_data), "--device", "cpu",
                           "--project", str(tmp_path / "runs")], CHECKOUT, env, 300)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode != 0 and names in lines[-1] and "install_dependencies.sh --modelopt" in lines[-1], \
            r.stderr[-2000:]
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()


def test_benchmark_backends_records_both_and_renders(tiny_gelan_weights, demo_data, tmp_path):
    """scripts/benchmark_backends.py on demo data: both backends measured on the same calibration images, their
    ranges compared quantizer by quantizer, both graphs linted; the README block renders from what it wrote (the
    script's path, not its numbers: the tiny GELAN)."""
    from utils.benchmark_tables import backends_table
    out = tmp_path / "backends" / "demo.json"
    r = run_cli("scripts/benchmark_backends.py", "--weights", tiny_gelan_weights, "--data", demo_data, "--imgsz", 64,
                "--calib-images", 4, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["backends"]) == set(BACKENDS) and result["val_images"] == 12
    assert result["ranges"]["weights_equal"] == result["ranges"]["weights"] > 30  # the tiny GELAN's 36 convs
    assert result["ranges"]["max"]["largest_rel"] < 0.01
    for b in result["backends"].values():
        assert b["lint"]["unshared_joins"] == 0 and b["lint"]["unquantized_convs"] == 0
    assert result["backends"]["modelopt"]["lint"] == result["backends"]["pytorch-quantization"]["lint"]
    assert result["table"] in backends_table(tmp_path)
