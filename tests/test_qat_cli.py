"""qat.py as a user runs it, on a real checkout built by scripts/get_yolov9.sh, with generated data."""
from __future__ import annotations

import json

import pytest
from conftest import IMGSZ, build_model, run_cli, save_float_checkpoint

COMMON = ["--imgsz", IMGSZ, "--batch-size", 4, "--device", "cpu", "--workers", 0]


@pytest.fixture(scope="module")
def quantize_run(gelan_t_weights, demo_data, tmp_path_factory):
    project = tmp_path_factory.mktemp("qat")
    r = run_cli("qat.py", "quantize", "--weights", gelan_t_weights, "--data", demo_data, *COMMON,
                "--epochs", 1, "--iters", 2, "--calib-batches", 2, "--project", project, "--name", "run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return project / "run", r


def test_quantize_writes_models_report_and_table(quantize_run):
    save_dir, r = quantize_run
    weights = save_dir / "weights"
    names = sorted(p.name for p in weights.glob("*.pt"))
    assert any(n.startswith("ptq_ap_") and n.endswith("_gelan-t-demo.pt") for n in names), names
    assert any(n.startswith("qat_ep_1_ap_") for n in names), names
    assert "qat_best_gelan-t-demo.pt" in names
    report = json.loads((save_dir / "report.json").read_text())
    for key in ("origin", "ptq", "qat", "qat_best", "quantizers", "timing", "table"):
        assert key in report, key
    for stage in ("origin", "ptq", "qat_best"):
        assert set(report[stage]) >= {"ap", "ap50", "precision", "recall"}
    assert report["quantizers"]["weight"] > 100 and report["quantizers"]["activation"] > 50
    assert len(report["qat"]) == 1 and report["qat"][0]["epoch"] == 1
    assert report["timing"]["calib_amax_s"] >= 0
    out = r.stdout + r.stderr
    for row in ("Origin (PyTorch)", "PTQ (PyTorch INT8)", "QAT best (PyTorch INT8)"):
        assert row in out
    assert not list(save_dir.rglob("*.tmp"))


def test_best_checkpoint_reloads_on_cpu_and_eval_reproduces_the_report(quantize_run, demo_data, tmp_path):
    save_dir, _ = quantize_run
    best = save_dir / "weights" / "qat_best_gelan-t-demo.pt"
    from models.quantize import is_quantized, load_quantized_model
    model = load_quantized_model(best, "cpu")
    assert is_quantized(model)
    r = run_cli("qat.py", "eval", "--weights", best, "--data", demo_data, "--imgsz", IMGSZ, "--batch-size", 8,
                "--device", "cpu", "--workers", 0, "--project", tmp_path, "--name", "ev")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "ev" / "eval.json").read_text())
    want = json.loads((save_dir / "report.json").read_text())["qat_best"]
    assert got["ap"] == pytest.approx(want["ap"], abs=1e-4)
    assert got["ap50"] == pytest.approx(want["ap50"], abs=1e-4)


def test_existing_results_are_not_overwritten(quantize_run, gelan_t_weights, demo_data):
    save_dir, _ = quantize_run
    r = run_cli("qat.py", "quantize", "--weights", gelan_t_weights, "--data", demo_data, *COMMON, "--epochs", 0,
                "--calib-batches", 1, "--no-eval-origin", "--no-eval-ptq", "--project", save_dir.parent,
                "--name", "run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (save_dir.parent / "run2" / "report.json").is_file()  # a new folder, the first one untouched


def test_sensitive_ranks_layers(gelan_t_weights, demo_data, tmp_path):
    r = run_cli("qat.py", "sensitive", "--weights", gelan_t_weights, "--data", demo_data, *COMMON,
                "--calib-batches", 1, "--calib-method", "max", "--num-image", 4, "--project", tmp_path, "--name", "s")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "s" / "summary-sensitive-analysis.json").read_text())
    layers = summary["layers"]
    assert len(layers) >= 20 and {d["layer"] for d in layers} >= {0, 22}
    aps = [d["ap"] for d in layers]
    assert aps == sorted(aps, reverse=True)
    assert (tmp_path / "s" / "sensitive-analysis.png").stat().st_size > 1000
    assert "| Rank | Layer |" in summary["table"]


@pytest.fixture(scope="module")
def dual_weights(tmp_path_factory):
    return save_float_checkpoint(build_model("yolov9-t"), tmp_path_factory.mktemp("dual") / "yolov9-t.pt")


@pytest.mark.parametrize("case", ["missing_weights", "missing_data", "training_weights", "eval_float",
                                  "sensitive_quantized", "bad_regex", "bad_imgsz", "not_a_checkpoint"])
def test_bad_input_is_one_clear_error(case, gelan_t_weights, demo_data, dual_weights, quantize_run, tmp_path):
    best = quantize_run[0] / "weights" / "qat_best_gelan-t-demo.pt"
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    base = ["--data", demo_data, *COMMON, "--project", tmp_path, "--name", "x", "--calib-batches", 1,
            "--no-eval-origin"]
    args, expect = {
        "missing_weights": (["quantize", "--weights", tmp_path / "nope.pt", *base], "nope.pt: file not found"),
        "missing_data": (["quantize", "--weights", gelan_t_weights, *COMMON, "--data", tmp_path / "d.yaml"],
                         "--data"),
        "training_weights": (["quantize", "--weights", dual_weights, *base], "reparameterization.py"),
        "eval_float": (["eval", "--weights", gelan_t_weights, "--data", demo_data, *COMMON], "not a quantized model"),
        "sensitive_quantized": (["sensitive", "--weights", best, "--data", demo_data, *COMMON], "float"),
        "bad_regex": (["quantize", "--weights", gelan_t_weights, *base, "--skip-layers", "(oops"], "--skip-layers"),
        "bad_imgsz": (["quantize", "--weights", gelan_t_weights, "--data", demo_data, "--imgsz", 100], "--imgsz"),
        "not_a_checkpoint": (["quantize", "--weights", junk, *base], "junk.pt"),
    }[case]
    r = run_cli("qat.py", *args)
    assert r.returncode != 0
    assert expect in r.stderr + r.stdout
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "x" / "report.json").exists()
