"""An interrupted `qat.py quantize`: Ctrl-C stops it between steps and says how to resume (utils/interrupts.py).
(A run killed and resumed: test_mixed_precision, on the run that chooses tensor classes to keep in float.)"""
from __future__ import annotations

import json
import os
import signal

import pytest

from conftest import IMGSZ, start_cli, wait_for_file
from utils.interrupts import StopBetweenSteps


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
    assert "Ctrl-C: stopping before the next step" in r.stderr
    assert f"resume with: python qat.py quantize --resume {tmp_path / 'x'}" in r.stderr
    # wherever the signal landed (a dataset being scanned, a progress bar being drawn), nothing was cut mid-way
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr
    report = json.loads((tmp_path / "x" / "report.json").read_text())
    assert os.path.isfile(report["ptq_file"])


@pytest.fixture
def sigint_as_in_a_terminal():
    """SIGINT raising KeyboardInterrupt, whatever the suite's runner set (a worker may ignore it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_first_ctrl_c_finishes_the_item_under_way_and_a_second_stops_at_once(sigint_as_in_a_terminal):
    done = []
    with pytest.raises(KeyboardInterrupt), StopBetweenSteps() as stop:
        items = stop.between(range(5))
        assert len(items) == 5  # progress bars keep their total
        for i in items:
            if i == 1:
                signal.raise_signal(signal.SIGINT)
                assert stop.requested
            done.append(i)
    assert done == [0, 1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back

    with pytest.raises(KeyboardInterrupt), StopBetweenSteps() as stop:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        done.append("after the second")
    assert done == [0, 1] and stop.requested  # the second raised where it landed, the first never acted on

    with StopBetweenSteps() as stop:  # a stop never asked for: the run goes on
        done += list(stop.between(range(2)))
    assert done == [0, 1, 0, 1]


def test_ctrl_c_ignored_stays_ignored(sigint_as_in_a_terminal):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # e.g. started with nohup &
    with StopBetweenSteps() as stop:
        signal.raise_signal(signal.SIGINT)
        assert not stop.requested
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
