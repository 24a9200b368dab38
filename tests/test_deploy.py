"""Strongly typed deployment (TensorRT 11, and 10.x --stronglyTyped): FP16 Q/DQ graphs, their typing lint, the
trtexec flags picked per TensorRT version, and the engine-graph check (no trex)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import IMGSZ, REPO, SHARED, TRAINED_T, call_cli, run_cli

from utils.engine_graph import analyse, load_layers, load_profile, to_dot
from utils.qdq_lint import lint_file
from utils.trtexec import graph_kind, parse_version, precision_flags

FIXTURES = (SHARED or REPO) / "reference" / "trt-engine-graphs"


@pytest.fixture(scope="module")
def quantized_weights(demo_data, tmp_path_factory):
    """The trained demo gelan-t after PTQ (a real calibrated Q/DQ model)."""
    d = tmp_path_factory.mktemp("dep")
    r = run_cli("qat.py", "quantize", "--weights", TRAINED_T, "--data", demo_data, "--imgsz", IMGSZ, "--batch-size", 4,
                "--device", "cpu", "--workers", 0, "--epochs", 0, "--calib-batches", 2, "--calib-method", "mse",
                "--no-eval-origin", "--no-eval-ptq", "--project", d, "--name", "p")
    assert r.returncode == 0, r.stderr[-2000:]
    return next((d / "p" / "weights").glob("ptq_*.pt"))


def _export(weights, tmp_path, *args):
    out = tmp_path / "e.json"
    r = run_cli("export_qat.py", "--weights", weights, "--imgsz", IMGSZ, "--dynamic", "--exist-ok", "--json", out,
                *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def exported(quantized_weights, tmp_path_factory):
    """export_qat's JSON for a set of flags, each set exported once per module (~9 s an export) from its own copy
    of the weights, so that no graph overwrites another. Tests read these graphs and never change them."""
    made: dict[tuple[str, ...], dict] = {}

    def get(*args) -> dict:
        key = tuple(map(str, args))
        if key not in made:
            d = tmp_path_factory.mktemp("export")
            weights = d / quantized_weights.name
            shutil.copy(quantized_weights, weights)
            made[key] = _export(weights, d, *key)
        return made[key]
    return get


@pytest.fixture(scope="module")
def static_onnx(quantized_weights, tmp_path_factory) -> Path:
    """The calibrated model exported with a static batch of 2."""
    static = tmp_path_factory.mktemp("static") / "static.pt"
    shutil.copy(quantized_weights, static)
    assert run_cli("export_qat.py", "--weights", static, "--imgsz", IMGSZ, "--batch-size", 2).returncode == 0
    return static.with_suffix(".onnx")


def test_fp16_graph_is_all_fp16_and_matches_the_fp32_graph(quantized_weights, exported, demo_data320, tmp_path):
    """Default export: FP16 everywhere that is not INT8, FP32 input/output; ONNX Runtime (>= 1.32, whose FP16
    QuantizeLinear rounds as the spec says) runs it. Against the FP32 graph the difference is FP16 rounding of
    activations, which flips a few INT8 roundings: outputs agree to a few percent and detections match."""
    # verified where the trained model detects well (its 320 px data): real boxes to match
    fp16 = _export(quantized_weights, tmp_path, "--verify", "--data", demo_data320, "--imgsz", 320, "--batch-size", 4,
                   "--verify-batches", 8)
    assert fp16["dtype"] == "fp16" and fp16["opset"] >= 19
    lint = fp16["lint"]
    assert lint["dtype"] == "fp16" and lint["scale_dtypes"] == ["float16"] and lint["fp32_compute"] == []
    assert lint["typing_error"] == "" and lint["problems"] == 0 and lint["unshared_joins"] == []
    model = onnx.load(fp16["onnx"])
    assert [i.type.tensor_type.elem_type for i in model.graph.input] == [onnx.TensorProto.FLOAT]
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [onnx.TensorProto.FLOAT]
    assert graph_kind(fp16["onnx"]) == ("fp16", True)
    casts = [n.name for n in model.graph.node if n.op_type == "Cast"]  # only at the FP32 input and output
    assert sorted(casts) == ["images_to_fp16", "output0_to_fp32"]
    parity = fp16["parity"]
    assert parity["rel_err"]["output0"] < 0.1 and parity["detections_counted"] > 10, parity
    assert parity["detections_matched"] >= 0.9, parity  # FP16 activations too: more flips than the FP32 graph's
    fp32 = exported("--dtype", "fp32")
    assert fp32["lint"]["dtype"] == "fp32" and fp32["lint"]["scale_dtypes"] == ["float32"]
    assert graph_kind(fp32["onnx"]) == ("fp32", True) and fp32["qdq_pairs"] == fp16["qdq_pairs"]


def test_fp16_io_and_end_to_end_with_nms(quantized_weights, tmp_path):
    res = _export(quantized_weights, tmp_path, "--io-dtype", "fp16", "--include", "onnx_end2end", "--nms", "efficient")
    graph = onnx.load(res["onnx"]).graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.output)}
    assert types == {"images": onnx.TensorProto.FLOAT16, "num_dets": onnx.TensorProto.INT32,
                     "det_boxes": onnx.TensorProto.FLOAT16, "det_scores": onnx.TensorProto.FLOAT16,
                     "det_classes": onnx.TensorProto.INT32}
    assert lint_file(res["onnx"]).typing_error == ""  # the plugin is passed over, the rest type-checks
    # standard NMS: post-processing in FP32 (ONNX Runtime's NonMaxSuppression takes FP32), exempt from the lint
    res = _export(quantized_weights, tmp_path, "--io-dtype", "fp16", "--include", "onnx_end2end")
    graph = onnx.load(res["onnx"]).graph
    assert [o.type.tensor_type.elem_type for o in graph.output][1:3] == [onnx.TensorProto.FLOAT] * 2
    report = lint_file(res["onnx"])
    assert report.typing_error == "" and report.fp32_compute == [] and report.problems == 0
    r = run_cli("export_qat.py", "--weights", quantized_weights, "--imgsz", IMGSZ, "--dtype", "fp32",
                "--io-dtype", "fp16", "--exist-ok")
    assert r.returncode == 2 and "--io-dtype fp16 needs --dtype fp16" in r.stderr


def test_lint_counts_fp32_compute_in_an_fp16_graph(exported, tmp_path):
    res = exported("--dtype", "fp16")
    model = onnx.load(res["onnx"])
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")  # the DFL softmax, forced back to FP32
    i = list(model.graph.node).index(softmax)
    cast_in = onnx.helper.make_node("Cast", [softmax.input[0]], ["sm_in32"], to=onnx.TensorProto.FLOAT)
    cast_out = onnx.helper.make_node("Cast", ["sm_out32"], [softmax.output[0]], to=onnx.TensorProto.FLOAT16)
    softmax.input[0], softmax.output[0] = "sm_in32", "sm_out32"
    model.graph.node.insert(i + 1, cast_out)
    model.graph.node.insert(i, cast_in)
    del model.graph.value_info[:]
    onnx.save(model, tmp_path / "mixed.onnx")
    report = lint_file(tmp_path / "mixed.onnx")
    assert {c["op"] for c in report.fp32_compute} == {"Softmax", "Cast"} and report.problems >= 2
    r = call_cli("utils/qdq_lint.py", tmp_path / "mixed.onnx", "--strict")
    assert r.returncode == 1 and "FP32 Softmax" in r.stdout


@pytest.mark.parametrize("banner,version", [
    ("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] [b17] # trtexec --help", (10, 3, 0)),   # JetPack 6
    ("&&&& RUNNING TensorRT.trtexec [TensorRT v101303] [b9] # trtexec --help", (10, 13, 3)),
    # TensorRT 11's banner written from the 10.x format (same encoding); no 11 log is available here
    ("&&&& RUNNING TensorRT.trtexec [TensorRT v110000] [b1] # trtexec --help", (11, 0, 0)),
    ("&&&& RUNNING TensorRT.trtexec [TensorRT v8601] # trtexec", (8, 6, 1))])
def test_version_from_trtexec_banner(banner, version):
    assert parse_version(banner) == version


def test_precision_flags_per_version():
    # TensorRT 11 (migration guide: no --fp16/--int8/--best/--calib, strongly typed always)
    assert precision_flags((11, 0, 0), "fp16", quantized=True) == []
    with pytest.raises(ValueError, match="--dtype fp16"):
        precision_flags((11, 0, 0), "fp32", quantized=True)
    assert precision_flags((11, 0, 0), "fp32", quantized=True, allow_fp32=True) == []
    # TensorRT 10.x: strongly typed by request, or weakly typed with the precision flags
    assert precision_flags((10, 3, 0), "fp16", quantized=True) == ["--stronglyTyped"]
    assert precision_flags((10, 3, 0), "fp32", quantized=True) == ["--int8", "--fp16"]
    assert precision_flags((10, 3, 0), "fp32", quantized=False) == ["--fp16"]  # no INT8 on placeholder ranges
    with pytest.raises(ValueError, match="TensorRT >= 10"):
        precision_flags((8, 6, 1), "fp16", quantized=True)


def _fake_trtexec(tmp_path, version_code):
    """A stand-in trtexec that prints TensorRT's banner and records its arguments (TensorRT cannot run here)."""
    bin_dir = tmp_path / f"bin{version_code}"
    bin_dir.mkdir()
    exe = bin_dir / "trtexec"
    exe.write_text(f"""#!/usr/bin/env bash
echo "&&&& RUNNING TensorRT.trtexec [TensorRT v{version_code}] [b1] # trtexec $*"
[ "$1" = --help ] && exit 0
echo "$*" > "{bin_dir}/args"
for a in "$@"; do case "$a" in --saveEngine=*) echo engine > "${{a#--saveEngine=}}" ;; esac; done
""")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.mark.parametrize("version_code,dtype,expected", [
    ("110000", "fp16", ""), ("100300", "fp16", "--stronglyTyped"), ("100300", "fp32", "--int8 --fp16")])
def test_engine_script_builds_each_graph_with_the_flags_of_the_found_version(exported, tmp_path, version_code, dtype,
                                                                            expected):
    res = exported("--dtype", dtype)
    bin_dir = _fake_trtexec(tmp_path, version_code)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run(["bash", str(REPO / "scripts/generate_trt_engine.sh"), res["onnx"], str(IMGSZ), "--min", "1",
                        "--opt", "4", "--max", "8"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    args = (bin_dir / "args").read_text().split()
    flags = [a for a in args if a in ("--int8", "--fp16", "--best", "--stronglyTyped")]
    assert " ".join(flags) == expected
    assert f"--onnx={res['onnx']}" in args and f"--maxShapes=images:8x3x{IMGSZ}x{IMGSZ}" in args
    print(f"TensorRT v{version_code}, {dtype} graph: trtexec {' '.join(args)}")


@pytest.mark.parametrize("version_code", ["110000", "100300"])
def test_engine_script_static_graph_relative_path_and_profile_flags(exported, static_onnx, tmp_path, version_code):
    """A static graph gets no shapes (trtexec: "Static model does not take explicit shapes"), a relative path works
    from another folder (the engine-graph report too), and 11.x gets no flag it no longer honours."""
    res = exported("--dtype", "fp16")  # dynamic
    shutil.copy(static_onnx, tmp_path / "static.onnx")
    bin_dir = _fake_trtexec(tmp_path, version_code)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run(["bash", str(REPO / "scripts/generate_trt_engine.sh"), "../static.onnx", str(IMGSZ)],
                       capture_output=True, text=True, env=env, cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    args = (bin_dir / "args").read_text().split()
    assert f"--onnx={tmp_path / 'static.onnx'}" in args and not [a for a in args if "Shapes=" in a]
    assert (tmp_path / "static.engine").is_file()
    r = subprocess.run(["bash", str(REPO / "scripts/generate_trt_engine.sh"), "../static.onnx", str(IMGSZ), "--batch",
                        "4"], capture_output=True, text=True, env=env, cwd=elsewhere)
    assert r.returncode == 2 and "static batch of 2" in r.stderr
    from utils.trtexec import benchmark_command, build_command, read_graph
    graph = read_graph(res["onnx"])
    build = build_command("trtexec", (int(version_code[:2]), int(version_code[2:4]), 0), graph, None, profile=True)
    bench = benchmark_command("trtexec", (int(version_code[:2]), int(version_code[2:4]), 0), graph, 8, "e.engine")
    retired = {"--separateProfileRun", "--useCudaGraph", "--useSpinWait", "--noDataTransfers"}
    if version_code.startswith("11"):
        assert not retired & set(build + bench)
    else:
        assert "--separateProfileRun" in build and {"--useCudaGraph", "--noDataTransfers"} <= set(bench)
    assert f"--maxShapes=images:8x3x{IMGSZ}x{IMGSZ}" in bench and "--exportLayerInfo=" in " ".join(build)
    print(f"TensorRT v{version_code}: static build: trtexec {' '.join(args)}")


def test_engine_script_refuses_an_fp32_graph_on_tensorrt_11(exported, tmp_path):
    res = exported("--dtype", "fp32")
    bin_dir = _fake_trtexec(tmp_path, "110000")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run(["bash", str(REPO / "scripts/generate_trt_engine.sh"), res["onnx"], str(IMGSZ)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "--dtype fp16" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (bin_dir / "args").exists()  # trtexec never ran


@pytest.mark.parametrize("prefix,layers,reformats,inside,problems,int8_share", [
    ("mobilenet.qat.onnx.engine", 73, 18, 17, 15, 0.8149),             # residual Add inputs not quantized
    ("mobilenet_v2_residuals.qat.onnx.engine", 58, 3, 2, 0, 0.9506)])  # quantized residual inputs
def test_engine_graph_on_real_tensorrt_engines(prefix, layers, reformats, inside, problems, int8_share, tmp_path):
    """Two engines TensorRT built from MobileNetV2 Q/DQ graphs: without quantized residual inputs every block's INT8
    result goes through FP16 only to be quantized again (15 requantizations: --strict fails); with them INT8 tensors
    flow from layer to layer, and the two reformats left (a layout copy before the FP16 pooling and the quantize of
    its output for the classifier) are what the guidance allows (--strict passes). Layers count by the precision
    they read: an INT8 convolution that writes FP16 is INT8."""
    if not (FIXTURES / f"{prefix}.graph.json").is_file():
        pytest.skip(f"the shared engine-graph fixtures were not found (set YOLOV9_QAT_SHARED); looked in {FIXTURES}")
    graph, profile = FIXTURES / f"{prefix}.graph.json", FIXTURES / f"{prefix}.profile.json"
    report = analyse(*load_layers(graph), load_profile(profile))
    assert report.layers == layers and len(report.reformats) == reformats and report.internal_reformats == inside
    assert len(report.violations) == problems
    assert report.reformats[0]["where"] == "network input" and report.reformats[0]["kind"] == "quantize"
    assert report.by_precision["INT8"] == 53
    assert report.time_share_by_precision["INT8"] == pytest.approx(int8_share, abs=1e-4)
    assert sum(report.time_share_by_precision.values()) == pytest.approx(1.0, abs=1e-3)
    r = call_cli("utils/engine_graph.py", graph, "--profile", profile, "--strict", "--svg", tmp_path / "g.svg")
    assert r.returncode == (1 if problems else 0) and f"Reformat layers: {reformats} ({inside} inside" in r.stdout
    drawn = tmp_path / ("g.svg" if (tmp_path / "g.svg").exists() else "g.dot")
    assert drawn.stat().st_size > 1000
    print(report.summary())


def test_engine_graph_baseline_finds_the_reformats_another_engine_has_not():
    if not (FIXTURES / "mobilenet.qat.onnx.engine.graph.json").is_file():
        pytest.skip(f"the shared engine-graph fixtures were not found (set YOLOV9_QAT_SHARED); looked in {FIXTURES}")
    worse, better = (FIXTURES / f"{p}.qat.onnx.engine.graph.json" for p in ("mobilenet", "mobilenet_v2_residuals"))
    run = lambda a, b: call_cli("utils/engine_graph.py", a, "--baseline", b)  # noqa: E731
    r = run(worse, better)
    assert r.returncode == 1 and "12 more requantize FP16->INT8 (inside)" in r.stdout
    assert run(better, worse).returncode == 0


def test_engine_graph_reads_tensorrt_11_layer_json(tmp_path):
    """TensorRT 11's inspector JSON (written from its migration guide): 'I/O Tensors' objects instead of
    'Bindings', and 'Format'/'DataType' instead of 'Format/Datatype'."""
    def t(name, fmt, dtype):
        return {"Name": name, "Location": "Device", "Dimensions": [1, 8, 4, 4], "Format": fmt, "DataType": dtype}
    layers = {"I/O Tensors": [{"Name": "images", "IOMode": "Input", "DataType": "Float"},
                              {"Name": "out", "IOMode": "Output", "DataType": "Half"}],
              "Layers": [
                  {"Name": "q_in", "LayerType": "Reformat", "Origin": "QDQ",
                   "Inputs": [t("images", "kLINEAR", "Float")],
                   "Outputs": [t("a", "kCHW32", "Int8")]},
                  {"Name": "conv1", "LayerType": "CaskConvolution", "Inputs": [t("a", "kCHW32", "Int8")],
                   "Outputs": [t("b", "kCHW32", "Int8")]},
                  {"Name": "requant", "LayerType": "Reformat", "Origin": "QDQ", "Inputs": [t("b", "kCHW32", "Int8")],
                   "Outputs": [t("c", "kCHW4", "Int8")]},
                  {"Name": "conv2", "LayerType": "CaskConvolution", "Inputs": [t("c", "kCHW4", "Int8")],
                   "Outputs": [t("out", "kLINEAR", "Half")]}]}
    path = tmp_path / "m.layer.json"
    path.write_text(json.dumps(layers))
    report = analyse(*load_layers(path))
    assert report.by_precision == {"FP32": 1, "INT8": 3}  # by what they read: q_in reads the FP32 input
    assert [(r["name"], r["where"], r["kind"]) for r in report.reformats] == [("q_in", "network input", "quantize"),
                                                                              ("requant", "inside", "requantize")]
    assert [v["name"] for v in report.violations] == ["requant"]
    dot = to_dot(*load_layers(path))
    assert dot.count("->") == 5 and "Reformat (INT8)" in dot
    (tmp_path / "bad.json").write_text(json.dumps({"Layers": ["conv1", "conv2"]}))  # not --profilingVerbosity=detailed
    r = call_cli("utils/engine_graph.py", tmp_path / "bad.json")
    assert r.returncode == 2 and "profilingVerbosity=detailed" in r.stderr


def test_fp16_graph_values_follow_fp16_rounding(exported, tmp_path):
    """The FP16 graph's first quantized tensor equals quantizing the FP16-rounded image: the converter changed
    types, not arithmetic (and ONNX Runtime rounds FP16 QuantizeLinear to nearest even)."""
    res = exported("--dtype", "fp16")
    model = onnx.load(res["onnx"])
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
    model.graph.output.append(onnx.helper.make_tensor_value_info(q.output[0], onnx.TensorProto.INT8, None))
    scale = next(onnx.numpy_helper.to_array(a.t) for n in model.graph.node if n.output[0] == q.input[1]
                 for a in n.attribute if a.name == "value")
    from models.deployment.runners import ort_session
    onnx.save(model, tmp_path / "q.onnx")
    x = np.random.default_rng(0).random((1, 3, IMGSZ, IMGSZ), dtype=np.float32)
    got = ort_session(tmp_path / "q.onnx").run([q.output[0]], {"images": x})[0]
    want = np.clip(np.rint(x.astype(np.float16).astype(np.float32) / np.float32(scale)), -128, 127)
    assert scale.dtype == np.float16 and np.array_equal(got, want.astype(np.int8))
