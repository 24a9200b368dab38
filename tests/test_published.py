"""A published figure, reproduced from the embedded model: the FP32 mAP50-95 of assets/gelan-s-helmet.pt on the
helmet selection split, as results/helmet/gelan-s/entry.json records it (scripts/benchmark_accuracy.py)."""
from __future__ import annotations

import json

import pytest
from conftest import REPO, SHARED, run_cli

from utils.datasplit import write_split
from utils.provenance import sha256

ENTRY = REPO / "results" / "helmet" / "gelan-s" / "entry.json"
WEIGHTS = REPO / "assets" / "gelan-s-helmet.pt"


def test_fp32_map_of_the_embedded_model_on_the_select_split(tmp_path):
    """Same weights (sha256), same images (split fingerprints), same loop: the same mAP. A float model has no
    rounding step to flip; only the convolutions' summation order differs between CPUs (or TF32 on a GPU, where
    the entry may have been measured), which moves mAP50-95 over the 187 select images by far less than 0.003."""
    if SHARED is None or not (SHARED / "datasets" / "helmet-416" / "data.yaml").is_file():
        pytest.skip("shared/datasets/helmet-416 not found (set YOLOV9_QAT_SHARED)")
    entry = json.loads(ENTRY.read_text())
    assert entry["provenance"]["weights_sha256"] == sha256(WEIGHTS)
    split = write_split(SHARED / "datasets" / "helmet-416" / "data.yaml", tmp_path / "split",
                        entry["provenance"]["split"]["fraction"], entry["provenance"]["split"]["seed"],
                        entry["provenance"]["split"]["min_images"])
    import yaml
    assert yaml.safe_load(split.read_text())["split"]["fingerprint"] == entry["provenance"]["split"]["fingerprint"]
    r = run_cli("val_trt.py", "--weights", WEIGHTS, "--data", split, "--imgsz", entry["imgsz"], "--batch-size", 8,
                "--device", "cpu", "--workers", 2, "--project", tmp_path, "--name", "fp")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads((tmp_path / "fp" / "val_trt.json").read_text())
    want = entry["fp"]["select"]
    print(f"published {want['ap']:.5f}, measured here {got['ap']:.5f}")
    assert got["images"] == entry["provenance"]["split"]["images"]["select"]
    assert got["ap"] == pytest.approx(want["ap"], abs=0.003) and got["ap50"] == pytest.approx(want["ap50"], abs=0.003)


def _numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield float(obj)


@pytest.mark.parametrize("page", ["README.md", "docs/RESULTS.md"])
def test_every_figure_in_the_prose_is_in_the_results(page):
    """The tables are rendered from results/ (and --render --check keeps them so); the prose around them may quote
    a figure too: each mAP-style figure in it (four decimals) must be one that a JSON file under results/ holds,
    to the fourth decimal, so that no sentence says what no run measured. (Other numbers in the prose are settings,
    counts and rules.)"""
    import re
    known = {round(abs(v), 4) for f in (REPO / "results").rglob("*.json") for v in _numbers(json.loads(f.read_text()))}
    text = (REPO / page).read_text()
    prose = re.sub(r"<!-- results:([\w.-]+) -->.*?<!-- /results:\1 -->", "", text, flags=re.S)
    figures = [m.group() for m in re.finditer(r"(?<![\w.])[-+]?\d+\.\d{4}(?!\d)", prose)]
    unknown = [f for f in figures if round(abs(float(f)), 4) not in known]
    assert unknown == [], f"{page}: figures no results JSON holds: {unknown}"
