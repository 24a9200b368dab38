"""The README workflow on both kinds of checkout, offline: the PyPI rebuild that get_yolov9.sh makes here, and the
genuine upstream repository (from shared/reference when it is there). Upstream's own scripts must keep working
after patch_yolov9.sh: on the genuine checkout, what users clone, train with and without --weights, train_dual, val,
detect, segment/train; on the PyPI rebuild, whose scripts get only the font edit, a first training run, val and
detect. Then this toolkit's steps 3 to 7 run in the genuine checkout (the other test modules run them in the PyPI
rebuild: test_segment's float training runs upstream's segment/train.py)."""
from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import CHECKOUT, REPO, SHARED, run_preloaded

GENUINE = (SHARED / "reference" / "yolov9-upstream-5b1ea9a.tar.gz") if SHARED else None
IMG = 64


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    if GENUINE is None or not GENUINE.is_file():
        pytest.skip(f"the genuine upstream repository was not found (shared/reference; set YOLOV9_QAT_SHARED): "
                    f"looked for {GENUINE}")
    root = tmp_path_factory.mktemp("genuine")
    with tarfile.open(GENUINE) as tar:
        tar.extractall(root, filter="data")
    checkout = root / "yolov9"
    r = subprocess.run(["bash", str(REPO / "patch_yolov9.sh"), str(checkout)], text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    assert "12 upstream file(s) carry the compatibility edits" in r.stdout
    return checkout


def run(checkout: Path, *args, env=None, timeout=900, fresh=False):
    """`python args` in `checkout` with its own modules; a script or -m module (not -c) in a process forked from a
    Python that has imported them (conftest.run_preloaded) unless `fresh`: each workflow's first command and the
    shell scripts start a Python from nothing, as the user's do."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env["PYTHONPATH"] = str(checkout)  # this checkout's modules, not the session's
    args = [str(a) for a in args]
    if not fresh and args[0] == "-m":
        return run_preloaded(args, checkout, env, timeout)
    if not fresh and not args[0].startswith("-"):
        return run_preloaded([str(checkout / args[0]), *args[1:]], checkout, env, timeout)
    return subprocess.run([sys.executable, *args], cwd=checkout, text=True, capture_output=True, env=env,
                          timeout=timeout)


def ok(r) -> None:
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-1500:] + r.stderr[-3000:]


def test_patch_is_idempotent_and_undoes_on_the_genuine_repository(genuine, tmp_path):
    copy = tmp_path / "y"
    shutil.copytree(genuine, copy)
    r = subprocess.run(["bash", str(REPO / "patch_yolov9.sh"), str(copy)], text=True, capture_output=True)
    assert r.returncode == 0 and "0 file(s) copied" in r.stdout
    assert filecmp.cmp(copy / "utils" / "general.py", genuine / "utils" / "general.py", shallow=False)  # not twice
    assert "weights_only=False" in (copy / "train.py").read_text()
    # mAP on a NumPy that has dropped np.trapz (as 2.5 has): a perfect PR curve is 0.995 under upstream's 101-point
    # rule (the point at recall 1 meets its appended precision 0)
    r = run(copy, "-c", "import numpy as np; del np.trapz; from utils.metrics import compute_ap; "
                        "print(round(compute_ap([0.0, 1.0], [1.0, 1.0])[0], 3))")
    ok(r)
    assert r.stdout.split()[-1] == "0.995"
    r = run(copy, copy / "utils" / "upstream_compat.py", copy, "--undo", fresh=True)  # stdlib only: no server
    ok(r)
    assert "restored 12 upstream file(s)" in r.stdout
    with tarfile.open(GENUINE) as tar:
        original = tar.extractfile("yolov9/train.py").read().decode()
    assert (copy / "train.py").read_text() == original and not list(copy.rglob("*.yolov9_qat.orig"))


@pytest.mark.parametrize("kind", ["pypi", "genuine"])
def test_readme_workflow_offline(kind, request, demo_data, seg_data, tmp_path):
    checkout = CHECKOUT if kind == "pypi" else request.getfixturevalue("genuine")
    offline = {"YOLOV5_CONFIG_DIR": str(tmp_path / "cfg")}  # no font there: upstream would download one
    common = ["--img", IMG, "--batch", 8, "--epochs", 1, "--device", "cpu", "--workers", 0, "--project",
              tmp_path / "runs"]
    train = ["--data", demo_data, "--hyp", "data/hyps/hyp.scratch-high.yaml", *common]
    # 1. upstream, as a user trains: from scratch, from weights, the dual-branch model, segmentation; val, detect.
    # Plots (labels, curves: ~20 s a run) are drawn by the genuine checkout's first run, val and detect (detect and
    # val cover the offline font on both checkouts).
    r = run(checkout, "train.py", *train, "--cfg", "models/detect/gelan-t.yaml", "--weights", "", "--name", "t0",
            *(["--noplots"] if kind == "pypi" else []), env=offline, fresh=True)
    ok(r)  # a first run offline: the font answered by one installed already, no download tried
    assert (tmp_path / "cfg" / "Arial.ttf").is_file() and "ultralytics.com/assets" not in r.stdout + r.stderr
    best = tmp_path / "runs" / "t0" / "weights" / "best.pt"
    if kind == "genuine":  # what users clone; the PyPI rebuild's own training code gets no edit but the font's
        ok(run(checkout, "train.py", *train, "--cfg", "models/detect/gelan-t.yaml", "--weights", best, "--name", "t1",
               "--noplots", env=offline))
        ok(run(checkout, "train_dual.py", *train, "--cfg", "models/detect/yolov9-t.yaml", "--weights", "", "--name",
               "d0", "--noplots", env=offline))
    ok(run(checkout, "val.py", "--data", demo_data, "--weights", best, "--img", IMG, "--device", "cpu", "--project",
           tmp_path / "val", env=offline))
    ok(run(checkout, "detect.py", "--weights", best, "--source", demo_data.parent / "images" / "val", "--img", IMG,
           "--device", "cpu", "--project", tmp_path / "detect", env=offline))
    if kind == "pypi":  # segment/train.py and steps 3-7 run on this checkout in other test modules (test_segment's
        return          # float training, every module's quantize, export and val_trt)
    ok(run(checkout, "segment/train.py", "--data", seg_data, "--hyp", "data/hyps/hyp.scratch-high.yaml", *common,
           "--cfg", REPO / "assets" / "gelan-t-seg.yaml", "--weights", "", "--name", "s0", "--noplots",
           env=offline))
    # 3-7. this toolkit on what upstream trained
    q = ["--data", demo_data, "--imgsz", IMG, "--device", "cpu", "--workers", 0]
    ok(run(checkout, "qat.py", "quantize", "--weights", best, *q, "--batch-size", 4, "--epochs", 1, "--iters", 1,
           "--calib-batches", 1, "--project", tmp_path / "qat", "--name", "q", env=offline))
    w = tmp_path / "qat" / "q" / "weights" / "qat_best_best.pt"
    ok(run(checkout, "qat.py", "eval", "--weights", w, *q, "--project", tmp_path / "ev", env=offline))
    ok(run(checkout, "export_qat.py", "--weights", w, "--include", "onnx", "--dynamic", "--simplify", "--verify",
           "--data", demo_data, "--imgsz", IMG, env=offline))
    ok(run(checkout, "export_qat.py", "--weights", w, "--include", "onnx_end2end", "--dynamic", "--imgsz", IMG,
           env=offline))
    ok(run(checkout, "export_yoloV9.py", "--weights", w, "--dynamic", "--simplify", "--size", IMG, env=offline))
    ok(run(checkout, "-m", "utils.qdq_lint", w.with_suffix(".onnx"), "--strict"))
    made = sorted(p.name for p in w.parent.iterdir() if p.suffix in (".onnx", ".txt"))  # each its own file
    assert made == [f"{w.stem}-deepstream-labels.txt", f"{w.stem}-deepstream.onnx", f"{w.stem}-end2end.onnx",
                    f"{w.stem}.onnx"], made
    if shutil.which("trtexec") is None:  # 7. val_trt.sh reuses step 6's graph (export_qat.py --reuse: test_export)
        before = w.with_suffix(".onnx").stat().st_mtime_ns
        cmd = ["bash", str(checkout / "scripts" / "val_trt.sh"), str(w), str(demo_data), str(IMG), "--batch-size", "4"]
        env = {**os.environ, **offline, "PYTHONPATH": str(checkout)}
        r = subprocess.run(cmd, cwd=checkout, text=True, capture_output=True, timeout=900, env=env)
        ok(r)
        assert "reusing" in r.stderr and w.with_suffix(".onnx").stat().st_mtime_ns == before
        assert "TensorRT (trtexec + Python package) is not available here" in r.stderr
        assert "ms/image (onnxruntime, batch 4)" in r.stdout + r.stderr
