"""Q/DQ ONNX export on real upstream models: structure, TensorRT lint, ONNX Runtime parity, DeepStream, end2end."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import IMGSZ, build_model, call_cli, run_cli, save_float_checkpoint, tiny_gelan

from models.deployment.export import verify_parity
from models.quantization.checkpoint import load_for_export, save_checkpoint
from models.quantization.quantize import QuantRecipe, calibrate, quantize_model
from utils.onnx_utils import constant_values
from utils.qdq_lint import lint, lint_file


def _calib_images(demo_data, n=2):
    import export_qat
    return export_qat.verification_images(str(demo_data), IMGSZ, 2, n)


@pytest.fixture(scope="module")
def quantized_weights(demo_data, tmp_path_factory):
    """The tiny GELAN, quantized and calibrated: every block type the exporter meets (gelan-t's ELAN1 and AConv,
    gelan-c's ADown, ...) at a few channels; upstream's GELANs only repeat them wider and deeper."""
    model = build_model(tiny_gelan(12))
    model.fuse()
    quantize_model(model)
    calibrate(model, QuantRecipe(calib_method="percentile", percentile=99.99), _calib_images(demo_data))
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny") / "tiny-gelan-ptq.pt")


def _export(weights, include="onnx", **kw):
    """export_qat.run as the CLI calls it; the FP32 graph (TensorRT 10 weak typing) unless `dtype` is given:
    these tests check its exact arithmetic, tests/test_deploy.py the FP16 graph."""
    import export_qat
    opt = export_qat.parse_opt(["--weights", str(weights), "--include", include, "--imgsz", str(IMGSZ), "--exist-ok",
                                "--dtype", kw.pop("dtype", "fp32")])
    for k, v in kw.items():
        setattr(opt, k, v)
    return export_qat.run(**vars(opt))


def test_static_and_dynamic_qdq_export(quantized_weights):
    weights = quantized_weights
    static = _export(weights, batch_size=2)
    proto = onnx.load(static["onnx"])
    onnx.checker.check_model(proto)
    nodes = proto.graph.node
    ops = [n.op_type for n in nodes]
    assert ops.count("QuantizeLinear") == ops.count("DequantizeLinear") == static["qdq_pairs"]
    assert "Cast" not in ops  # nothing between Q/DQ and the ops TensorRT fuses them into
    assert [i.name for i in proto.graph.input] == ["images"] and static["outputs"] == ["output0"]
    out_shape = [d.dim_value for d in proto.graph.output[0].type.tensor_type.shape.dim]
    assert out_shape[0] == 2 and out_shape[1] == 4 + 12
    values = constant_values(proto.graph)
    weight_q = 0
    for n in nodes:
        if n.op_type == "QuantizeLinear":
            assert values[n.input[2]].dtype == np.int8 and not values[n.input[2]].any()  # symmetric int8
            if n.input[0] in values:  # weights: per output channel, axis 0
                weight_q += 1
                assert {a.name: a.i for a in n.attribute}.get("axis", 1) == 0
                assert values[n.input[1]].shape == (values[n.input[0]].shape[0],)
    from pytorch_quantization import nn as quant_nn
    assert weight_q == sum(isinstance(m, quant_nn.QuantConv2d) for m in load_for_export(weights).modules())
    assert static["qdq_pairs"] > weight_q  # the activations' pairs besides one per conv weight
    report = lint(proto)
    assert report.quantized_convs == weight_q
    assert report.unshared_joins == [] and report.unquantized_convs == [] and report.dangling_quantize == []
    assert report.float_by_design and all("/dfl/" in n for n in report.float_by_design)
    print("Q/DQ pairs", static["qdq_pairs"], "weights", weight_q, "export s", static["export_s"])

    dynamic = _export(weights, dynamic=True, simplify_=True)
    proto = onnx.load(dynamic["onnx"])
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    assert dynamic["qdq_pairs"] == static["qdq_pairs"]  # onnxslim kept every pair
    assert lint(proto).problems == 0


def test_ort_matches_pytorch_fake_quant(quantized_weights, demo_data):
    """ONNX Runtime executes the exported Q/DQ graph; it must compute what the PyTorch model computes.
    Tolerance: the two runtimes sum convolutions in different orders, so a value sitting on a rounding
    boundary of a quantizer can land one INT8 step (amax/127, under 1% of its range) apart and carry that
    step downstream. Such flips are rare, so the norm-relative error of the raw outputs stays well under
    2e-2, while any real mismatch (a wrong scale, a missing quantizer, a transposed axis) gives >= 1e-1.
    Detections are compared on a trained model (tests/test_val_trt.py): these random-weight models score every
    box alike, so which of two near-equal boxes NMS keeps is arbitrary."""
    weights = quantized_weights
    result = _export(weights, dynamic=True)
    model = load_for_export(weights)
    parity = verify_parity(model, result["onnx"], _calib_images(demo_data, 2), conf_thres=0.001, iou_thres=0.7)
    assert parity["rel_err"]["output0"] < 2e-2, parity
    print(parity)


def test_float_export_is_exact_and_has_no_qdq(demo_data, tmp_path):
    model = build_model(tiny_gelan(12))
    weights = save_float_checkpoint(model, tmp_path / "float.pt")
    result = _export(weights, dynamic=True)
    assert result["qdq_pairs"] == 0 and not result["quantized"]
    parity = verify_parity(load_for_export(weights), result["onnx"], _calib_images(demo_data, 1))
    assert parity["rel_err"]["output0"] < 1e-5, parity


def test_reuse_keeps_a_graph_of_these_weights_and_settings_and_exports_again_otherwise(tiny_gelan_weights, tmp_path):
    """`--reuse` (what scripts/val_trt.sh exports with): the graph beside the weights is kept when its metadata
    records these weights and these settings, and exported again for another image size or changed weights."""
    import shutil
    weights = tmp_path / "m.pt"
    shutil.copy(tiny_gelan_weights, weights)
    onnx_file = weights.with_suffix(".onnx")

    def export(imgsz):
        r = call_cli("export_qat.py", "--weights", weights, "--include", "onnx", "--dynamic", "--simplify", "--imgsz",
                     imgsz, "--reuse")
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stderr
    assert "reusing" not in export(64)
    written = onnx_file.stat().st_mtime_ns
    assert "reusing" in export(64) and onnx_file.stat().st_mtime_ns == written
    assert "with other settings; exporting again" in export(96)
    assert onnx.load(onnx_file).graph.input[0].type.tensor_type.shape.dim[2].dim_value == 96
    weights.write_bytes(weights.read_bytes() + b"\0")  # other bytes: other weights, as far as the digest goes
    assert "from other weights" in export(96)


def test_scales_in_onnx_are_amax_over_127(tmp_path):
    model = build_model(tiny_gelan(12))
    model.fuse()
    quantize_model(model)
    calibrate(model, QuantRecipe(calib_method="max"), [torch.rand(1, 3, 64, 64)])
    q = model.model[0].conv._input_quantizer
    weights = save_checkpoint(model, tmp_path / "m.pt")
    proto = onnx.load(_export(weights)["onnx"])
    inits = constant_values(proto.graph)
    first_q = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "images")
    assert float(inits[first_q.input[1]]) == pytest.approx(float(q.amax) / 127, rel=1e-6)


def test_end2end_graphs_are_checker_clean_and_record_their_thresholds(quantized_weights, tmp_path):
    weights = quantized_weights
    common = ["--weights", weights, "--include", "onnx_end2end", "--imgsz", IMGSZ, "--dynamic", "--conf-thres", 0.3,
              "--iou-thres", 0.6, "--topk-all", 50, "--exist-ok"]
    r = run_cli("export_qat.py", *common, "--nms", "efficient")
    assert r.returncode == 0, r.stderr[-3000:]
    path = weights.with_name(weights.stem + "-end2end-efficientnms.onnx")
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)  # the plugin sits in TensorRT's plugin domain, which the graph imports
    (nms,) = [n for n in proto.graph.node if n.op_type == "EfficientNMS_TRT"]
    assert nms.domain == "trt.plugins" and "trt.plugins" in {o.domain for o in proto.opset_import}
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nms.attribute}
    assert attrs["background_class"] == -1 and attrs["box_coding"] == 1 and attrs["score_activation"] == 0
    assert attrs["max_output_boxes"] == 50
    assert attrs["score_threshold"] == pytest.approx(0.3) and attrs["iou_threshold"] == pytest.approx(0.6)
    assert [o.name for o in proto.graph.output] == ["num_dets", "det_boxes", "det_scores", "det_classes"]
    assert lint(proto).problems == 0  # the graph below the plugin is the plain export, still lint-clean
    r = run_cli("export_qat.py", *common)  # the standard one: its own file, checker-clean, run by ONNX Runtime
    assert r.returncode == 0, r.stderr[-3000:]
    path = weights.with_name(weights.stem + "-end2end.onnx")
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert "NonMaxSuppression" in {n.op_type for n in proto.graph.node} and not any(n.domain for n in proto.graph.node)
    meta = {m.key: m.value for m in proto.metadata_props}
    assert (meta["nms"], float(meta["conf_thres"]), float(meta["iou_thres"]), int(meta["max_det"])) == ("onnx", 0.3,
                                                                                                         0.6, 50)
    import onnxruntime as ort
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"images": np.random.default_rng(0).random((2, 3, IMGSZ, IMGSZ), dtype=np.float32)})
    assert [o.shape for o in out] == [(2, 1), (2, 50, 4), (2, 50), (2, 50)]
    r = run_cli("utils/qdq_lint.py", path, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("export_qat.py", *common[:-1])
    assert r.returncode != 0 and "--exist-ok" in r.stderr + r.stdout  # never overwrites silently


def test_lint_flags_unshared_joins_and_strict_fails(tmp_path):
    model = build_model(tiny_gelan(12))
    model.fuse()
    quantize_model(model, QuantRecipe(share_rules=False))
    calibrate(model, QuantRecipe(calib_method="max"), [torch.rand(1, 3, 64, 64)])
    weights = save_checkpoint(model, tmp_path / "unshared.pt")
    path = _export(weights)["onnx"]
    report = lint_file(path)
    assert report.unshared_joins  # the tiny GELAN's concats, pools and splits without the rules: 6
    r = run_cli("utils/qdq_lint.py", path, "--strict")
    assert r.returncode == 1 and "unshared-scale joins" in r.stdout
    assert run_cli("utils/qdq_lint.py", tmp_path / "missing.onnx").returncode == 2


def test_deepstream_export(quantized_weights, tmp_path):
    weights = quantized_weights
    r = run_cli("export_yoloV9.py", "--weights", weights, "--size", IMGSZ, "--dynamic", "--simplify", "--exist-ok")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "QAT (INT8 Q/DQ)" in r.stdout + r.stderr
    deepstream = weights.with_name(weights.stem + "-deepstream.onnx")  # never the TensorRT graph's name
    proto = onnx.load(str(deepstream))
    assert [o.name for o in proto.graph.output] == ["output"]
    assert proto.graph.output[0].type.tensor_type.shape.dim[2].dim_value == 6
    labels = weights.with_name(weights.stem + "-deepstream-labels.txt").read_text().split()
    assert labels == [f"class{i}" for i in range(12)]
    import onnxruntime as ort
    sess = ort.InferenceSession(str(deepstream), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"images": np.random.rand(3, 3, IMGSZ, IMGSZ).astype(np.float32)})[0]
    assert out.shape[0] == 3 and out.shape[2] == 6
    assert (out[..., 2] >= out[..., 0]).all() and (out[..., 5] >= 0).all() and (out[..., 5] < 12).all()
    r = run_cli("export_yoloV9.py", "--weights", weights, "--dynamic", "--batch", 4)
    assert r.returncode != 0 and "--dynamic and --batch" in r.stderr


def scale_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Every Q/DQ scale tensor of a graph by name."""
    consts = constant_values(graph)
    return {n.input[1]: consts[n.input[1]] for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}


def test_fp16_export_raises_near_dead_scales_and_changes_nothing_else(demo_data320, tmp_path):
    """A trained model (the demo gelan-t) with 16 output channels of one conv made near-dead (weights x 1e-3: their
    per-channel ranges fall under 0.0078, scales under FP16's smallest normal number), PTQ, then the default FP16
    export. What the clamp must do: raise exactly those 16 scale values to FP16's smallest normal number, with one
    warning that counts them, and leave every other scale as it was. Raising a scale changes the model (the 16
    channels get a coarser step, so the FP16 graph's mAP may differ from the unclamped FP32 graph's by more than
    FP16 rounding alone would), so the FP16 graph is compared with the FP32 graph given the same clamp: then only
    FP16 activations differ, and detections must match as for any FP16 export (tests/test_deploy.py: >= 0.9 with
    the tolerances of models/deployment/export.py). Without the clamp those scales turn subnormal or zero in FP16 and
    the channels' outputs are lost or infinite."""
    import onnx
    from conftest import TRAINED_T, call_cli
    from models.deployment.evaluate import NMSConfig, detections
    from models.deployment.export import matched_detections
    from models.deployment.runners import OnnxRuntimeRunner
    from models.quantization.checkpoint import load_float_model
    from utils.onnx_fp16 import FP16_MIN_NORMAL, clamp_scales
    model = load_float_model(TRAINED_T, torch.device("cpu"))
    conv = model.model[2].cv1.conv
    with torch.no_grad():
        conv.weight[:16] *= 1e-3
        if conv.bias is not None:
            conv.bias[:16] *= 1e-3
    assert float(conv.weight[:16].abs().amax()) < 127 * FP16_MIN_NORMAL
    quantize_model(model)
    import export_qat
    images = export_qat.verification_images(str(demo_data320), 320, 4, 12)
    calibrate(model, QuantRecipe(calib_method="percentile", percentile=99.999), images[:2])
    weights = save_checkpoint(model, tmp_path / "dead.pt")
    graphs = {}
    for dtype in ("fp32", "fp16"):
        w = tmp_path / f"{dtype}.pt"
        w.write_bytes(weights.read_bytes())
        r = call_cli("export_qat.py", "--weights", w, "--imgsz", 320, "--dynamic", "--dtype", dtype)
        assert r.returncode == 0, r.stderr[-2000:]
        warned = [line for line in r.stderr.splitlines() if "raised to it" in line]
        assert len(warned) == (dtype == "fp16"), r.stderr[-2000:]
        if warned:
            assert "1 Q/DQ scale tensor(s) (16 value(s))" in warned[0]
        graphs[dtype] = w.with_suffix(".onnx")
    fp32 = onnx.load(str(graphs["fp32"]))
    before = scale_values(fp32.graph)
    raised = clamp_scales(fp32.graph)
    after = scale_values(fp32.graph)
    assert (raised["scales"], raised["values"]) == (1, 16)
    changed = {name: (before[name] != after[name]).sum() for name in before if (before[name] != after[name]).any()}
    assert list(changed.values()) == [16], changed  # one tensor, the 16 near-dead channels, nothing else
    (name,) = changed
    assert (after[name][before[name] != after[name]] == np.float32(FP16_MIN_NORMAL)).all()
    fp16 = {k: v.astype(np.float32) for k, v in scale_values(onnx.load(str(graphs["fp16"])).graph).items()}
    assert all(np.array_equal(fp16[k], after[k].astype(np.float16).astype(np.float32)) for k in after)
    onnx.save(fp32, str(tmp_path / "fp32-clamped.onnx"))
    reference, runner = OnnxRuntimeRunner(tmp_path / "fp32-clamped.onnx"), OnnxRuntimeRunner(graphs["fp16"])
    counted = matched = 0
    for im in images:
        ref, got = reference(im)["output0"], runner(im)["output0"]
        assert torch.isfinite(got).all()
        m = matched_detections(detections({"output0": ref}, NMSConfig(0.25, 0.45), 0), got, 0.25, 12)
        counted, matched = counted + m.counted, matched + m.matched
    print({"raised": raised, "detections_counted": counted, "matched": matched})
    assert counted > 20 and matched >= 0.9 * counted  # a model that detects: the comparison is not between zeros
