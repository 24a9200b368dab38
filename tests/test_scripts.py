"""scripts/get_yolov9.sh, patch_yolov9.sh and the demo dataset generator."""
from __future__ import annotations

import subprocess
import sys

from conftest import CHECKOUT, REPO

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
