"""An interrupted `qat.py quantize`: Ctrl-C says how to resume. (A run killed and resumed: test_mixed_precision,
on the run that chooses tensor classes to keep in float.)"""
from __future__ import annotations

import os
import signal

from conftest import IMGSZ, start_cli, wait_for_file


def test_ctrl_c_says_how_to_resume(gelan_t_weights, demo_data, tmp_path):
    # long enough a QAT stage (minutes) that the signal lands inside it, whatever the machine's speed
    args = ["--imgsz", IMGSZ, "--batch-size", 4, "--device", "cpu", "--workers", 0, "--epochs", 50, "--iters", 100,
            "--calib-batches", 1, "--calib-method", "max", "--num-image", 4, "--no-eval-origin"]
    run = start_cli("qat.py", "quantize", "--weights", gelan_t_weights, "--data", demo_data, *args, "--project",
                    tmp_path, "--name", "x")
    wait_for_file(tmp_path / "x" / "weights", "ptq_*.pt", run)
    os.kill(run.pid, signal.SIGINT)
    r = run.wait(300)
    assert r.returncode == 130
    assert f"resume with: python qat.py quantize --resume {tmp_path / 'x'}" in r.stderr
    assert "Traceback" not in r.stderr
