"""An interrupted `qat.py quantize`: killed and resumed to the same result, Ctrl-C saying how to resume."""
from __future__ import annotations

import json

from conftest import IMGSZ, TRAINED_T, run_cli

from models.checkpoint import load_quantized_model
from models.quantize import named_quantizers

COMMON = ["--imgsz", IMGSZ, "--batch-size", 4, "--device", "cpu", "--workers", 0]
TINY = [*COMMON, "--epochs", 2, "--iters", 2, "--calib-batches", 1, "--num-image", 4, "--no-eval-origin",
        "--calib-method", "mse"]


def _popen(*args):
    import os
    import signal
    import subprocess
    import sys
    from conftest import CHECKOUT
    # Ctrl-C as in a terminal: a suite started in the background (`cmd &`, nohup) inherits SIGINT ignored, and
    # Python then never raises KeyboardInterrupt
    return subprocess.Popen([sys.executable, str(CHECKOUT / "qat.py"), *map(str, args)], cwd=CHECKOUT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(pattern_dir, glob, proc, timeout=600):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(pattern_dir.glob(glob)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{glob} never appeared")


def _summary(run_dir):
    report = json.loads((run_dir / "report.json").read_text())
    mixed = {k: v for k, v in report.get("mixed_precision", {}).items() if k != "seconds"}
    return (sorted(p.name for p in (run_dir / "weights").iterdir()),
            [(e["epoch"], e["ap"], e["loss"]) for e in report["qat"]], report["qat_best"]["epoch"],
            report["select"], report["calibration"]["chosen"], report["calibration"]["candidates"],
            {k: report["final"][k] for k in ("stage", "epoch", "ap")}, mixed)


# With a budget: the trained model clipped at its median activation is far below the float model on select, so the
# run has to choose the tensor classes kept in float, and the resumed run must keep that choice, as it keeps every
# other (a run without a budget resumes through the same code, less that choice). At 160 px the clipped model
# scores 0 and no class alone brings anything back, so the set chosen is empty: a non-empty one is not exercised.
BUDGET = ["--max-loss", 0, "--calib-method", "percentile", "--percentile", 50, "--num-image", 12]


def test_killed_run_resumes_to_the_same_result(demo_data, tmp_path):
    """SIGKILL after the first QAT epoch, then --resume: the same files and numbers as an uninterrupted run
    (each epoch's data order and augmentation are seeded by the epoch), the same select split, calibration choice,
    tensor classes kept in float and delivered model, no temp files left behind: the resumed run keeps the choices
    it made rather than making them again."""
    import signal
    args = ["quantize", "--weights", TRAINED_T, "--data", demo_data, *TINY, *BUDGET, "--project", tmp_path]
    full = run_cli("qat.py", *args, "--name", "full")
    assert full.returncode == 0, full.stderr[-3000:]
    proc = _popen(*args, "--name", "killed")
    _wait_for(tmp_path / "killed" / "weights", "qat_ep_1_*.pt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    report = json.loads((tmp_path / "killed" / "report.json").read_text())
    assert report["ptq"] is not None and not report.get("finished")  # written at every stage
    r = run_cli("qat.py", "quantize", "--resume", tmp_path / "killed", "--device", "cpu", "--workers", 0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stdout + r.stderr
    assert _summary(tmp_path / "killed") == _summary(tmp_path / "full")
    assert not list((tmp_path / "killed").rglob("*.tmp")) and not list((tmp_path / "killed").rglob("qat_state.pt"))
    again = run_cli("qat.py", "quantize", "--resume", tmp_path / "killed", "--device", "cpu")
    assert again.returncode == 2 and "nothing to resume" in again.stderr
    # the choice was made (the all-INT8 PTQ is below the float model) and the delivered file holds it
    mixed = json.loads((tmp_path / "killed" / "report.json").read_text())["mixed_precision"]
    assert mixed["measured"] and mixed["max_loss"] == 0
    delivered = load_quantized_model(tmp_path / "killed" / "weights" / "best_gelan-t-demo.pt")
    kept = {c["name"] for c in mixed["kept_float"]}
    assert {n for n, q in named_quantizers(delivered, activations_only=True) if q._disabled} == kept


def test_ctrl_c_says_how_to_resume(gelan_t_weights, demo_data, tmp_path):
    import signal
    # long enough a QAT stage (minutes) that the signal lands inside it, whatever the machine's speed
    args = [*COMMON, "--epochs", 50, "--iters", 100, "--calib-batches", 1, "--calib-method", "max", "--num-image", 4,
            "--no-eval-origin"]
    proc = _popen("quantize", "--weights", gelan_t_weights, "--data", demo_data, *args, "--project", tmp_path,
                  "--name", "x")
    _wait_for(tmp_path / "x" / "weights", "ptq_*.pt", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130
    assert f"resume with: python qat.py quantize --resume {tmp_path / 'x'}" in err
    assert "Traceback" not in err
