"""`qat.py sensitive` as a user runs it: every INT8 tensor class measured on the select split it is given."""
from __future__ import annotations

import json

import pytest
from conftest import IMGSZ, REDUCED_SIZE, TRAINED_T, call_cli, run_cli

COMMON = ["--imgsz", IMGSZ, "--batch-size", 4, "--device", "cpu", "--workers", 0]


def test_sensitive_measures_every_tensor_class_on_select(demo_data320, tmp_path):
    """The costs `--max-loss` measures, for every candidate (an INT8 tensor class and the convs reading it), on the
    select split carved from the training images (the calibration images come from the rest), with the trained
    demo gelan-t: the float model's select mAP is the one val_trt.py measures on exactly the select images (not
    on val: 8 images against 40), and keeping tensor classes in float moves the score (costs of both signs)."""
    # each of its ~150 candidates is one evaluation
    r = run_cli("qat.py", "sensitive", "--weights", TRAINED_T, "--data", demo_data320, "--imgsz", REDUCED_SIZE,
                "--batch-size", 4, "--device", "cpu", "--workers", 0, "--calib-batches", 2, "--calib-method", "max",
                "--project", tmp_path, "--name", "s")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "s" / "summary-sensitive-analysis.json").read_text())
    assert summary["select"]["source"] == "train" and summary["select"]["fit_images"] > 0
    select = tmp_path / "s" / "split" / "select.txt"
    assert len(select.read_text().split()) == summary["select"]["images"] == 8
    candidates = summary["candidates"]
    assert len(candidates) > 100 and {d["layer"] for d in candidates} >= {0, 22}
    costs = [d["cost"] for d in candidates]
    assert costs == sorted(costs, reverse=True) and sum(d["mac_share"] for d in candidates) == pytest.approx(1, abs=1e-3)
    assert costs[0] > 0 > costs[-1] and summary["baseline_ptq"]["ap"] != summary["origin_select"]["ap"]
    data = tmp_path / "select.yaml"
    data.write_text(f"path: {tmp_path}\ntrain: {select}\nval: {select}\nnc: 12\nnames: {list(range(12))}\n")
    r = call_cli("val_trt.py", "--weights", TRAINED_T, "--data", data, "--imgsz", REDUCED_SIZE, "--batch-size", 8,
                 "--device", "cpu", "--workers", 0, "--project", tmp_path, "--name", "fp")
    assert r.returncode == 0, r.stderr[-2000:]
    independent = json.loads((tmp_path / "fp" / "val_trt.json").read_text())
    # a float model (no rounding to flip); another batch size moves the convolutions' last bits at most
    assert independent["ap"] == pytest.approx(summary["origin_select"]["ap"], abs=1e-3)
    assert (tmp_path / "s" / "sensitive-analysis.png").stat().st_size > 1000
    assert "| Rank | Tensor class" in summary["table"]


@pytest.mark.parametrize("choice", ["--select-data", "--no-select"])
def test_sensitive_takes_the_select_split_it_is_given(choice, tiny_gelan_weights, demo_data, tmp_path):
    """`--select-data D` measures on D's val images (the training images are not split); `--no-select` on the val
    images themselves, and says so. The val list holds 3 of demo_data's images: every tensor class is measured on
    it, and which images it holds is what this test is about (so the model is the smallest with every GELAN block:
    an evaluation per tensor class)."""
    import yaml
    data = yaml.safe_load(demo_data.read_text())
    val = tmp_path / "val.txt"
    val.write_text("".join(f"{f}\n" for f in sorted((demo_data.parent / "images" / "val").iterdir())[:3]))
    data.update(path=str(demo_data.parent), val=str(val))
    three = tmp_path / "three.yaml"
    three.write_text(yaml.safe_dump(data))
    extra = ["--select-data", three] if choice == "--select-data" else ["--no-select"]
    r = run_cli("qat.py", "sensitive", "--weights", tiny_gelan_weights, "--data", three if choice == "--no-select" else
                demo_data, *COMMON, "--calib-batches", 1, "--calib-method", "max", "--project", tmp_path, "--name", "s",
                *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "s" / "summary-sensitive-analysis.json").read_text())
    assert summary["select"]["source"] == {"--select-data": "select-data", "--no-select": "val"}[choice]
    assert summary["select"]["images"] == 3  # the 3 val images, whichever way they were named
    if choice == "--no-select":
        assert "optimistic" in r.stderr + r.stdout
