"""qat.py under torchrun on the CPU: 2 processes, gloo. Calibration statistics combined across ranks equal one
process's on the union of the same batches; a QAT run writes one report, from rank 0; resume checks the world."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import CHECKOUT, IMGSZ, call_cli

from models.calibrate import HistogramCollector
from models.checkpoint import load_quantized_model
from models.quantize import named_quantizers

COMMON = ["--imgsz", IMGSZ, "--device", "cpu", "--workers", 0, "--seed", 3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _combine_in_two_processes(rank: int, port: int, chunks: list, out: str) -> None:
    import torch.distributed as dist

    from models.distributed import World, combine_statistics, sharded
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    collector = HistogramCollector()
    for x in sharded(chunks, [collector], World(rank, 2, rank)):
        collector.collect(x)
    combine_statistics([collector], World(rank, 2, rank))
    np.savez(f"{out}/rank{rank}.npz", width=collector._width, hist=collector.hist.numpy())
    dist.destroy_process_group()


def test_histograms_combined_across_ranks_equal_one_process(tmp_path):
    """Rank 0 takes batches 0, 2, 4, rank 1 batches 1, 3 (both see batch 0 first, for the bin width; rank 1 does not
    count it); the summed histograms equal one collector's over batches 0-4, bin for bin, including a batch whose
    range outgrows the first (bins appended) and a far larger one (bins merged)."""
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(4000, generator=g) * s for s in (1.0, 0.5, 3.0, 1.2, 20.0)]
    single = HistogramCollector()
    for x in chunks:
        single.collect(x)
    import torch.multiprocessing as mp
    mp.start_processes(_combine_in_two_processes, args=(_free_port(), chunks, str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fork would copy this process's OpenMP threads
    for rank in (0, 1):
        saved = np.load(tmp_path / f"rank{rank}.npz")
        width, hist = float(saved["width"]), saved["hist"]
        assert width == pytest.approx(single._width)
        assert np.array_equal(hist[:single.hist.numel()], single.hist.numpy()) and hist[single.hist.numel():].sum() == 0
    assert single.hist.sum() == 5 * 4000


def _torchrun(*args, cwd=CHECKOUT, timeout=900):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", YOLOV9_QAT_DIST_TIMEOUT_MIN="5")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(CHECKOUT / "qat.py"), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, text=True, capture_output=True, env=env, timeout=timeout)


def _qat(*args):
    return subprocess.run([sys.executable, str(CHECKOUT / "qat.py"), *map(str, args)], cwd=CHECKOUT, text=True,
                          capture_output=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _amax(weights):
    return {n: q.amax.detach().float().reshape(-1) for n, q in named_quantizers(load_quantized_model(weights))
            if q.amax is not None}


@pytest.mark.parametrize("method", ["max", "mse"])
def test_two_process_calibration_equals_one_process(method, gelan_t_weights, demo_data, tmp_path):
    """2 gloo ranks, global batch 4 (2 per rank) and 2 calibration batches, against one process calibrating on the
    union of the same 4 batches of 2 (the same images, in the same order, the same first batch fixing the bin
    width): the same amax for every quantizer, to float tolerance."""
    common = ["quantize", "--weights", gelan_t_weights, "--data", demo_data, *COMMON, "--calib-method", method,
              "--epochs", 0, "--no-eval-origin", "--no-eval-ptq", "--project", tmp_path]
    r = _torchrun(*common, "--batch-size", 4, "--calib-batches", 2, "--name", "two")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _qat(*common, "--batch-size", 2, "--calib-batches", 4, "--name", "one")
    assert r.returncode == 0, r.stderr[-3000:]
    reports = {k: json.loads((tmp_path / k / "report.json").read_text()) for k in ("one", "two")}
    assert reports["two"]["world_size"] == 2 and reports["one"]["world_size"] == 1
    assert reports["two"]["calibration_images"] == reports["one"]["calibration_images"]  # the same images
    two, one = (_amax(next((tmp_path / k / "weights").glob("ptq_*.pt"))) for k in ("two", "one"))
    assert two.keys() == one.keys() and len(one) > 100
    for name in one:
        assert torch.allclose(two[name], one[name], rtol=1e-5, atol=1e-7), (name, two[name], one[name])


def test_two_process_qat_writes_one_report_and_resume_checks_the_world(gelan_t_weights, demo_data, tmp_path):
    r = _torchrun("quantize", "--weights", gelan_t_weights, "--data", demo_data, *COMMON, "--batch-size", 4,
                  "--calib-batches", 1, "--epochs", 2, "--iters", 2, "--num-image", 4, "--no-eval-origin",
                  "--project", tmp_path, "--name", "run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # one folder: rank 1 made none of its own
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["finished"] and report["world_size"] == 2 and [e["epoch"] for e in report["qat"]] == [1, 2]
    assert r.stdout.count("results saved to") + r.stderr.count("results saved to") == 1  # rank 0 alone reports
    report["finished"] = False  # as if the job had been stopped
    (tmp_path / "run" / "report.json").write_text(json.dumps(report))
    r = call_cli("qat.py", "quantize", "--resume", tmp_path / "run", "--device", "cpu")
    assert r.returncode == 2 and "started on 2 process(es)" in r.stderr and "--nproc_per_node 2" in r.stderr
    r = _torchrun("eval", "--weights", report["qat_best_file"], "--data", demo_data, *COMMON)
    assert r.returncode != 0 and "runs in one process" in r.stderr
