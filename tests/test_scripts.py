"""scripts/get_yolov9.sh, patch_yolov9.sh, the demo dataset generator and the accuracy benchmark."""
from __future__ import annotations

import hashlib
import shutil
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import CHECKOUT, IMGSZ, REPO, call_cli, cli_env, load_script, run_cli


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
    assert offenders == []  # that it imports: test_upstream's first run of train.py here, in a fresh interpreter


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
    assert "copied  models/quantization/quantize.py" in r.stdout
    assert (fake / "qat.py.orig").read_text() == "# the user's own qat.py\n"
    assert (fake / "models/yolo.py").read_text() == "# upstream\n"
    r = sh(REPO / "patch_yolov9.sh", fake)
    assert "0 file(s) copied" in r.stdout



def test_patch_removes_what_an_earlier_overlay_put_there_and_no_longer_has(tmp_path):
    """A checkout patched before a module moved: the old file is removed (it would shadow nothing, but a reader
    would take it for the code that runs), the user's file it had replaced is put back, anything else is kept."""
    fake = tmp_path / "yv"
    for f in ("models/yolo.py", "models/common.py", "val.py", "train.py", "utils/general.py"):
        (fake / f).parent.mkdir(parents=True, exist_ok=True)
        (fake / f).write_text("# upstream\n")
    assert sh(REPO / "patch_yolov9.sh", fake).returncode == 0
    (fake / "models/quantize.py").write_text("# the flat layout's module\n")
    (fake / "models/helpers.py").write_text("# an overlay's helpers.py\n")
    (fake / "models/helpers.py.orig").write_text("# the user's helpers.py\n")
    (fake / "models/mine.py").write_text("# the user's, never patched\n")
    manifest = fake / ".yolov9_qat_files"
    manifest.write_text(manifest.read_text() + "models/quantize.py\nmodels/helpers.py\n")
    r = sh(REPO / "patch_yolov9.sh", fake)
    assert r.returncode == 0, r.stderr
    assert "removed models/quantize.py" in r.stdout and "2 removed" in r.stdout
    assert not (fake / "models/quantize.py").exists()
    assert (fake / "models/helpers.py").read_text() == "# the user's helpers.py\n"
    assert not (fake / "models/helpers.py.orig").exists()
    assert (fake / "models/mine.py").is_file()
    listed = manifest.read_text().split()
    assert "models/quantize.py" not in listed and "models/quantization/quantize.py" in listed
    assert "0 removed" in sh(REPO / "patch_yolov9.sh", fake).stdout


def test_model_optimizer_torch_quantization_imports_beside_upstreams_setuptools():
    """What `./install_dependencies.sh --modelopt` installs: Model Optimizer's torch quantization and upstream's
    `pkg_resources` (setuptools < 70) in one process, the pair a Model Optimizer backend needs."""
    import importlib.util
    if importlib.util.find_spec("modelopt") is None:
        pytest.skip("nvidia-modelopt is not installed (./install_dependencies.sh --modelopt)")
    code = ("import pkg_resources, setuptools, modelopt.torch.quantization as mtq; "
            "print(setuptools.__version__, len(mtq.INT8_DEFAULT_CFG))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), cwd=CHECKOUT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-2].split(".")[0]) < 70

# The generator's output on any numpy/OpenCV: computed here (numpy 2.2.6, OpenCV 4.12) and, for the 400/100
# demo set, found identical on the GPU machine's image (numpy 2.5, OpenCV 5); see make_demo_dataset.py for why.
TINY_FINGERPRINT = {"train": "3b5cbead8fae51f1cbbf41c7c78a8a03", "val": "f068f4d82bc9de3822e04b3ede46b03b"}


def _make(out, *extra):
    args = [REPO / "scripts/make_demo_dataset.py", "--out", out, "--train", 6, "--val", 3, "--imgsz", 96, "--seed", 11,
            *extra]
    return subprocess.run([sys.executable, *map(str, args)], text=True, capture_output=True)


def test_demo_dataset_is_the_same_everywhere_and_valid(tmp_path):
    import cv2
    import numpy as np
    a = tmp_path / "a"
    assert _make(a).returncode == 0
    data = yaml.safe_load((a / "data.yaml").read_text())
    assert data["fingerprint"] == TINY_FINGERPRINT
    md5 = hashlib.md5()  # the fingerprint covers decoded pixels and labels, in name order
    for img in sorted((a / "images" / "val").glob("*.png")):
        md5.update(cv2.imread(str(img)).tobytes())  # BGR, as written
        md5.update((a / "labels" / "val" / f"{img.stem}.txt").read_bytes())
    assert md5.hexdigest() == data["fingerprint"]["val"]
    assert data["nc"] == len(data["names"]) == 12
    classes = set()
    for f in (a / "labels").rglob("*.txt"):
        for line in f.read_text().splitlines():
            c, *box = line.split()
            classes.add(int(c))
            assert len(box) == 4 and all(0 <= float(v) <= 1 for v in box)
    assert len(classes) >= 5 and max(classes) < data["nc"]
    assert np.asarray(cv2.imread(str(a / "images/train/train_00000.png"))).std() > 10  # textured, not blank
    r = _make(a)
    assert r.returncode != 0 and "--exist-ok" in r.stderr


def test_demo_segments_are_outlines_of_the_boxed_objects(tmp_path):
    assert _make(tmp_path / "b").returncode == 0 and _make(tmp_path / "s", "--segments").returncode == 0
    for f in sorted((tmp_path / "b" / "labels").rglob("*.txt")):
        boxes = [list(map(float, line.split())) for line in f.read_text().splitlines()]
        polys = [list(map(float, line.split())) for line in
                 (tmp_path / "s" / f.relative_to(tmp_path / "b")).read_text().splitlines()]
        assert [b[0] for b in boxes] == [p[0] for p in polys]  # same objects, same order
        for (c, x, y, w, h), (_, *xy) in zip(boxes, polys):
            px, py = xy[0::2], xy[1::2]
            assert len(px) >= 3
            # upstream derives the box from the polygon: the same box, less half a pixel on each side (the outline
            # runs through the boundary pixels' centres); 1e-5 for the labels' six decimals
            assert abs((min(px) + max(px)) / 2 - x) < 1e-5 and abs(max(px) - min(px) - (w - 1 / 96)) < 1e-5
            assert abs((min(py) + max(py)) / 2 - y) < 1e-5 and abs(max(py) - min(py) - (h - 1 / 96)) < 1e-5


def test_patch_with_a_relative_target_from_another_folder(tmp_path):
    import shutil
    fake = tmp_path / "work" / "yv"
    for f in ("models/yolo.py", "models/common.py", "val.py", "train.py", "utils/general.py"):
        (fake / f).parent.mkdir(parents=True, exist_ok=True)
        (fake / f).write_text("# upstream\n")
    r = sh(REPO / "patch_yolov9.sh", "work/yv", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (fake / "qat.py").read_bytes() == (REPO / "qat.py").read_bytes()
    assert not (REPO / "work").exists()
    shutil.rmtree(tmp_path / "work")


@pytest.fixture(scope="module")
def bench_run(demo_data16, tmp_path_factory):
    """The accuracy benchmark's whole path at tiny size, once, with the trained demo gelan-t (its mAPs are not 0:
    every comparison below compares real numbers): 2 seeds, the default command with its float control and its
    --max-loss 0 variant, one recipe variant; with Model Optimizer's PTQ (its max calibration: each of its methods is
    one more step of the same code) where nvidia-modelopt is installed."""
    import importlib.util
    from conftest import TRAINED_T
    tmp = tmp_path_factory.mktemp("bench")
    modelopt = importlib.util.find_spec("modelopt") is not None
    args = ["--dataset", "demo", "--models", f"gelan-t={TRAINED_T}", "--data", demo_data16, "--imgsz", IMGSZ,
            "--batch-size", 2, "--device", "cpu", "--workers", 0, "--seeds", 0, 1, "--methods", "max",
            "percentile-99.9", "--qat-epochs", 1, "--iters", 1, "--calib-batches", 1, "--jobs", 2, "--ort-seeds", 1,
            "--max-loss", 0, "--work", tmp / "work", "--out", tmp / "results", "--ablation", "det-3",
            *(["--modelopt", "max"] if modelopt else [])]
    r = run_cli("scripts/benchmark_accuracy.py", *args, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    entry = json.loads((tmp / "results" / "demo" / "gelan-t" / "entry.json").read_text())
    return tmp, args, entry, modelopt


def on_seed_one(args: list) -> list[str]:
    """The benchmark fixture's command for seed 1 only, without the peer (a step added to its entry later)."""
    peer = args.index("--modelopt") if "--modelopt" in args else len(args)
    return [str(a) for a in args[:args.index("--seeds")]] + ["--seeds", "1"] + \
        [str(a) for a in args[args.index("--methods"):peer]]


def test_benchmark_accuracy_chooses_on_select_and_resumes_on_cpu(bench_run, demo_data16):
    """The select split (the one qat.py carves itself), every calibration candidate per seed from the default
    command's one calibration, the choice on select, the default command (auto, QAT, best-of), its float control and
    its --max-loss variant per seed, the deployed graphs in ONNX Runtime, an entry with provenance and every per-seed
    number; a second run reruns nothing, the rendered tables pass --check, and nothing is written outside --work and
    --out."""
    from conftest import TRAINED_T
    tmp, args, e, modelopt = bench_run
    out, work = tmp / "results", tmp / "work"
    split = yaml.safe_load((work / "demo" / "split" / "split.yaml").read_text())
    prov = e["provenance"]
    assert prov["seeds"] == [0, 1] and prov["split"]["fingerprint"] == split["split"]["fingerprint"]
    assert prov["weights_sha256"] == hashlib.sha256(TRAINED_T.read_bytes()).hexdigest()
    assert prov["command"].endswith("--ablation det-3" + (" --modelopt max" if modelopt else ""))
    assert len(prov["commit"]) >= 7 and prov["machine"]["torch"] and prov["steps_ran_on"] == [
        f"CPU (torch {prov['machine']['torch']})"]  # the steps' own logs: where they ran
    # the choice is the method with the best mean on select, whatever val says
    means = {m: sum(r["select"]["ap"] for r in runs.values()) / 2 for m, runs in e["ptq"].items()}
    assert e["ptq_choice"] == max(means, key=means.get) and set(e["ptq"]) == {"max", "percentile-99.9"}
    assert all(r["val"]["ap"] > 0 for runs in e["ptq"].values() for r in runs.values())
    reports = {s: json.loads((work / "demo" / "gelan-t" / f"qat-seed{s}" / "report.json").read_text()) for s in (0, 1)}
    for m, runs in e["ptq"].items():  # each row is the default command's candidate, as measured in the run
        for s, row in runs.items():
            assert row["select"] == reports[int(s)]["calibration"]["saved"][m]["metrics"]
            assert row["select"]["ap"] == reports[int(s)]["calibration"]["candidates"][m]
    # each seed calibrated on its own sample of the fit images, never on select or val
    fit = {Path(f).name for f in (work / "demo" / "split" / "fit.txt").read_text().split()}
    samples = [reports[s]["calibration_images"] for s in (0, 1)]
    assert all(set(names) <= fit for names in samples) and samples[0] != samples[1]
    from models.core.task import DETECT
    from models.pipeline import RunConfig, calibration_sample
    from models.quantization.quantize import QuantRecipe
    for seed, names in enumerate(samples):  # drawn again from the sampler alone, as --add-peer does
        cfg = RunConfig(str(TRAINED_T), str(demo_data16), "", imgsz=IMGSZ, batch_size=2, workers=0, seed=seed,
                        quant=QuantRecipe(calib_batches=1))
        assert calibration_sample(DETECT, work / "demo" / "split" / "fit.txt", cfg) == names
    for kind in ("qat", "fp_ft", "mixed"):
        assert set(e[kind]) == {"0", "1"} and all(r["best_epoch"] == 1 for r in e[kind].values())
    assert e["qat"]["0"]["recipe"]["distill"] == "head"
    for s, r in e["mixed"].items():  # the budget variant: its choice, from the same PTQ, and what it costs the engine
        mp = r["mixed_precision"]
        assert mp["max_loss"] == 0 and 0 < mp["int8_mac_share"] <= 1 and mp["lint_problems"] == 0
        assert mp["all_int8_select"] == reports[int(s)]["ptq"]["ap"] and mp["origin_select"] == e["fp"]["select"]["ap"]
        assert len(mp["float_convs"]) == len({c for k in mp["kept_float"] for c in k["convs"]})
    assert set(e["ort"]) == {"fp32", "fp16"} and e["ort"]["fp32"]["0"]["lint"]["unshared_joins"] == 0
    assert all(set(runs) == {"0"} for runs in e["ort"].values())  # --ort-seeds 1: the first seed's graphs only
    assert all(r["train_img_s"] > 0 for r in e["qat"].values())
    # the deployed graph is the delivered checkpoint of its own seed (seeds deliver different models here)
    assert e["qat"]["0"]["val_final"]["ap"] != e["qat"]["1"]["val_final"]["ap"]
    assert s_ort_delta(e) == pytest.approx(e["ort"]["fp32"]["0"]["val"]["ap"] - e["qat"]["0"]["val_final"]["ap"],
                                           abs=1e-5)
    s = e["summary"]
    assert s["qat_best"]["values"] == [e["qat"][k]["val_best"]["ap"] for k in ("0", "1")]
    assert s["quantization_cost"]["delta"] == pytest.approx(s["final"]["mean"] - s["fp_ft_best"]["mean"], abs=1e-5)
    assert s["mixed_int8_share"]["values"] == [e["mixed"][k]["mixed_precision"]["int8_mac_share"] for k in ("0", "1")]
    rendered = (out / "accuracy.md").read_text()
    assert "Delivered with --max-loss 0 (convs kept in float per seed:" in rendered
    for k, r in e["qat"].items():  # the default command: auto chose its best candidate, delivered its best stage
        assert r["auto"]["chosen"] == max(r["auto"]["candidates"], key=r["auto"]["candidates"].get)
        report = reports[int(k)]
        assert report["select"]["fingerprint"] == split["split"]["fingerprint"]["select"]
        stages = [report["ptq"]["ap"]] + [ep["ap"] for ep in report["qat"]]
        assert report["final"]["ap"] == max(stages)
        assert r["val_final"] == (r["auto"]["val"] if r["final"]["stage"] == "ptq" else r["val_best"])
    # the ablation: the default row is the default command's own runs, each variant judged on select only
    a = json.loads((out / "demo" / "gelan-t" / "ablation.json").read_text())
    assert list(a["variants"]) == ["default", "det-3"]
    assert a["variants"]["default"]["select_best"]["values"] == [reports[k]["qat_best"]["ap"] for k in (0, 1)]
    det3 = json.loads((work / "demo" / "gelan-t" / "ablation-det-3-seed0" / "report.json").read_text())
    assert det3["config"]["qat"]["det_loss"] == 3 and det3["select"]["fingerprint"] == report["select"]["fingerprint"]
    assert a["variants"]["det-3"]["select_last"]["values"][0] == det3["qat"][-1]["ap"]
    measured = [f.parent for f in work.rglob("val_trt.json")]  # each measurement's log is its own, whole name kept
    assert any(m.name.endswith("percentile-99.9") for m in measured)  # a name with a dot, not cut at it
    assert all(f"name={m.name}," in m.with_name(m.name + ".log").read_text() for m in measured)
    assert "final_file" not in json.dumps(e) and "calibration_images" not in json.dumps(e)  # no machine-local paths
    assert sorted(p.name for p in tmp.iterdir()) == ["results", "work"]  # nothing beside --out and --work
    again = call_cli("scripts/benchmark_accuracy.py", *args)
    assert again.returncode == 0
    assert not [line for line in again.stdout.splitlines() if line.startswith("+ ")]  # no step ran again
    other = [str(a) for a in args]
    other[other.index("--calib-batches") + 1] = "2"  # the same folders, other numbers: refused, not reused
    r = call_cli("scripts/benchmark_accuracy.py", *other)
    assert r.returncode == 1 and "holds a run made with other arguments" in r.stderr and str(work) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = call_cli("scripts/benchmark_accuracy.py", "--render", "--check", "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    table = out / "accuracy.md"
    rendered = table.read_text()
    table.write_text(rendered.replace("<!-- results:accuracy -->\n", "<!-- results:accuracy -->\nedited by hand\n"))
    r = call_cli("scripts/benchmark_accuracy.py", "--render", "--check", "--out", out)
    assert r.returncode == 1 and "-edited by hand" in r.stdout
    table.write_text("no block\n")  # a file whose markers went: one line naming it, nothing rewritten
    r = call_cli("scripts/benchmark_accuracy.py", "--render", "--out", out)
    assert r.returncode != 0 and str(table) in r.stderr and table.read_text() == "no block\n"
    table.write_text(rendered)


def test_benchmark_refuses_an_onnxruntime_that_misreads_fp16_graphs_before_any_step(demo_data, tmp_path, monkeypatch):
    """onnxruntime < 1.32 truncates FP16 QuantizeLinear, so the FP16 graphs' rows, the benchmark's last steps, would
    fail after every other step had run (on a GPU machine: all its QAT runs): refused at the start in one line,
    nothing written; without those rows (--skip ort) it goes on."""
    import onnxruntime
    from conftest import TRAINED_T
    from models.deployment.runners import ort_fp16_qdq_problem
    assert ort_fp16_qdq_problem("1.31.1") and ort_fp16_qdq_problem("1.32.0") is None
    assert ort_fp16_qdq_problem("2.0.0") is None
    monkeypatch.setattr(onnxruntime, "__version__", "1.30.0")
    work, out = tmp_path / "work", tmp_path / "out"
    base = ["--dataset", "demo", "--models", f"gelan-t={TRAINED_T}", "--data", demo_data, "--work", work, "--out", out]
    for extra, names in (([], "--skip ort"), (["--add-ort", "--seeds", 0], "--add-ort: onnxruntime 1.30.0")):
        r = call_cli("scripts/benchmark_accuracy.py", *base, *extra)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and "onnxruntime 1.30.0" in lines[-1] and names in lines[-1], r.stderr
    assert not work.exists() and not out.exists()
    parse = sys.modules["cli_benchmark_accuracy"].parse_opt
    assert parse([str(a) for a in (*base, "--skip", "ort")]).skip == ["ort"]


def test_benchmark_peer_calibrates_on_our_images_and_is_added_to_an_entry_later(bench_run):
    """Model Optimizer's PTQ beside ours: calibrated on the very images ours did, its joins counted by our lint; added
    with --add-peer to an entry made without it whose run folders are gone, for some of its seeds (the sample of a
    seed is drawn again from the sampler alone, whichever seeds are asked for): the same rows and lint as the
    benchmark's own run of the peer, compared with ours on the same seeds."""
    tmp, args, e, modelopt = bench_run
    if not modelopt:
        pytest.skip("nvidia-modelopt is not installed (./install_dependencies.sh --modelopt): the peer is optional")
    out, work = tmp / "results", tmp / "work"
    assert set(e["modelopt"]) == {"max"}  # the methods --modelopt named; none named: every one
    from argparse import Namespace
    bench = load_script(CHECKOUT / "scripts" / "benchmark_accuracy.py", "benchmark_accuracy")
    assert bench.peer_methods(Namespace(modelopt=[], add_peer=False)) == bench.MODELOPT_METHODS == ("max", "entropy")
    assert bench.peer_methods(Namespace(modelopt=None, add_peer=True)) == bench.MODELOPT_METHODS
    assert bench.peer_methods(Namespace(modelopt=None, add_peer=False)) == ()
    assert e["modelopt"]["max"]["1"]["calibration_sample"] == e["ptq"][e["ptq_choice"]]["1"]["calibration_sample"]
    assert e["modelopt"]["max"]["0"]["lint"]["unshared_joins"] > 0 == e["ours_lint"]["unshared_joins"]
    assert all(r["val"]["ap"] > 0 for runs in e["modelopt"].values() for r in runs.values())
    bare = {k: v for k, v in e.items() if k not in ("modelopt", "modelopt_choice", "ours_lint")}
    entry, table = out / "demo" / "gelan-t" / "entry.json", out / "accuracy.md"
    kept_table = table.read_text()
    entry.write_text(json.dumps(bare))
    gone = tmp / "gone"
    shutil.move(work / "demo" / "gelan-t", gone)
    try:
        r = run_cli("scripts/benchmark_accuracy.py", *on_seed_one(args), "--modelopt", "max", "--add-peer")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        added = json.loads(entry.read_text())
        assert {m: {s: v["val"] for s, v in runs.items()} for m, runs in added["modelopt"].items()} == \
            {m: {"1": runs["1"]["val"]} for m, runs in e["modelopt"].items()}
        assert added["ours_lint"] == e["ours_lint"], (added["ours_lint"], e["ours_lint"])
        assert added["provenance"]["peer"]["command"].endswith("--add-peer")
        ours = e["qat"]["1"]["val_best"]["ap"]
        assert added["summary"]["qat_vs_modelopt"]["delta"] == \
            round(ours - added["modelopt"][added["modelopt_choice"]]["1"]["val"]["ap"], 5)
        assert "QAT on the same seed (1) - Model Optimizer" in table.read_text()
    finally:
        shutil.rmtree(work / "demo" / "gelan-t", ignore_errors=True)
        shutil.move(gone, work / "demo" / "gelan-t")
        entry.write_text(json.dumps(e))
        table.write_text(kept_table)


def test_benchmark_keeps_auto_ranges_and_rebuilds_the_ptq_graphs_from_them_later(bench_run, demo_data16):
    """Each seed's ranges of the calibration `auto` delivered are kept beside the entry; with the run folders gone,
    --add-ort --seeds 1 rebuilds that PTQ model from the float weights and the ranges alone: in PyTorch the very
    model the run measured (the same weights and ranges, measured with the same threads: the same mAP to the last
    digit), and its FP32 and FP16 graphs, plain and end to end, lint-clean and within ONNX Runtime's tolerance of
    it (three boxes of the rarest class: conftest.one_box; the end-to-end graphs decide NMS ties their own way).
    Ranges that are not the entry's are refused in one line."""
    from conftest import one_box

    from utils.batches import load_data
    tmp, args, e, _ = bench_run
    out, work = tmp / "results", tmp / "work"
    folder = out / "demo" / "gelan-t"
    for seed in ("0", "1"):
        kept, method = e["ranges"][seed], e["qat"][seed]["auto"]["chosen"]
        assert kept["method"] == method and (folder / kept["file"]).is_file()
        assert kept["calibration_sample"] == e["ptq"]["max"][seed]["calibration_sample"]  # one sample per seed
    entry = folder / "entry.json"
    one = on_seed_one(args)
    gone = tmp / "gone-ranges"
    shutil.move(work / "demo" / "gelan-t", gone)
    ranges, table = folder / e["ranges"]["1"]["file"], out / "accuracy.md"
    kept_bytes, kept_table = ranges.read_bytes(), table.read_text()
    try:
        r = run_cli("scripts/benchmark_accuracy.py", *one, "--add-ort")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        row = json.loads(entry.read_text())["ort_ptq"]["1"]
        assert row["pytorch"] == e["qat"]["1"]["auto"]["val"]  # auto's PTQ model as the run measured it
        tolerance = 3 * one_box(load_data(demo_data16))
        for graph in ("fp32", "fp32_e2e", "fp16", "fp16_e2e"):
            assert row[graph]["lint"]["unshared_joins"] == 0 == row[graph]["lint"]["unquantized_convs"], graph
            assert row[graph]["val"]["ap"] == pytest.approx(row["pytorch"]["ap"], abs=tolerance), graph
        assert "PTQ auto rebuilt, FP16 Q/DQ graph with NMS (ONNX) in ONNX Runtime" in table.read_text()
        ranges.write_bytes(b"not ranges")
        r = call_cli("scripts/benchmark_accuracy.py", *one, "--add-ort")
        errors = [line for line in r.stderr.splitlines() if "error" in line]  # the model's load logs come first
        assert r.returncode == 1 and len(errors) == 1 and str(ranges) in errors[0], r.stderr
    finally:
        ranges.write_bytes(kept_bytes)
        table.write_text(kept_table)
        shutil.rmtree(work / "demo" / "gelan-t", ignore_errors=True)
        shutil.move(gone, work / "demo" / "gelan-t")
        entry.write_text(json.dumps(e))


def test_benchmark_add_ranges_recalibrates_a_seed_to_the_same_ranges_and_figures(bench_run):
    """--add-ranges with the run folders gone: seed 1's calibration made again with the method auto chose for it, on
    the images the entry records, gives the ranges the run kept, array by array, and the entry's select and val mAP
    to the last digit (same machine, same threads)."""
    import numpy as np

    from models.quantization.saved_ranges import read_ranges
    tmp, args, e, _ = bench_run
    out, work = tmp / "results", tmp / "work"
    folder = out / "demo" / "gelan-t"
    entry, ranges = folder / "entry.json", folder / e["ranges"]["1"]["file"]
    kept_arrays, kept_meta = read_ranges(ranges)
    kept_bytes = ranges.read_bytes()
    one = on_seed_one(args)
    gone = tmp / "gone-add-ranges"
    shutil.move(work / "demo" / "gelan-t", gone)
    try:
        r = run_cli("scripts/benchmark_accuracy.py", *one, "--add-ranges")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        row = json.loads(entry.read_text())["ranges"]["1"]
        assert row["vs_entry"] == {"select": 0.0, "val": 0.0}, row
        assert row["val"] == e["qat"]["1"]["auto"]["val"]
        arrays, meta = read_ranges(ranges)
        assert meta["calibration_sample"] == kept_meta["calibration_sample"] and meta["method"] == kept_meta["method"]
        assert arrays.keys() == kept_arrays.keys()
        assert all(np.array_equal(arrays[k], kept_arrays[k]) for k in arrays)
    finally:
        ranges.write_bytes(kept_bytes)
        shutil.rmtree(work / "demo" / "gelan-t", ignore_errors=True)
        shutil.move(gone, work / "demo" / "gelan-t")
        entry.write_text(json.dumps(e))


def s_ort_delta(entry: dict) -> float:
    return entry["summary"]["ort_vs_pytorch"]["fp32"]["delta"]


def test_benchmark_folders_are_named_by_what_decides_their_numbers():
    """A resumed step may run on another machine (--device, --workers), never with another recipe: QAT with
    --qat-args gets folders of its own, and its recorded arguments leave out only where it ran."""
    from utils import benchmark_steps as bench
    assert bench.recipe_tag(()) == ""
    assert bench.recipe_tag(("--recipe", "reference", "--lr", "3e-5")) == "-recipe-reference-lr-3e-5"
    args = ["--weights", "w.pt", "--device", "0", "--workers", "8", "--seed", "1", "--lr", "3e-5"]
    assert bench._result_args(args) == ["--weights", "w.pt", "--seed", "1", "--lr", "3e-5"]


def test_benchmark_steps_run_with_the_callers_thread_count_not_upstreams(demo_data):
    """Loading a model imports upstream's utils.general, which sets OMP_NUM_THREADS to min(8, cores - 1) in the
    process's environment; the benchmark's steps still get the count the caller gave (9: a count upstream never
    sets), and without one, with two jobs at a time, each its half of the cores. On the CPU, where the steps' math
    runs on those threads, the count is shared by every step that can run at once: 2 jobs in each of 4 phases."""
    probe = ("import importlib.util, os, sys; "
             "spec = importlib.util.spec_from_file_location('ba', 'scripts/benchmark_accuracy.py'); "
             "m = sys.modules['ba'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
             f"opt = m.parse_opt(['--data', {str(demo_data)!r}, '--jobs', '2']); "
             "os.environ['OMP_NUM_THREADS'] = '9'; given = m.bench_from(opt); "
             "os.environ['OMP_NUM_THREADS'] = '17'; cpu = m.bench_from(m.parse_opt(['--data', "
             f"{str(demo_data)!r}, '--jobs', '2', '--device', 'cpu'])); "
             "del os.environ['OMP_NUM_THREADS']; unset = m.bench_from(opt); import utils.general; "
             "print(os.environ['OMP_NUM_THREADS'], *(b.step_env['OMP_NUM_THREADS'] for b in (given, unset, cpu)))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=CHECKOUT, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr[-2000:]
    upstream, given, unset, cpu = r.stdout.split()
    assert upstream == str(min(8, max(1, os.cpu_count() - 1)))  # what every step would otherwise inherit
    assert given == "9" and unset == str(max(1, os.cpu_count() // 2)) and cpu == str(17 // (2 * 4))


def _published_runs(tmp_path, folder: str):
    """A copy of helmet gelan-s's entry with its published `folder` of runs under tmp_path (the tables read an --out
    folder; the folder's own entry.json, the entry made on the runs' machine, is copied as a file), and a function
    rendering that experiment's table (utils/benchmark_experiments.py: the experiment is declared, not coded)."""
    import shutil
    from utils import benchmark_experiments
    src, dst = REPO / "results" / "helmet" / "gelan-s", tmp_path / "helmet" / "gelan-s"
    shutil.copytree(src / folder, dst / folder)
    shutil.copy(src / "entry.json", dst / "entry.json")
    return benchmark_experiments, dst, lambda: benchmark_experiments.experiment_table(
        tmp_path, benchmark_experiments.EXPERIMENTS[folder])


def test_partial_controls_sit_only_beside_runs_of_the_same_settings(tmp_path):
    """The partial-control table sets qat.py reports beside their entry's QAT and float control, each part's best
    and last epoch over its seeds; a report made with other settings than the entry's is refused, not compared."""
    tables, dst, table_of = _published_runs(tmp_path, "partial-control")
    entry = tables.entry_beside(dst / "partial-control")
    reports = [json.loads(f.read_text()) for f in sorted((dst / "partial-control").glob("*-seed*.json"))]
    table = table_of()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    qat_best = sum(max(r["select_by_epoch"]) for r in entry["qat"].values()) / len(entry["qat"])
    part_last = sum(r["qat"][-1]["ap"] for r in reports) / len(reports)
    assert f"{qat_best:.4f} ± " in rows["weights and activations (QAT, the default command)"]
    assert f"{part_last:.4f} ± " in rows["activations only (weights float)"]
    assert rows["nothing (the float control)"]
    changed = dst / "partial-control" / "weights-seed1.json"
    report = json.loads(changed.read_text())
    report["config"]["iters"] = 2 * report["config"]["iters"]
    changed.write_text(json.dumps(report))
    with pytest.raises(ValueError, match="other settings"):
        table_of()


def test_float_first_runs_sit_beside_the_default_runs_of_the_same_settings(tmp_path):
    """The float-first table: per number of float epochs, the float model, PTQ of it and the delivered model over
    the seeds, the entry's default runs as 0; an unfinished report or one with other settings is refused."""
    _, dst, table_of = _published_runs(tmp_path, "float-first")
    reports = [json.loads(f.read_text()) for f in sorted((dst / "float-first").glob("float-2-*.json"))]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in table_of().splitlines() if line.startswith("| ")}
    ptq = sum(r["recalibrated"]["metrics"]["ap"] for r in reports) / len(reports)
    float_model = sum(r["qat"][1]["ap"] for r in reports) / len(reports)
    assert rows["2"][1].startswith(f"{float_model:.4f} ± ") and rows["2"][2].startswith(f"{ptq:.4f} ± ")
    assert rows["2"][3].startswith(f"{ptq - float_model:+.4f}")
    assert list(rows)[1:] == ["0 (the default command)", "2", "4"]
    changed = dst / "float-first" / "float-4-seed1.json"
    report = json.loads(changed.read_text())
    for edit in ({"finished": False}, {"config": {**report["config"], "imgsz": 640}}):
        changed.write_text(json.dumps({**report, **edit}))
        with pytest.raises(ValueError, match="not comparable"):
            table_of()


def test_longer_runs_sit_beside_the_entry_by_epochs(tmp_path):
    """The longer-runs table: one row per number of epochs, QAT and its float control each over their seeds (the
    entry's own runs as its row); a run with other settings than the entry's, epochs aside, is refused."""
    _, dst, table_of = _published_runs(tmp_path, "longer")
    reports = [json.loads(f.read_text()) for f in sorted((dst / "longer").glob("*-seed*.json"))]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in table_of().splitlines() if line.startswith("| ")}
    epochs = {r["config"]["epochs"] for r in reports}
    assert len(epochs) == 1 and list(rows)[1:] == ["5 (the entry)", str(*epochs)]
    qat_val = [r["val"]["final"]["ap"] for r in reports if not r["config"]["control"]]
    control_val = [r["val"]["final"]["ap"] for r in reports if r["config"]["control"]]
    row = rows[str(*epochs)]
    assert row[4].startswith(f"{sum(qat_val) / len(qat_val):.4f} ± ") and len(qat_val) == len(control_val) == 3
    assert row[6].startswith(f"{sum(qat_val) / 3 - sum(control_val) / 3:+.4f}")
    changed = sorted((dst / "longer").glob("*-seed*.json"))[0]
    report = json.loads(changed.read_text())
    changed.write_text(json.dumps({**report, "config": {**report["config"], "batch_size": 16}}))
    with pytest.raises(ValueError, match="not comparable"):
        table_of()


def test_published_results_are_what_their_json_renders_to():
    """README.md, docs/RESULTS.md and results/accuracy.md hold the tables the results JSON renders to: nothing
    edited by hand (CI runs this check). Run as docs/RESULTS.md gives it, from this repository's root without the
    test session's PYTHONPATH (the patched checkout): rendering must not import upstream's modules."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "scripts/benchmark_accuracy.py", "--render", "--check", "--docs"], cwd=REPO,
                       text=True, capture_output=True, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_float_training_records_a_cut_off_session_and_collects_a_finished_one(demo_data, tmp_path, monkeypatch):
    """scripts/train_float.py across leases: a session cut off by a time limit is recorded (its time counts), and a
    run whose every epoch ran, cut off before train.json, is collected instead of resumed (upstream's --resume of a
    finished schedule fails); train.json names the model from --cfg (a resumed run's opt.yaml has no cfg)."""
    tf = load_script(REPO / "scripts" / "train_float.py", "train_float")
    run_dir = tmp_path / "train" / "n"
    run_dir.mkdir(parents=True)
    (run_dir / "opt.yaml").write_text(yaml.safe_dump({"cfg": "", "data": str(demo_data), "patience": 30, "epochs": 3}))
    header = ["epoch", tf.MAP, tf.MAP50]
    rows = lambda n: "\n".join([",".join(f"{h:>20}" for h in header)] +  # noqa: E731
                                [f"{i},{0.3 + 0.01 * i},{0.5 + 0.01 * i}" for i in range(n)]) + "\n"
    (run_dir / "results.csv").write_text(rows(2))
    opt = tf.parse_opt(["--data", str(demo_data), "--cfg", "models/detect/gelan-t.yaml", "--name", "n", "--out",
                        str(tmp_path / "out"), "--epochs", "3", "--project", str(tmp_path / "train"), "--split-dir",
                        str(tmp_path / "split")])

    started, run = [], subprocess.run

    def cut_off(cmd, *args, **kwargs):  # upstream's train.py stopped by a lease's time limit (git runs as it is)
        if "train.py" not in cmd:
            return run(cmd, *args, **kwargs)
        started.append(cmd)
        raise KeyboardInterrupt
    monkeypatch.setattr(tf.subprocess, "run", cut_off)
    with pytest.raises(KeyboardInterrupt):
        tf.train(opt)
    sessions = json.loads((run_dir / tf.PROVENANCE).read_text())["sessions"]
    assert [s["exit"] for s in sessions] == ["interrupted"] and sessions[0]["seconds"] >= 0
    (run_dir / "results.csv").write_text(rows(3))  # the last epoch ran, then the session ended
    entry = tf.train(opt)
    assert len(started) == 1 and started[0][-1] != "--resume"  # nothing started again
    assert entry["epochs_run"] == 3 and entry["model"] == "gelan-t" and entry["finished"]
    assert json.loads((tmp_path / "out" / "train.json").read_text())["started"]["sessions"] == sessions


def test_float_training_collects_and_reparameterizes_a_yolov9_run(demo_data, tmp_path, monkeypatch):
    """train_float.py --reparameterize on a finished train_dual.py run (a real yolov9-t training checkpoint with its
    auxiliary branch as best.pt): the FP16 EMA weights kept, converted by reparameterization.py to the GELAN
    inference model, and both files load through the safe loader as float models (the converted one without the
    auxiliary head); train.json records the converted file's sha256."""
    from conftest import build_model, save_float_checkpoint
    from models.quantization.checkpoint import load_float_model, read_checkpoint
    from utils.provenance import sha256
    tf = load_script(REPO / "scripts" / "train_float.py", "train_float")
    run_dir = tmp_path / "run"
    (run_dir / "weights").mkdir(parents=True)
    save_float_checkpoint(build_model("yolov9-t"), run_dir / "weights" / "best.pt")
    (run_dir / "opt.yaml").write_text(yaml.safe_dump({"cfg": "models/detect/yolov9-t.yaml", "data": str(demo_data),
                                                      "patience": 30, "epochs": 2}))
    header = ",".join(f"{h:>20}" for h in ["epoch", tf.MAP, tf.MAP50])
    (run_dir / "results.csv").write_text(f"{header}\n0,0.1,0.2\n1,0.2,0.3\n")
    (run_dir / tf.PROVENANCE).write_text(json.dumps({"commit": "x", "sessions": [{"seconds": 1.0, "exit": 0}]}))
    monkeypatch.chdir(CHECKOUT)  # reparameterization.py runs from the checkout, as train_float.py does
    entry = tf.collect(run_dir, tmp_path / "out", "yolov9-t", tmp_path / "w" / "yolov9-t.pt", reparameterize_as="t")
    converted = tmp_path / "w" / "yolov9-t-converted.pt"
    assert entry["converted"]["weights_sha256"] == sha256(converted) and entry["weights_sha256"] == sha256(
        tmp_path / "w" / "yolov9-t.pt")
    assert type(read_checkpoint(tmp_path / "w" / "yolov9-t.pt")["model"].model[-1]).__name__.startswith("Dual")
    gelan = load_float_model(converted)  # the safe loader, and no auxiliary branch left
    assert not type(gelan.model[-1]).__name__.startswith(("Dual", "Triple"))
    assert json.loads((tmp_path / "out" / "train.json").read_text())["converted"] == entry["converted"]


def test_float_training_converges_on_a_plateau_not_on_a_climb():
    """scripts/train_float.py's convergence rule on select curves: a curve still climbing at its end is not
    converged although its best is its last epoch; one that ends flat within its own evaluation noise is, even
    where upstream's patience never stopped it; a curve too short for a window is not judged converged."""
    tf = load_script(REPO / "scripts" / "train_float.py", "train_float")
    import numpy as np
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.002, 60)
    climbing = list(0.3 + 0.004 * np.arange(60) + noise)     # +0.024 over the last 10 %: 12x the noise
    flat = list(0.5 - 0.2 * np.exp(-np.arange(60) / 8) + noise)
    assert not tf.plateau(climbing)["plateau"] and tf.plateau(flat)["plateau"]
    assert tf.plateau(flat)["window"] == 6 and 0.001 < tf.plateau(flat)["noise"] < 0.004
    assert not tf.plateau(flat[:4])["plateau"]
    curve = [{"epoch": i, tf.MAP: v, tf.MAP50: v} for i, v in enumerate(flat)]
    c = tf.convergence(curve, patience=100)
    assert c["converged"] and c["epochs_since_best"] < 100 and c["best_select_map"] == max(flat)
    opt = tf.parse_opt(["--data", "d.yaml", "--cfg", "c.yaml", "--name", "n", "--out", "o", "--nproc-per-node", "2",
                        "--device", "0"])
    with pytest.raises(ValueError, match="--nproc-per-node 2 needs as many GPUs in --device"):
        tf.launcher(opt)
    opt = tf.parse_opt(["--data", "d.yaml", "--cfg", "c.yaml", "--name", "n", "--out", "o", "--nproc-per-node", "2",
                        "--device", "0,1", "--master-port", "29600"])
    assert tf.launcher(opt)[1:] == ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29600"]


def test_loader_profile_splits_an_images_time_into_upstreams_phases(demo_data, tmp_path):
    """scripts/profile_loader.py on 8 demo images (mosaic, mixup, affine warp, HSV as hyp.scratch-high draws them):
    each phase is found in the profile (resize is OpenCV's C function, the others upstream's), the
    phases add up to the profiled total, and the cores and RAM follow from the measured ms and bytes per image."""
    out = tmp_path / "profile.json"
    r = run_cli("scripts/profile_loader.py", "--data", demo_data, "--imgsz", 128, "--images", 8, "--batch-size", 4,
                "--step-images-per-s", 400, "--out", out)  # 128 px: the 160 px images are resized
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(out.read_text())
    p = result["profile"]
    phases = p["phases_ms_per_image"]
    for phase in ("decode (imread)", "resize to --imgsz (cv2.resize)", "affine warp (random_perspective)",
                  "colour (augment_hsv)", "mosaic: tiles placed on one canvas", "collate"):
        assert phases[phase] > 0, (phase, phases)
    assert sum(phases.values()) == pytest.approx(p["profiled_ms_per_image"], abs=0.01 * len(phases))
    assert result["cores_for_loader"]["400"] == round(400 * p["ms_per_image"] / 1000, 1)
    assert result["cache_ram_gb"] == round(p["decoded_bytes_per_image"] * result["train_images"] / 1e9, 2)
    assert p["decoded_bytes_per_image"] <= 128 * 128 * 3  # resized to --imgsz on its long side
    assert "| decode (imread) |" in r.stdout


def test_throughput_benchmark_times_each_step_and_notes_full_collections_and_profiles():
    """What benchmark_throughput.py records beside images/s to tell a few stalls from slow steps: the time each
    batch was asked for (a step's host time between two), only the full (generation-2) collections inside its block
    and none after it, and a profile summary with the wall time per step and the share of it the GPU was busy."""
    import gc

    import torch
    bt = load_script(CHECKOUT / "scripts" / "benchmark_throughput.py", "benchmark_throughput")
    stamps: list[float] = []
    assert list(bt.stamped(iter("abc"), stamps)) == ["a", "b", "c"]
    assert len(stamps) == 3 and stamps == sorted(stamps)
    with bt.full_collections() as seconds:
        gc.collect(1)  # a young generation's collection is no full one
        gc.collect()
    gc.collect()  # after the block: not noted
    assert len(seconds) == 1 and seconds[0] >= 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.ones(64, 64) @ torch.ones(64, 64)
    summary = bt.profile_summary(prof, 3)
    assert summary.startswith("3 steps: ") and "ms/step, GPU busy 0%" in summary.splitlines()[0]
    assert "aten::mm" in summary


def test_throughput_benchmark_times_the_loader_past_what_its_workers_load_ahead(demo_data):
    """The batches the loader's workers have ready before they are asked for (all of them after a first step's
    compile) are no measure of the loader: the loader alone is timed from when each worker has delivered its first
    batch, over whole rounds of its workers (a round arrives together), and the QAT steps are timed only after the
    warm-up has taken every batch loaded ahead. Asserted on upstream's real loader with 2 workers."""
    import torch
    from models.core.task import DETECT
    from utils.batches import load_data, load_hyp, seeded_rank_loader
    bt = load_script(CHECKOUT / "scripts" / "benchmark_throughput.py", "benchmark_throughput")
    data, hyp = load_data(demo_data), load_hyp(CHECKOUT / "data" / "hyps" / "hyp.scratch-high.yaml")
    made, _ = DETECT.dataloader(data["train"], IMGSZ, 2, 32, augment=False, hyp=hyp, workers=2, shuffle=True)
    loader = seeded_rank_loader(made, 1, 0)
    assert loader.prefetch_factor == 2  # torch's default: each worker loads 2 batches ahead
    assert bt.warmup_steps(1, loader) == 5 and bt.warmup_steps(10, loader) == 10
    images_per_s, timed = bt.loader_images_per_s(loader, torch.device("cpu"), 3, 2)
    assert timed == 4 and images_per_s > 0  # 3 batches asked: two whole rounds of 2 workers
