"""qat.py as a user runs it, on a real checkout built by scripts/get_yolov9.sh, with generated data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import IMGSZ, REDUCED_SIZE, TRAINED_T, build_model, call_cli, run_cli, save_float_checkpoint


COMMON = ["--imgsz", IMGSZ, "--batch-size", 4, "--device", "cpu", "--workers", 0]


TRAINED_RUN = ["--imgsz", REDUCED_SIZE, "--batch-size", 4, "--device", "cpu", "--workers", 0, "--num-image", 40]


@pytest.fixture(scope="module")
def quantize_run(demo_data320, tmp_path_factory):
    """The trained demo gelan-t through PTQ (`auto`) and one short QAT epoch, evaluated on 40 images of its own
    data; 2 calibration images."""
    project = tmp_path_factory.mktemp("qat")
    r = run_cli("qat.py", "quantize", "--weights", TRAINED_T, "--data", demo_data320, *TRAINED_RUN, "--batch-size", 2,
                "--epochs", 1, "--iters", 2, "--calib-batches", 1, "--project", project, "--name", "run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return project / "run", r


def test_quantize_writes_models_report_and_table(quantize_run):
    save_dir, r = quantize_run
    weights = save_dir / "weights"
    names = sorted(p.name for p in weights.glob("*.pt"))
    assert any(n.startswith("ptq_ap_") and n.endswith("_gelan-t-demo.pt") for n in names), names
    assert any(n.startswith("qat_ep_1_ap_") for n in names), names
    assert {"qat_best_gelan-t-demo.pt", "best_gelan-t-demo.pt"} <= set(names)
    report = json.loads((save_dir / "report.json").read_text())
    for key in ("origin", "ptq", "qat", "qat_best", "quantizers", "calibration", "select", "final", "val", "table"):
        assert key in report, key
    for stage in ("origin", "ptq", "qat_best", "final"):
        assert set(report[stage]) >= {"ap", "ap50", "precision", "recall"}
    assert set(report["val"]) == {"origin", "final"}
    assert report["quantizers"]["weight"] > 100 and report["quantizers"]["activation"] > 50
    assert len(report["qat"]) == 1 and report["qat"][0]["epoch"] == 1
    assert report["config"]["quant"]["calib_batches"] == 1 and len(report["calibration_images"]) == 1 * 2
    out = r.stdout + r.stderr
    for row in ("Origin (PyTorch), select", "PTQ ", "QAT best epoch (PyTorch INT8), select", "Delivered, val"):
        assert row in report["table"] and row in out
    assert out.count("quantizers calibrated on 2 images") == 1  # one summary line, not one per quantizer
    assert out.count("fine-tuning step: eager (not a CUDA device)") == 1  # the step's plan, said once
    assert report["step"] == {"plan": "eager (not a CUDA device)", "cache": None,
                              "cache_why": "decoded at every draw (--cache auto: not a CUDA device)"}
    assert "HistogramCollector" not in out and "Load calibrated amax" not in out
    assert not list(save_dir.rglob("*.tmp"))


def test_auto_keeps_the_best_candidate_and_best_of_never_ships_worse(quantize_run, demo_data320):
    """`auto` (the default) measured the eight one-rule candidate ranges on the select split and kept the best (the
    per-quantizer search is not among them: minutes on a CPU for nothing outside noise, README); the delivered model
    is the best on select of the PTQ model and every QAT epoch; the select images were never calibrated or fine-tuned
    on."""
    save_dir, _ = quantize_run
    report = json.loads((save_dir / "report.json").read_text())
    cal = report["calibration"]
    assert report["config"]["quant"]["calib_method"] == "auto"
    one_rule = ["max", "mse", "entropy", "percentile-99.9", "percentile-99.99", "percentile-99.999", "percentile-99.5",
                "percentile-99"]
    assert list(cal["candidates"]) == one_rule and "per_quantizer" not in cal
    assert cal["chosen"] == max(cal["candidates"], key=cal["candidates"].get)
    assert report["ptq"]["ap"] + report["ptq"].get("mask_ap", 0) == pytest.approx(cal["candidates"][cal["chosen"]])
    assert len(set(cal["candidates"].values())) > 1  # the candidates really differ: the choice is not a tie
    stages = [("ptq", 0, report["ptq"]["ap"])] + [("qat", e["epoch"], e["ap"]) for e in report["qat"]]
    stage, epoch, ap = max(stages, key=lambda t: t[2])
    final = report["final"]
    assert (final["stage"], final["epoch"], final["ap"]) == (stage, epoch, ap) and final["ap"] >= report["ptq"]["ap"]
    from models.quantization.checkpoint import read_checkpoint
    assert read_checkpoint(final["file"])["stage"] == stage
    # the select split: held out of the training images, disjoint from calibration, recorded with its fingerprint
    select = {Path(f).name for f in (save_dir / "split" / "select.txt").read_text().split()}
    fit = {Path(f).name for f in (save_dir / "split" / "fit.txt").read_text().split()}
    train = {p.name for p in (demo_data320.parent / "images" / "train").iterdir()}
    assert select and not select & fit and select | fit == train
    assert not select & set(report["calibration_images"]) and set(report["calibration_images"]) <= fit
    assert report["select"]["images"] == len(select) == 8 and report["select"]["source"] == "train"
    assert len(report["select"]["fingerprint"]) == 32


def test_best_checkpoint_reloads_on_cpu_and_eval_reproduces_the_report(quantize_run, demo_data320, tmp_path):
    save_dir, _ = quantize_run
    report = json.loads((save_dir / "report.json").read_text())
    best = Path(report["final"]["file"])
    from models.quantization.checkpoint import load_quantized_model
    from models.quantization.quantize import is_quantized
    model = load_quantized_model(best, "cpu")
    assert is_quantized(model)
    r = run_cli("qat.py", "eval", "--weights", best, "--data", demo_data320, *TRAINED_RUN[:2], "--batch-size", 8,
                *TRAINED_RUN[4:], "--project", tmp_path, "--name", "ev")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "ev" / "eval.json").read_text())
    want = report["val"]["final"]  # the delivered model, measured on val at the end of the run
    assert want["ap50"] > 0.1  # a trained model: the numbers compared are not zeros
    assert got["ap"] == pytest.approx(want["ap"], abs=1e-4)
    assert got["ap50"] == pytest.approx(want["ap50"], abs=1e-4)


def test_existing_results_are_not_overwritten(quantize_run, gelan_t_weights, demo_data):
    save_dir, _ = quantize_run
    r = run_cli("qat.py", "quantize", "--weights", gelan_t_weights, "--data", demo_data, *COMMON, "--epochs", 0,
                "--calib-batches", 1, "--calib-method", "max", "--no-eval-origin", "--no-eval-ptq", "--project",
                save_dir.parent,
                "--name", "run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (save_dir.parent / "run2" / "report.json").is_file()  # a new folder, the first one untouched


def test_no_select_warns_and_measures_the_val_images_once(demo_data, tmp_path):
    """--no-select makes the choices on the val images (a warning says so); the delivered model's val numbers are
    its select numbers, not a second pass over the same images (the trained demo model: numbers that are not 0)."""
    r = run_cli("qat.py", "quantize", "--weights", TRAINED_T, "--data", demo_data, *COMMON, "--epochs", 0,
                "--calib-batches", 1, "--calib-method", "max", "--num-image", 8, "--no-select", "--project", tmp_path,
                "--name", "run")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "--no-select" in out and "optimistic" in out
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["select"]["source"] == "val" and report["select"]["images"] >= 8 and report["origin"]["ap"] > 0
    assert report["val"]["final"] == {k: report["final"][k] for k in report["val"]["final"]}
    assert report["val"]["origin"] == report["origin"]
    assert "(val)" not in out  # every evaluation ran on select (= val), none twice
    listed = (tmp_path / "run" / "split" / "select.txt").read_text().split()  # what the choices were made on
    assert len(listed) == report["select"]["images"] and all("/val/" in f for f in listed)
    assert not (tmp_path / "run" / "split" / "fit.txt").exists()  # the training images are not split


def test_float_control_parts_parse_and_old_reports_resume(gelan_t_weights, demo_data):
    """`--float-control` alone is the full control, with a part only those quantizers; anything else is refused in
    one line; a report.json written when the flag was a switch (true/false) still loads for --resume."""
    import sys
    from models.pipeline import RunConfig
    call_cli("qat.py", "--help")  # loads the script as a module
    qat = sys.modules["cli_qat"]
    base = ["quantize", "--weights", str(gelan_t_weights), "--data", str(demo_data), "--epochs", "1"]
    for extra, part in (([], ""), (["--float-control"], "all"), (["--float-control", "weights"], "weights"),
                        (["--float-control", "activations", "--iters", "3"], "activations")):
        cfg = qat.build(dict(vars(qat.parse_opt(base + extra))))[1]
        assert cfg.control == part
    r = call_cli("qat.py", *base, "--float-control", "biases")
    assert r.returncode == 2 and "--float-control" in r.stderr and "invalid choice" in r.stderr
    r = call_cli("qat.py", *base[:-1], "0", "--float-control", "weights")
    assert r.returncode == 2 and "--float-control fine-tunes" in r.stderr
    for extra, expect in ((["--float-epochs", "1"], "--float-epochs 1: must be >= 0 and leave QAT epochs"),
                          (["--float-epochs", "-1"], "--float-epochs -1"),
                          (["--epochs", "3", "--float-epochs", "1", "--float-control"], "the plain --float-control"),
                          (["--epochs", "3", "--float-epochs", "1", "--ema", "0.99"],
                           "not with --learn-amax or --ema")):
        r = call_cli("qat.py", *base, *extra)
        errors = [line for line in r.stderr.splitlines() if "error:" in line]
        assert r.returncode == 2 and len(errors) == 1 and expect in errors[0], r.stderr[-2000:]
    for old, part in ((True, "all"), (False, "")):
        assert RunConfig.from_dict({**cfg.to_dict(), "control": old}).control == part


def test_float_epochs_are_the_controls_then_qat_continues_from_a_new_calibration(demo_data320, tmp_path):
    """--float-epochs 1 of 2: epoch 1 is the float control's epoch 1 (same loss, same select mAP: one schedule, the
    same data); then every quantizer is on again with ranges calibrated anew on the fine-tuned weights (the run's
    method, the same images), offered like the first PTQ model; QAT continues from it; the float epoch is never delivered."""
    from models.quantization.checkpoint import read_checkpoint
    from models.quantization.quantize import named_quantizers
    # nothing here reads val or the float model's mAP: 8 val images, no origin evaluation
    args = ["quantize", "--weights", TRAINED_T, "--data", demo_data320, "--imgsz", REDUCED_SIZE, "--batch-size", 4,
            "--device", "cpu", "--workers", 0, "--num-image", 8, "--no-eval-origin", "--epochs", 2, "--iters", 2,
            "--calib-batches", 2, "--calib-method", "mse", "--project", tmp_path]
    runs = {}
    for name, extra in (("first", ["--float-epochs", 1]), ("control", ["--float-control"])):
        r = run_cli("qat.py", *args, "--name", name, *extra)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "report.json").read_text())
    report, control = runs["first"], runs["control"]
    assert [e["stage"] for e in report["qat"]] == ["float", "qat"]
    first, float_epoch = report["qat"][0], control["qat"][0]
    assert first["loss"] == pytest.approx(float_epoch["loss"], rel=1e-5) and first["ap"] == float_epoch["ap"]
    trained = read_checkpoint(first["file"])["model"]
    assert all(q._disabled for _, q in named_quantizers(trained))
    again = report["recalibrated"]
    assert again["epoch"] == 1 and again["chosen"] == max(again["candidates"], key=again["candidates"].get)
    assert again["images"] == report["calibration"]["images"]
    before = dict(named_quantizers(read_checkpoint(report["ptq_file"])["model"], activations_only=True))
    after = dict(named_quantizers(read_checkpoint(again["file"])["model"], activations_only=True))
    assert before.keys() == after.keys() and not any(q._disabled for q in after.values())
    assert any(float(after[k].amax) != float(before[k].amax) for k in before)  # the weights moved: new ranges
    offered = [("ptq", 0, report["ptq"]["ap"]), ("ptq", 1, again["metrics"]["ap"]),
               ("qat", 2, report["qat"][1]["ap"])]
    final = report["final"]
    assert (final["stage"], final["epoch"], final["ap"]) == max(offered, key=lambda t: t[2])
    assert report["qat_best"]["epoch"] == 2


@pytest.fixture(scope="module")
def dual_weights(tmp_path_factory):
    return save_float_checkpoint(build_model("yolov9-t"), tmp_path_factory.mktemp("dual") / "yolov9-t.pt")


@pytest.mark.parametrize("case", ["missing_weights", "missing_data", "training_weights", "eval_float",
                                  "sensitive_quantized", "bad_regex", "bad_imgsz", "not_a_checkpoint",
                                  "missing_select_data", "bad_select_fraction", "max_loss_negative",
                                  "max_loss_with_control", "max_loss_with_float_epochs", "negative_workers"])
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
        "missing_select_data": (["quantize", "--weights", gelan_t_weights, *base, "--select-data", tmp_path / "s.yaml"],
                                "--select-data"),
        "bad_select_fraction": (["quantize", "--weights", gelan_t_weights, *base, "--select-fraction", 1.5],
                                "--select-fraction"),
        "max_loss_negative": (["quantize", "--weights", gelan_t_weights, *base, "--max-loss", -0.01], "--max-loss"),
        "max_loss_with_control": (["quantize", "--weights", gelan_t_weights, *base, "--max-loss", 0.01,
                                   "--float-control"], "--max-loss"),
        "max_loss_with_float_epochs": (["quantize", "--weights", gelan_t_weights, *base, "--max-loss", 0.01,
                                        "--epochs", 2, "--float-epochs", 1], "--max-loss"),
        "negative_workers": (["quantize", "--weights", gelan_t_weights, *base, "--workers", -1], "--workers"),
    }[case]
    r = call_cli("qat.py", *args)
    assert r.returncode != 0
    assert expect in r.stderr + r.stdout
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "x" / "report.json").exists()


def test_loader_workers_default_to_each_processs_share_of_the_cores(monkeypatch):
    """Without --workers a process loads with its share of the cores it may run on, less one for its own loop
    (upstream's fixed 8 left a GPU host's other cores idle while the step waited for batches); torchrun's
    LOCAL_WORLD_SIZE divides the cores among the machine's processes; --workers still sets it."""
    import os
    import sys
    from conftest import CHECKOUT, load_script
    from utils.batches import default_workers
    assert (default_workers(1, cores=16), default_workers(2, cores=32), default_workers(4, cores=2)) == (15, 15, 0)
    qat = sys.modules.get("cli_qat") or load_script(CHECKOUT / "qat.py", "cli_qat")
    cores, args = len(os.sched_getaffinity(0)), ["eval", "--weights", "w.pt", "--device", "cpu"]
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert qat.parse_opt(args).workers == max(0, cores - 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert qat.parse_opt(args).workers == max(0, cores // 2 - 1)
    assert qat.parse_opt([*args, "--workers", "3"]).workers == 3


# --------------------------------------------------------------------------------------------------
# Resume, interruption, checkpoint trust, inputs that would make the result meaningless, permissions
# --------------------------------------------------------------------------------------------------
# a fixed calibration method: auto's search is not what these tests are about (test_auto_... is)
def _evil_checkpoint(path, marker):
    import os
    import torch

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    torch.save({"model": Payload()}, path)
    return path


def test_crafted_checkpoint_does_not_run(demo_data, tmp_path):
    marker = tmp_path / "pwned"
    evil = _evil_checkpoint(tmp_path / "evil.pt", marker)
    r = run_cli("qat.py", "quantize", "--weights", evil, "--data", demo_data, *COMMON, "--project", tmp_path)
    assert r.returncode == 2 and "--trust-checkpoint" in r.stderr and "posix.system" in r.stderr
    assert not marker.exists() and "Traceback" not in r.stderr
    r = run_cli("qat.py", "quantize", "--weights", evil, "--data", demo_data, *COMMON, "--project", tmp_path,
                "--trust-checkpoint")
    assert marker.exists()  # the documented switch really unpickles fully (which is why it is opt-in)
    assert "fully unpickled" in r.stderr and r.returncode == 2


def _copy_dataset(src_yaml, dst, keep_val_labels=True, keep_val_images=True):
    import shutil
    src = yaml_load(src_yaml)
    root = Path(src["path"])
    shutil.copytree(root / "images" / "train", dst / "images" / "train")
    shutil.copytree(root / "labels" / "train", dst / "labels" / "train")
    (dst / "images" / "val").mkdir(parents=True)
    if keep_val_images:
        shutil.copytree(root / "images" / "val", dst / "images" / "val", dirs_exist_ok=True)
    if keep_val_labels:
        shutil.copytree(root / "labels" / "val", dst / "labels" / "val")
    data = dict(src, path=str(dst))
    (dst / "data.yaml").write_text(yaml_dump(data))
    return dst / "data.yaml"


def yaml_load(path):
    import yaml
    return yaml.safe_load(Path(path).read_text())


def yaml_dump(obj):
    import yaml
    return yaml.safe_dump(obj)


@pytest.mark.parametrize("case", ["nc_mismatch", "val_without_labels", "empty_val", "skip_matches_nothing",
                                  "project_not_a_dir"])
def test_meaningless_inputs_are_refused_before_a_run_folder_exists(case, gelan_t_weights, demo_data, tmp_path):
    weights, data, project, extra = gelan_t_weights, demo_data, tmp_path / "runs", []
    if case == "nc_mismatch":
        weights = save_float_checkpoint(build_model("gelan-t", nc=3), tmp_path / "nc3.pt")
        expect = "predicts 3 classes but --data"
    elif case == "val_without_labels":
        data = _copy_dataset(demo_data, tmp_path / "d", keep_val_labels=False)
        expect = "have no labels"
    elif case == "empty_val":
        data = _copy_dataset(demo_data, tmp_path / "d", keep_val_images=False)
        expect = "val"
    elif case == "skip_matches_nothing":
        extra, expect = ["--skip-layers", "99", "model\\.3\\.", "nonexistent_block"], "99 nonexistent_block"
    else:
        (tmp_path / "file").write_text("x")
        project, expect = tmp_path / "file" / "runs", "file"
    r = call_cli("qat.py", "quantize", "--weights", weights, "--data", data, *COMMON, "--calib-batches", 1,
                 "--epochs", 0, "--project", project, "--name", "x", *extra)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and expect in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not (project / "x").exists()


def test_outputs_respect_the_umask_and_eval_leaves_no_empty_folders(quantize_run, demo_data, tmp_path):
    import os
    import stat
    best = quantize_run[0] / "weights" / "qat_best_gelan-t-demo.pt"
    old = os.umask(0o027)  # the user's (run_cli's processes take their caller's, as a shell's take the shell's)
    try:
        for r in (run_cli("export_qat.py", "--weights", best, "--imgsz", IMGSZ, "--exist-ok"),
                  run_cli("qat.py", "eval", "--weights", best, "--data", demo_data, "--imgsz", IMGSZ, "--device",
                          "cpu", "--workers", 0, "--project", tmp_path, "--name", "ev")):
            assert r.returncode == 0, r.stderr[-2000:]
    finally:
        os.umask(old)
    for f in (best.with_suffix(".onnx"), tmp_path / "ev" / "eval.json"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f
    assert sorted(p.name for p in (tmp_path / "ev").iterdir()) == ["eval.json"]
    # files written under the default umask are readable by others (a DeepStream service account)
    assert stat.S_IMODE((quantize_run[0] / "report.json").stat().st_mode) & 0o044 == 0o044


def test_each_auto_candidate_is_one_qat_command(gelan_t_weights, demo_data):
    """What auto chose, named as the benchmark names it ("percentile-99.99"), turned into qat.py flags that calibrate
    with that candidate alone (--add-ranges recalibrates a seed with them): the recipe qat.py builds has the
    candidate's method and percentile."""
    import sys
    from models.quantization.calibration import AUTO_CANDIDATES, PER_QUANTIZER, calib_method_flags
    call_cli("qat.py", "--help")  # loads the script as a module
    qat = sys.modules["cli_qat"]
    base = ["quantize", "--weights", str(gelan_t_weights), "--data", str(demo_data), "--epochs", "0"]
    for name, (method, percentile) in {**AUTO_CANDIDATES, PER_QUANTIZER: (PER_QUANTIZER, None)}.items():
        quant = qat.build(dict(vars(qat.parse_opt(base + calib_method_flags(name)))))[1].quant
        assert quant.calib_method == method
        if percentile is not None:
            assert quant.percentile == percentile
