"""scripts/get_yolov9.sh, patch_yolov9.sh, the demo dataset generator and the accuracy benchmark."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from conftest import CHECKOUT, IMGSZ, REPO, run_cli

import yaml


def sh(*args, **kw):
    return subprocess.run(["bash", *map(str, args)], text=True, capture_output=True, **kw)


def test_get_yolov9_is_idempotent_and_refuses_foreign_dirs(checkout, tmp_path):
    r = sh(REPO / "scripts/get_yolov9.sh", checkout)
    assert r.returncode == 0 and "nothing to do" in r.stdout
    assert "rebuilt from PyPI wheel" in (checkout / ".yolov9_source").read_text() or \
        "git clone" in (checkout / ".yolov9_source").read_text()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    r = sh(REPO / "scripts/get_yolov9.sh", other)
    assert r.returncode != 0 and "not a YOLOv9 checkout" in r.stderr
    assert (other / "notes.txt").read_text() == "keep me"


def test_checkout_is_upstream_layout_without_wheel_prefix(checkout):
    for f in ("models/yolo.py", "models/common.py", "utils/general.py", "val.py", "train.py",
              "models/detect/gelan-c.yaml", "models/detect/yolov9-c.yaml", "data/hyps/hyp.scratch-high.yaml"):
        assert (checkout / f).is_file(), f
    offenders = [p for p in checkout.rglob("*.py") if "yolo9." in p.read_text(errors="ignore")]
    assert offenders == []
    r = subprocess.run([sys.executable, "-c", "import models.yolo, val, train"], cwd=checkout, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_patch_refuses_non_checkout_and_is_idempotent(tmp_path):
    r = sh(REPO / "patch_yolov9.sh", tmp_path)
    assert r.returncode != 0 and "not a YOLOv9 checkout" in r.stderr
    r = sh(REPO / "patch_yolov9.sh", CHECKOUT)
    assert r.returncode == 0 and "0 file(s) copied" in r.stdout
    assert (CHECKOUT / "qat.py").read_bytes() == (REPO / "qat.py").read_bytes()


def test_patch_keeps_a_user_file_it_would_replace(tmp_path):
    fake = tmp_path / "yv"
    for f in ("models/yolo.py", "models/common.py", "val.py", "train.py", "utils/general.py"):
        (fake / f).parent.mkdir(parents=True, exist_ok=True)
        (fake / f).write_text("# upstream\n")
    (fake / "qat.py").write_text("# the user's own qat.py\n")
    r = sh(REPO / "patch_yolov9.sh", fake)
    assert r.returncode == 0, r.stderr
    assert "copied  models/quantize.py" in r.stdout
    assert (fake / "qat.py.orig").read_text() == "# the user's own qat.py\n"
    assert (fake / "models/yolo.py").read_text() == "# upstream\n"
    r = sh(REPO / "patch_yolov9.sh", fake)
    assert "0 file(s) copied" in r.stdout


def test_demo_dataset_is_deterministic_and_valid(tmp_path):
    def make(out):
        args = [REPO / "scripts/make_demo_dataset.py", "--out", out, "--train", 6, "--val", 3, "--imgsz", 96, "--seed", 11]
        return subprocess.run([sys.executable, *map(str, args)], text=True, capture_output=True)
    assert make(tmp_path / "a").returncode == 0
    assert make(tmp_path / "b").returncode == 0
    a, b = tmp_path / "a", tmp_path / "b"
    for rel in ("labels/train/train_00003.txt", "images/val/val_00002.jpg"):
        assert (a / rel).read_bytes() == (b / rel).read_bytes()
    data = yaml.safe_load((a / "data.yaml").read_text())
    assert data["nc"] == len(data["names"]) >= 10
    val_labels = b"".join(f.read_bytes() for f in sorted((a / "labels" / "val").glob("*.txt")))
    assert data["fingerprint"]["val"] == hashlib.md5(val_labels).hexdigest()
    assert data["fingerprint"] == yaml.safe_load((b / "data.yaml").read_text())["fingerprint"]
    assert data["fingerprint"]["train"] != data["fingerprint"]["val"]
    classes = set()
    for f in (a / "labels").rglob("*.txt"):
        for line in f.read_text().split("\n"):
            if line:
                c, *box = line.split()
                classes.add(int(c))
                assert all(0 <= float(v) <= 1 for v in box)
    assert classes and max(classes) < data["nc"]
    r = make(tmp_path / "a")
    assert r.returncode != 0 and "--exist-ok" in r.stderr


def test_benchmark_accuracy_trains_measures_and_resumes_on_cpu(demo_data, tmp_path):
    """The GPU accuracy benchmark's whole path at tiny size: train (upstream train.py), PTQ per calibration
    method, QAT, export, ONNX Runtime mAP, merged JSON + table; a second run reuses every result."""
    weights, out = tmp_path / "gelan-t.pt", tmp_path / "bench"
    args = ["--models", f"gelan-t={weights}", "--train-epochs", 1, "--data", demo_data, "--imgsz", IMGSZ,
            "--batch-size", 4, "--device", "cpu", "--workers", 0, "--qat-epochs", 1, "--iters", 1,
            "--calib-batches", 1, "--out", out]
    r = run_cli("scripts/benchmark_accuracy.py", *args, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert weights.is_file()
    result = json.loads((out / "accuracy.json").read_text())
    entry = result["models"]["gelan-t"]
    assert set(entry["ptq"]) == {"max", "mse", "percentile-99.99", "percentile-99.999", "entropy"}
    assert entry["train_epochs"] == 1 and entry["qat_settings"]["epochs"] == 1
    for m in [entry["fp"], entry["qat"], entry["ort"], *entry["ptq"].values()]:
        assert 0.0 <= m["ap"] <= m["ap50"] <= 1.0
    assert entry["ptq"]["mse"]["calib_s"] > 0
    table = (out / "accuracy.md").read_text()
    assert table.count("| gelan-t |") == 8 and result["table"] == table.strip()
    again = run_cli("scripts/benchmark_accuracy.py", *args, "--lr", "2e-5", timeout=600)
    assert again.returncode == 0 and "qat.py" not in again.stdout and "train.py" not in again.stdout, again.stdout[-2000:]
    assert "reusing the QAT run" in again.stdout  # the figures stay labelled with the settings that made them
    assert json.loads((out / "accuracy.json").read_text())["models"] == result["models"]
