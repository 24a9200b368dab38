"""Deployment evaluation: val_trt.py with the ONNX Runtime backend, trtexec log parsing, TensorRT paths."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, SHARED, TRAINED_T, call_cli, end2end_result, one_box, run_cli

from models.quantization.checkpoint import load_float_model, save_checkpoint
from models.quantization.quantize import QuantRecipe, calibrate, quantize_model
from utils.batches import load_data

REFERENCE = (SHARED or REPO) / "reference" / "002_fd809eff222b6c94.txt"


SIZE = 320  # the trained demo model's size


@pytest.fixture(scope="module")
def quantized(demo_data320, tmp_path_factory):
    """The trained demo gelan-t, quantized (PTQ, max) and exported (the default FP16 graph): real detections to
    compare. `max` ranges: an exact maximum moves only in its last bits with the CPU's kernels and thread count,
    where mse's search over a histogram can pick another bin, so the model is the same on every machine."""
    import export_qat
    model = load_float_model(TRAINED_T)
    quantize_model(model)
    calibrate(model, QuantRecipe(calib_method="max"), export_qat.verification_images(str(demo_data320), SIZE, 4, 2))
    d = tmp_path_factory.mktemp("vt")
    weights = save_checkpoint(model, d / "gelan-t-q.pt")
    r = run_cli("export_qat.py", "--weights", weights, "--include", "onnx", "--dynamic", "--imgsz", SIZE)
    assert r.returncode == 0, r.stderr[-2000:]
    return weights, weights.with_suffix(".onnx")


@pytest.fixture(scope="module")
def fp32_graph(quantized, tmp_path_factory):
    """The same model's FP32 Q/DQ graph (PyTorch's arithmetic; TensorRT 10's weakly typed input), exported once."""
    weights = tmp_path_factory.mktemp("fp32") / "fp32.pt"
    shutil.copy(quantized[0], weights)
    r = run_cli("export_qat.py", "--weights", weights, "--include", "onnx", "--dynamic", "--imgsz", SIZE, "--dtype",
                "fp32")
    assert r.returncode == 0, r.stderr[-2000:]
    return weights, weights.with_suffix(".onnx")


def f1(result: dict) -> float:
    return 2 * result["precision"] * result["recall"] / max(result["precision"] + result["recall"], 1e-9)


def test_onnxruntime_backend_equals_pytorch(fp32_graph, demo_data320):
    """The same metric loop over the PyTorch fake-quant model and over ONNX Runtime running its FP32 Q/DQ export
    (PyTorch's arithmetic; what FP16 activations add is tests/test_deploy.py's).

    What differs between the two runtimes is the summation order inside each convolution, so a value sitting on
    an INT8 rounding boundary can round the other way and a few boxes move by a step. One such box that crosses a
    ground-truth match (or swaps rank with one) moves its class's AP by up to 1 / (that class's boxes), and mAP by
    that over the number of classes: 1 / (12 x 8) = 0.0104 for the rarest class here (on 100 images of the same
    data, 1 / (12 x 20): 0.004 to 0.006 was seen across CPUs and thread counts, one to two boxes). The bound allows
    three such boxes on the rarest class; a wrong scale or a lost quantizer moves hundreds. Precision and recall are read at the single
    confidence where the smoothed F1 curve peaks; that curve is flat near its top, so a few flips move the peak
    along it and trade precision for recall (seen with AVX2 kernels on one thread: P 0.334 vs 0.361, R 0.542 vs
    0.516). Their F1 is what stays put (0.413 vs 0.425 there): it gets 0.025."""
    from models.core.task import DETECT
    from models.deployment.evaluate import evaluate, val_loader
    from models.deployment.runners import OnnxRuntimeRunner, open_runner
    weights, onnx_path = fp32_graph
    data = load_data(demo_data320)
    loader = val_loader(DETECT, data, SIZE, 4, 0)
    ours = evaluate(OnnxRuntimeRunner(onnx_path), loader, DETECT, data["nc"])
    ref = evaluate(open_runner(weights, "cpu"), loader, DETECT, data["nc"])
    print("ORT", ours, "PyTorch", ref, {k: round(ours[k] - ref[k], 5) for k in ("ap", "ap50")})
    assert ours["images"] == ref["images"] == 40
    assert ref["ap50"] > 0.1  # a trained model: the comparison is not between two empty results
    for k in ("ap", "ap50"):
        assert ours[k] == pytest.approx(ref[k], abs=3 * one_box(data)), (k, one_box(data))
    assert f1(ours) == pytest.approx(f1(ref), abs=0.025) and f1(ref) > 0.2


def test_detections_match_box_for_box(fp32_graph, demo_data320):
    """Per detection on a trained model, FP32 graph (PyTorch's arithmetic): every reference box scoring 0.1 above
    the threshold has a candidate of the same class, IoU >= 0.8 and score within 0.1 in ONNX Runtime's raw output
    (models/deployment/export.py says why these bounds hold on any x86 CPU's kernels)."""
    import export_qat
    from models.deployment.export import verify_parity
    from models.quantization.checkpoint import load_for_export
    weights, onnx_path = fp32_graph
    images = export_qat.verification_images(str(demo_data320), SIZE, 4, 10)  # all 40 val images
    parity = verify_parity(load_for_export(weights), onnx_path, images)
    print(parity)
    assert parity["detections_counted"] > 50 and parity["detections_matched"] >= 0.97, parity


@pytest.fixture(scope="module")
def plain_by_batch(quantized, demo_data320, tmp_path_factory) -> dict[int, dict]:
    """val_trt.py on the plain (FP16) graph at batch 1 and at batch 3 (40 images: a last batch of one)."""
    tmp, results = tmp_path_factory.mktemp("plain"), {}
    for batch in (1, 3):
        r = call_cli("val_trt.py", "--onnx-file", quantized[1], "--data", demo_data320, "--imgsz", SIZE, "--batch-size",
                     batch, "--workers", 0, "--project", tmp, "--name", f"b{batch}")
        assert r.returncode == 0, r.stderr[-3000:]
        results[batch] = json.loads((tmp / f"b{batch}" / "val_trt.json").read_text())
    return results


def test_cli_batch_1_and_3_agree_and_qat_eval_equals_val_trt(quantized, plain_by_batch, demo_data320, tmp_path):
    weights, onnx_path = quantized
    results = plain_by_batch
    assert results[1]["backend"] == "onnxruntime" and results[1]["images"] == 40
    # Batched convolutions sum in another order, which flips a few INT8 roundings: mAP equal within two boxes of the
    # rarest class, the F1 at the peak within 0.025 (see test_onnxruntime_backend_equals_pytorch)
    for k in ("ap", "ap50"):
        assert results[1][k] == pytest.approx(results[3][k], abs=2 * one_box(load_data(demo_data320))), k
    assert f1(results[1]) == pytest.approx(f1(results[3]), abs=0.025)
    # qat.py eval and val_trt.py --weights: one loop, one letterbox, the same batches: the same numbers
    common = ["--data", demo_data320, "--imgsz", SIZE, "--batch-size", 4, "--device", "cpu", "--workers", 0,
              "--project", tmp_path]
    assert run_cli("qat.py", "eval", "--weights", weights, *common, "--name", "qe").returncode == 0
    r = run_cli("val_trt.py", "--weights", weights, *common, "--name", "vt")  # the PyTorch backend, as a user runs it
    assert r.returncode == 0, r.stderr[-2000:]
    qe = json.loads((tmp_path / "qe" / "eval.json").read_text())
    vt = json.loads((tmp_path / "vt" / "val_trt.json").read_text())
    assert vt["backend"] == "pytorch" and vt["images"] == 40 and qe["ap50"] > 0.1
    assert {k: qe[k] for k in ("ap", "ap50", "precision", "recall")} == {k: vt[k] for k in ("ap", "ap50", "precision",
                                                                                           "recall")}


def test_bad_inputs(tiny_gelan_weights, demo_data320, tmp_path):
    """Graphs val_trt.py cannot score are refused in one line; they are exported from a quantized tiny GELAN (the
    refusals read the graph's inputs and ops, not its detections: a fifth of gelan-t's export time)."""
    import export_qat
    r = call_cli("val_trt.py", "--onnx-file", tmp_path / "none.onnx", "--data", demo_data320)
    assert r.returncode == 2 and "none.onnx: file not found" in r.stderr
    model = quantize_model(load_float_model(tiny_gelan_weights))
    calibrate(model, QuantRecipe(calib_method="max"), export_qat.verification_images(str(demo_data320), SIZE, 1, 1))
    static = save_checkpoint(model, tmp_path / "static.pt")
    assert run_cli("export_qat.py", "--weights", static, "--imgsz", SIZE, "--batch-size", 2).returncode == 0
    r = call_cli("val_trt.py", "--onnx-file", static.with_suffix(".onnx"), "--data", demo_data320, "--imgsz", SIZE,
                 "--batch-size", 4, "--project", tmp_path)
    assert r.returncode == 2 and "fixed batch of 2" in r.stderr
    r = call_cli("val_trt.py", "--onnx-file", static.with_suffix(".onnx"), "--data", demo_data320, "--imgsz", 256,
                 "--batch-size", 2, "--project", tmp_path)
    assert r.returncode == 2 and "--imgsz" in r.stderr
    assert run_cli("export_qat.py", "--weights", static, "--imgsz", SIZE, "--include", "onnx_end2end", "--nms",
                   "efficient").returncode == 0
    r = call_cli("val_trt.py", "--onnx-file", static.with_name("static-end2end-efficientnms.onnx"), "--data",
                 demo_data320, "--imgsz", SIZE, "--project", tmp_path)
    assert r.returncode == 2 and "EfficientNMS_TRT" in r.stderr
    r = call_cli("val_trt.py", "--engine-file", tmp_path / "typo.engine", "--data", demo_data320)
    assert r.returncode == 2 and "typo.engine: file not found" in r.stderr  # not "TensorRT is not installed"
    assert run_cli("export_yoloV9.py", "--weights", static, "--size", SIZE, "--exist-ok").returncode == 0
    r = call_cli("val_trt.py", "--onnx-file", static.with_name("static-deepstream.onnx"), "--data", demo_data320,
                 "--imgsz", SIZE, "--project", tmp_path)
    assert r.returncode == 2 and "DeepStream" in r.stderr and "Traceback" not in r.stderr


def test_trtexec_summaries_from_the_reference_logs():
    from utils.trtexec import comparison_table, parse_summary
    if not REFERENCE.is_file():
        pytest.skip(f"the shared reference documents were not found (set YOLOV9_QAT_SHARED); looked for {REFERENCE}")
    blocks = REFERENCE.read_text(errors="ignore").split("Throughput:")[1:]
    parsed = [parse_summary("Throughput:" + b.split("```")[0]) for b in blocks]
    assert len(parsed) >= 10
    first = parsed[0]
    assert first["throughput_qps"] == pytest.approx(1026.71)
    assert first["latency_ms"]["p99"] == pytest.approx(0.974121)
    assert first["gpu_compute_ms"]["median"] == pytest.approx(0.972656)
    assert first["total_host_walltime_s"] == pytest.approx(10.0019)
    rows = [{"engine": "int8", "batch": 1, **parsed[0]}, {"engine": "fp16", "batch": 1, **parsed[8]}]
    table = comparison_table(rows)
    assert "| 1 |" in table and "%" in table
    with pytest.raises(ValueError, match="no trtexec performance summary"):
        parse_summary("&&&& FAILED TensorRT.trtexec")


def test_trtexec_lines_with_log_prefixes():
    from utils.trtexec import parse_summary
    log = ("[11/22/2026-10:00:00] [I] === Performance summary ===\n"
           "[11/22/2026-10:00:00] [I] Throughput: 250.5 qps\n"
           "[11/22/2026-10:00:00] [I] Latency: min = 3.9 ms, max = 4.2 ms, mean = 4.0 ms, median = 4.0 ms, "
           "percentile(90%) = 4.1 ms, percentile(95%) = 4.15 ms, percentile(99%) = 4.19 ms\n")
    s = parse_summary(log)
    assert s["throughput_qps"] == 250.5 and s["latency_ms"]["p99"] == 4.19 and s["latency_ms"]["p95"] == 4.15


def test_engine_script_without_trtexec_says_how_to_get_it(quantized, tmp_path):
    if shutil.which("trtexec"):
        pytest.skip("trtexec is installed here")
    r = subprocess.run(["bash", str(REPO / "scripts/generate_trt_engine.sh"), str(quantized[1]), str(SIZE)],
                       text=True, capture_output=True)
    assert r.returncode == 3 and "install_dependencies.sh --tensorrt" in r.stderr
    assert not Path(str(quantized[1]).replace(".onnx", ".engine")).exists()


def test_tensorrt_engine_matches_onnxruntime(quantized, demo_data320, tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed here (not installable on this project's "
                                           "machines); this test runs unchanged where it is")
    if not shutil.which("trtexec") or not torch.cuda.is_available():
        pytest.skip("needs trtexec and a CUDA GPU")
    _, onnx_path = quantized
    r = subprocess.run(["bash", str(REPO / "scripts/generate_trt_engine.sh"), str(onnx_path), str(SIZE), "--min", "1",
                        "--opt", "4", "--max", "4"], text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    out = {}
    for name, args in (("trt", ["--engine-file", onnx_path.with_suffix(".engine")]),
                       ("ort", ["--onnx-file", onnx_path])):
        r = run_cli("val_trt.py", *args, "--data", demo_data320, "--imgsz", SIZE, "--batch-size", 4, "--project",
                    tmp_path, "--name", name)
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = json.loads((tmp_path / name / "val_trt.json").read_text())
    # TensorRT's kernels sum in yet another order: three boxes of the rarest class, as ONNX Runtime against PyTorch
    assert out["trt"]["ap"] == pytest.approx(out["ort"]["ap"], abs=3 * one_box(load_data(demo_data320)))


def test_end_to_end_graph_scores_like_the_plain_graph(quantized, plain_by_batch, demo_data320, tmp_path):
    """NMS inside the graph (standard ONNX NonMaxSuppression), exported at the evaluation's thresholds, measured by
    the same loop as the plain graph (both at batch 3): the same mAP (NonMaxSuppression and upstream's NMS keep the
    same boxes, up to ties), and the thresholds it was built with reported; other thresholds than the loop's are
    warned about."""
    weights, _ = quantized
    out = {"plain": plain_by_batch[3], "e2e": end2end_result(weights, demo_data320, SIZE, tmp_path, batch=3)}
    assert out["plain"]["ap50"] > 0.1
    assert out["e2e"]["nms_in_graph"] == {"conf_thres": 0.001, "iou_thres": 0.7, "max_det": 300.0}
    for k in ("ap", "ap50"):  # the same boxes up to ties: within two boxes of the rarest class
        assert out["e2e"][k] == pytest.approx(out["plain"][k], abs=2 * one_box(load_data(demo_data320))), k
    e2e = tmp_path / "e2e.pt"
    r = run_cli("export_qat.py", "--weights", e2e, "--include", "onnx_end2end", "--dynamic", "--imgsz", SIZE,
                "--exist-ok")  # the deployment defaults: 0.25 / 0.45 / 100
    r = call_cli("val_trt.py", "--onnx-file", e2e.with_name("e2e-end2end.onnx"), "--data", demo_data320, "--imgsz",
                 SIZE, "--batch-size", 4, "--workers", 0, "--project", tmp_path, "--name", "defaults")
    assert r.returncode == 0 and "NMS runs inside this graph with conf_thres 0.25 (--conf-thres 0.001)" in r.stderr


def test_nms_is_upstreams_without_its_clock(demo_data320, monkeypatch):
    """Our NMS keeps what upstream's `non_max_suppression(multi_label=True)` keeps, box for box, on a trained
    model's raw output at val's threshold (mask coefficients ride along: the segmentation layout). Upstream's stops
    after 2.5 s + 50 ms per image of wall clock and leaves the remaining images empty: on a busy machine (seen on
    the H100 with 7 runs sharing 16 CPUs: bccd's PTQ mAP read 0.52 instead of 0.62) the mAP and every choice made on
    it would depend on the load. Ours reads no clock, so a clock that jumps changes nothing."""
    import export_qat
    import utils.general
    from models.deployment.evaluate import NMSConfig, multi_label_nms
    model = load_float_model(TRAINED_T).eval()
    images = export_qat.verification_images(str(demo_data320), SIZE, 4, 1)[0]
    with torch.no_grad():
        pred = model(images)[0]
    pred = torch.cat([pred, torch.randn(pred.shape[0], 3, pred.shape[2])], 1)  # 3 mask coefficients
    cfg = NMSConfig()
    ref = utils.general.non_max_suppression(pred, cfg.conf_thres, cfg.iou_thres, multi_label=True,
                                            max_det=cfg.max_det, nm=3)
    ours = [multi_label_nms(x, cfg, nm=3) for x in pred]
    assert sum(len(r) for r in ref) > 100  # real detections, not two empty lists
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    ticks = iter(range(0, 10**6, 100))  # every reading of the clock 100 s later than the last
    monkeypatch.setattr(utils.general.time, "time", lambda: float(next(ticks)))
    late = utils.general.non_max_suppression(pred, cfg.conf_thres, cfg.iou_thres, multi_label=True,
                                             max_det=cfg.max_det, nm=3)
    assert len(late[-1]) == 0 < len(ref[-1])  # upstream gave up on the last image
    for r, o in zip(ref, (multi_label_nms(x, cfg, nm=3) for x in pred)):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_select_batches_are_decoded_once_and_the_same_on_every_pass(seg_data, tmp_path):
    """The select split's loader (kept_in_memory): the second pass gives the first pass's batches, masks included,
    without reading an image file again (they are gone by then); a pass left early keeps nothing, and a split whose
    images would not fit the limit is streamed as before."""
    import yaml
    from models.core.task import SEGMENT
    from models.deployment.evaluate import FirstBatches, KeptBatches, kept_in_memory, val_loader
    copy = tmp_path / "data"
    shutil.copytree(seg_data.parent, copy)
    data = {**yaml.safe_load(seg_data.read_text()), "path": str(copy)}
    data["val"] = str(copy / "images" / "val")
    loader = kept_in_memory(val_loader(SEGMENT, data, 160, 4, 0, num_image=10), 160)
    assert isinstance(loader, KeptBatches) and len(loader) == 3
    next(iter(loader))  # left early: nothing kept
    assert loader.batches is None
    first = [[t.clone() if isinstance(t, torch.Tensor) else t for t in batch] for batch in loader]
    shutil.rmtree(copy / "images")
    again = list(loader)
    assert len(again) == len(first) == 3 and sum(len(b[2]) for b in again) == 12  # whole batches of 4
    for a, b in zip(first, again):
        assert len(a) == len(b) == 5 and all(torch.equal(x, y) for x, y in zip(a, b) if isinstance(x, torch.Tensor))
        assert a[2] == b[2]  # the same image paths
    fits = len(loader) * 4 * 3 * 160 * 160  # bytes of its batches if every one were full
    assert isinstance(kept_in_memory(loader.loader, 160, limit=fits), KeptBatches)
    assert isinstance(kept_in_memory(loader.loader, 160, limit=fits - 1), FirstBatches)
