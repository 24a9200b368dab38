"""Mixed precision (`qat.py quantize --max-loss`): the candidates, the choice, the deployable graph, the CLI."""
from __future__ import annotations

import copy
import json
import os
import shutil

import onnx
import pytest
import torch
from conftest import IMGSZ, REDUCED_SIZE, TRAINED_T, call_cli, run_cli, start_cli, wait_for_file
from pytorch_quantization import nn as quant_nn

from models.core.layer_outputs import LayerOutputs
from models.deployment.evaluate import NMSConfig
from models.mixed_precision import (MixedPrecision, candidate_quantizers, choose_float_set, conv_macs, float_candidates,
                                    int8_mac_share, keep_float, kept_float)
from models.pipeline import STATE_FILE
from models.quantization.checkpoint import load_float_model, load_quantized_model, save_checkpoint
from models.quantization.quantize import QuantRecipe, calibrate, float_convs, named_quantizers, quantize_model
from utils.engine_graph import analyse
from utils.onnx_utils import model_to_onnx
from utils.qdq_lint import FLOAT_LAYERS_KEY, lint, lint_file, module_of


@pytest.fixture(scope="module")
def ptq_model(demo_data):
    """The trained demo gelan-t, quantized and calibrated (max) on a few demo images."""
    import export_qat
    model = load_float_model(TRAINED_T)
    quantize_model(model)
    calibrate(model, QuantRecipe(calib_method="max"), export_qat.verification_images(str(demo_data), IMGSZ, 2, 2))
    return model


@pytest.fixture(scope="module")
def tiny_ptq_model(tiny_gelan_weights, demo_data):
    """The tiny GELAN (every block type, a few channels), quantized and calibrated (max) on two demo images: for what
    checks structure, not accuracy (four exports of it cost a tenth of gelan-t's)."""
    import export_qat
    model = load_float_model(tiny_gelan_weights)
    quantize_model(model)
    calibrate(model, QuantRecipe(calib_method="max"), export_qat.verification_images(str(demo_data), IMGSZ, 2, 1))
    return model


def test_candidates_cover_every_quantized_conv_once(ptq_model):
    """Each INT8 tensor class is one candidate: every quantized conv belongs to exactly one, and the convs of a
    candidate read its quantizer (so keeping it in float leaves no conv with a float input and INT8 weights)."""
    candidates = float_candidates(ptq_model, IMGSZ)
    convs = [c for cand in candidates for c in cand.convs]
    quantized = [n for n, m in ptq_model.named_modules() if isinstance(m, quant_nn.QuantConv2d)]
    assert sorted(convs) == sorted(quantized) and len(set(convs)) == len(convs)
    for cand in candidates:
        assert all(ptq_model.get_submodule(c)._input_quantizer is ptq_model.get_submodule(cand.name)
                   for c in cand.convs)
    macs = conv_macs(ptq_model, IMGSZ)
    assert sum(c.macs for c in candidates) == sum(macs[c] for c in quantized) > 0
    assert any(len(c.convs) > 1 for c in candidates)  # shared inputs (ELAN splits, the head's branches) move as one


def test_kept_float_tensor_classes_export_lint_clean_and_named(tiny_ptq_model, tmp_path):
    """Two tensor classes kept in float (one read by several backbone convs, one in the head): the export names exactly their convs
    in its metadata, the lint counts them as intended (0 unquantized convs, 0 unshared joins) and finds the
    INT8/float boundaries they add (none in the all-INT8 graph); module_of maps every Conv node to its module."""
    import export_qat
    model = copy.deepcopy(tiny_ptq_model)  # the fixture is shared
    all_int8 = lint(model_to_onnx(model))
    assert all_int8.boundaries == [] and all_int8.problems == 0
    candidates = float_candidates(model, IMGSZ)
    chosen = [next(c for c in candidates if len(c.convs) > 1),  # a class read by several convs (an ELAN split)
              next(c for c in candidates if c.name.startswith("model.8.cv3.0.2"))]  # the head's class branch
    keep_float(model, chosen)
    convs = float_convs(model)
    assert sorted(convs) == sorted(c for cand in chosen for c in cand.convs)
    macs = conv_macs(model, IMGSZ)
    dfl = sum(v for k, v in macs.items() if ".dfl." in k)  # float by design in every build
    assert int8_mac_share(model, IMGSZ) == pytest.approx(1 - (sum(c.macs for c in chosen) + dfl) / sum(macs.values()))
    weights = save_checkpoint(model, tmp_path / "mixed.pt")
    # the FP32 graph, the default FP16 one (TensorRT 11's) and the end-to-end one (NMS inside) all name them
    for flags in (["--include", "onnx", "--dtype", "fp32"], ["--include", "onnx", "--exist-ok"],
                  ["--include", "onnx_end2end"]):
        opt = export_qat.parse_opt(["--weights", str(weights), "--imgsz", str(IMGSZ), *flags])
        result = export_qat.run(**vars(opt))
        proto = onnx.load(result["onnx"])
        named = json.loads({p.key: p.value for p in proto.metadata_props}[FLOAT_LAYERS_KEY])
        assert sorted(module_of(n) for n in named) == sorted(convs), flags
        assert all(model.get_submodule(module_of(n.name)) is not None for n in proto.graph.node if n.op_type == "Conv")
        report = lint_file(result["onnx"])
        assert report.problems == 0 and report.unquantized_convs == [] and sorted(report.intended_float) == sorted(named)
        assert len(report.boundaries) >= len(chosen), flags
        unnamed = lint(proto, kept_float=())  # the same graph without the metadata: the float convs are problems
        assert len(unnamed.unquantized_convs) == len(convs), flags


def test_a_pass_from_the_first_layer_a_candidate_is_used_in_equals_the_whole_forward(ptq_model):
    """Ranking reruns only the layers from the first one that uses a candidate's quantizers, on the kept outputs of
    the all-INT8 pass: bit for bit the whole forward's outputs, for a candidate read in one layer and for a shared
    one (ADown's pool quantizer, also read by convs of later layers). Starting one layer later misses the change;
    a pass that does not keep its outputs leaves the all-INT8 ones for the next candidate."""
    model = copy.deepcopy(ptq_model).eval()
    images = torch.rand(2, 3, IMGSZ, IMGSZ)
    passes = LayerOutputs(model, images)
    with pytest.raises(RuntimeError, match="run from layer 0 first"):
        passes.run(3)
    int8 = passes.run(0)
    assert torch.equal(int8[0], model(images)[0])
    candidates = {c.name: c for c in float_candidates(model, IMGSZ)}
    for name in ("model.15.cv3.0.m.1.cv1.conv._input_quantizer", "model.5._avgpool_quantizer"):
        c = candidates[name]
        start = passes.first_layer(candidate_quantizers(model, [c]))
        assert start == int(name.split(".")[1])
        with kept_float(model, [c]):
            whole = model(images)[0]
            assert torch.equal(passes.run(start, keep=False)[0], whole), name
            assert not torch.equal(passes.run(start + 1, keep=False)[0], whole), name
        assert torch.equal(passes.run(start, keep=False)[0], int8[0])  # the kept outputs are still all-INT8


def _scored(model, candidates, gains, base):
    """A select score that is `base` plus the gain of every candidate now in float (read off the model's
    quantizers): the selection logic on the real model, with known costs."""
    def score(desc):
        return base + sum(g for c, g in zip(candidates, gains) if model.get_submodule(c.name)._disabled)
    return score


def _measured(model, score):
    """choose_float_set's measure, measure_each and score from a score of the description: metrics {"ap": score}."""
    def measure_each(candidates):
        out = {}
        for c in candidates:
            with kept_float(model, [c]):
                out[c.name] = {"ap": score(c.name)}
        return out
    return {"measure": lambda desc: {"ap": score(desc)}, "measure_each": measure_each,
            "score": lambda metrics: metrics["ap"]}


def test_each_candidate_measured_from_its_first_layer_equals_its_own_evaluation(ptq_model, demo_data):
    """candidate_metrics (one pass over the images, each candidate's forward again from the first layer that uses
    it, on the all-INT8 pass's outputs before) gives each candidate the metrics of a whole evaluation with it alone
    in float: the layers before compute the same numbers on the same batch, so equal to the last bit on any CPU."""
    from models.core.task import DETECT
    from models.deployment.evaluate import evaluate, val_loader
    from models.deployment.runners import TorchRunner
    from models.mixed_precision import candidate_metrics
    from utils.batches import load_data
    model = copy.deepcopy(ptq_model)
    data = load_data(demo_data)
    loader = list(val_loader(DETECT, data, IMGSZ, 4, 0, 8))  # 2 batches
    candidates = float_candidates(model, IMGSZ)
    passes = LayerOutputs(model, torch.zeros(1, 3, IMGSZ, IMGSZ))
    by_layer = {}
    for c in candidates:  # one in the first layer, one in the head, the ones between spread over the backbone
        by_layer.setdefault(passes.first_layer(candidate_quantizers(model, [c])), c)
    layers = sorted(by_layer)
    chosen = [by_layer[k] for k in sorted(set(layers[::4]) | {layers[-1]})]
    assert min(by_layer) == 0 and len(chosen) >= 4
    each = candidate_metrics(model, chosen, loader, DETECT, data["nc"], NMSConfig(), "")
    all_int8 = evaluate(TorchRunner(model), loader, DETECT, data["nc"])
    for c in chosen:
        with kept_float(model, [c]):
            alone = evaluate(TorchRunner(model), loader, DETECT, data["nc"])
        assert each[c.name] == {k: alone[k] for k in each[c.name]}, c.name
    assert any(each[c.name]["ap"] != all_int8["ap"] for c in chosen)  # float there changes the result
    assert not any(q._disabled for _, q in named_quantizers(model))


def test_choose_keeps_the_cheapest_set_that_reaches_the_budget(ptq_model):
    """Candidates added most mAP per MAC first, measuring the growing set, until the budget is met; unreachable: the
    best set found, said so; already within: nothing measured. Costs are what the candidate alone gains."""
    model = copy.deepcopy(ptq_model)
    passes = LayerOutputs(model, torch.rand(2, 3, IMGSZ, IMGSZ))
    candidates = float_candidates(model, IMGSZ)[:4]
    by_mac = sorted(candidates, key=lambda c: c.macs)
    # the largest class gains the most, the smallest the most per MAC: the order must follow the MACs
    assert by_mac[-1].macs > 1.5 * by_mac[0].macs
    gains = [0.004 if c is by_mac[0] else 0.006 if c is by_mac[-1] else -0.001 for c in candidates]
    plan = MixedPrecision(max_loss=0.001, measured=4)
    record, mixed = choose_float_set(model, candidates, plan, origin=0.5, ptq=0.495,
                                     **_measured(model, _scored(model, candidates, gains, 0.495)), passes=passes)
    assert record["reached"] and [c["name"] for c in record["kept_float"]] == [by_mac[0].name]
    assert mixed["ap"] == record["mixed_select"]  # the kept set's metrics, as measured while choosing
    assert record["kept_float"][0]["cost"] == pytest.approx(0.004) and record["mixed_select"] == pytest.approx(0.499)
    assert len(record["measured"]) == 4 and not any(model.get_submodule(c.name)._disabled for c in candidates)
    record, mixed = choose_float_set(model, candidates, MixedPrecision(max_loss=0.0, measured=4), origin=0.51,
                                     ptq=0.495, **_measured(model, _scored(model, candidates, gains, 0.495)),
                                     passes=passes)
    assert not record["reached"] and [t["kept_float"] for t in record["tried"]] == [
        [by_mac[0].name], [by_mac[0].name, by_mac[-1].name]]  # only the gainful ones, the most per MAC first
    assert {c["name"] for c in record["kept_float"]} == {by_mac[0].name, by_mac[-1].name}
    assert record["mixed_select"] == pytest.approx(0.505) == mixed["ap"]  # the kept set's metrics
    calls = []
    record, mixed = choose_float_set(model, candidates, plan, origin=0.5, ptq=0.4995,
                                     **_measured(model, lambda d: calls.append(d) or 0.0), passes=passes)
    assert record["reached"] and record["kept_float"] == [] and calls == [] and mixed is None


def test_only_the_shortlist_is_measured_cheap_wins_and_large_ones_alternately(ptq_model):
    """8 candidates, 4 measured: the output error each removes is known (the forward's output grows by a candidate's
    error while its quantizers are on), so the shortlist is known: alternately the most error removed per MAC and
    the most removed overall. A ranking by the least error removed, or by one of the two alone, measures others."""
    model = copy.deepcopy(ptq_model)
    candidates = float_candidates(model, IMGSZ)[:8]
    # the more MACs, the more error, but less per MAC: the two rankings run in opposite directions
    by_macs = sorted(candidates, key=lambda c: c.macs)
    assert by_macs[-1].macs > 4 * by_macs[0].macs
    errors = [0.1 * (1 + by_macs.index(c)) for c in candidates]
    on = lambda c: not model.get_submodule(c.name)._disabled  # noqa: E731

    class Passes:  # the output; with every quantizer off (the reference) the candidates add nothing
        def first_layer(self, modules):
            return 0

        def run(self, start, keep=True):
            return torch.tensor([[1.0 + sum(e for c, e in zip(candidates, errors) if on(c))]])
    total = sum(errors)
    removed = {c.name: total ** 2 - (total - e) ** 2 for c, e in zip(candidates, errors)}
    per_mac = sorted(candidates, key=lambda c: removed[c.name] / c.macs, reverse=True)
    overall = sorted(candidates, key=lambda c: removed[c.name], reverse=True)
    want = list(dict.fromkeys(c.name for pair in zip(per_mac, overall) for c in pair))[:4]
    assert want != [c.name for c in per_mac[:4]] and want != [c.name for c in overall[:4]]  # both rankings matter
    record, _ = choose_float_set(model, candidates, MixedPrecision(max_loss=0.001, measured=4), origin=0.5, ptq=0.49,
                                 **_measured(model, _scored(model, candidates, [0.0] * 8, 0.49)), passes=Passes())
    assert list(record["measured"]) == want
    assert not record["reached"] and record["kept_float"] == []  # nothing gained: nothing kept


@pytest.fixture(scope="module")
def max_loss_run(demo_data320, tmp_path_factory):
    """`qat.py quantize --max-loss 0` from a PTQ that loses on select (max ranges from one batch), 3 QAT epochs:
    its arguments, its run folder and what it printed."""
    tmp = tmp_path_factory.mktemp("max-loss")
    # each candidate measured, and each set tried, is an evaluation
    args = ["quantize", "--weights", TRAINED_T, "--data", demo_data320, "--imgsz", REDUCED_SIZE, "--batch-size", 2,
            "--device", "cpu", "--workers", 0, "--num-image", 16, "--epochs", 3, "--iters", 2, "--calib-batches", 1,
            "--calib-method", "max", "--max-loss", 0, "--project", tmp]
    r = run_cli("qat.py", *args, "--name", "m")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return args, tmp / "m", r.stdout + r.stderr


def test_quantize_max_loss_names_float_layers_and_exports_clean(max_loss_run, demo_data320, tmp_path):
    """The report names the tensor classes kept in float, their measured cost and what they cost the engine; the
    delivered model keeps them in float and exports lint-clean, with ONNX Runtime matching PyTorch."""
    _, run_dir, printed = max_loss_run
    report = json.loads((run_dir / "report.json").read_text())
    mp = report["mixed_precision"]
    assert mp["all_int8_select"] < mp["origin_select"]  # the premise: all INT8 loses on select
    assert mp["kept_float"] and all(c["cost"] > 0 for c in mp["kept_float"])
    assert sorted(mp["float_convs"]) == sorted(c for k in mp["kept_float"] for c in k["convs"])
    assert 0.9 < mp["int8_mac_share"] < 1 and mp["boundaries"] >= 1 and mp["lint_problems"] == 0
    assert mp["mixed_select"] > mp["all_int8_select"] and report["ptq"]["ap"] == pytest.approx(mp["mixed_select"],
                                                                                            abs=1e-4)
    assert "float conv(s), select" in report["table"] and "mixed precision:" in printed
    final = shutil.copy(report["final"]["file"], tmp_path)  # the graph beside it, not in the run folder others read
    # parity at a low threshold: a few fine-tuning steps from max ranges leave weak scores, and with one thread (as
    # under xdist on a 2-core AMD EPYC) no detection of the delivered model reached 0.25 on the images checked
    e = run_cli("export_qat.py", "--weights", final, "--include", "onnx", "--imgsz", REDUCED_SIZE, "--dtype", "fp32",
                "--verify", "--conf-thres", 0.05, "--data", demo_data320, "--json", tmp_path / "export.json")
    assert e.returncode == 0, e.stderr[-3000:]
    result = json.loads((tmp_path / "export.json").read_text())
    assert result["lint"]["problems"] == 0 and len(result["lint"]["intended_float"]) == len(mp["float_convs"])
    # tolerance: models/deployment/export.py (one INT8 step flips)
    assert result["parity"]["detections_counted"] > 0 and result["parity"]["detections_matched"] >= 0.95


def _summary(run_dir):
    report = json.loads((run_dir / "report.json").read_text())
    mixed = {k: v for k, v in report["mixed_precision"].items() if k != "seconds"}
    return (sorted(p.name for p in (run_dir / "weights").iterdir()),
            [(e["epoch"], e["ap"], e["loss"]) for e in report["qat"]], report["qat_best"]["epoch"],
            report["select"], report["calibration"]["chosen"], report["calibration"]["candidates"],
            {k: report["final"][k] for k in ("stage", "epoch", "ap")}, mixed)


def test_killed_run_resumes_to_the_same_result(max_loss_run):
    """The same run, SIGKILLed once the state after its first QAT epoch is saved, then --resume (from that state,
    not from PTQ): the same files and numbers as the
    uninterrupted run (each epoch's data order and augmentation are seeded by the epoch), the same select split,
    calibration choice, tensor classes kept in float and delivered model, no temp files left behind: the resumed
    run keeps the choices it made rather than making them again, and the delivered file keeps its float classes."""
    import signal
    args, full, _ = max_loss_run
    killed = full.parent / "killed"
    run = start_cli("qat.py", *args, "--name", killed.name)
    wait_for_file(killed / "weights", STATE_FILE, run)  # saved after epoch 1's checkpoint and report
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait().returncode == -signal.SIGKILL
    report = json.loads((killed / "report.json").read_text())
    assert report["ptq"] is not None and report["mixed_precision"]["kept_float"] and not report.get("finished")
    assert len(report["qat"]) < 3  # killed with an epoch left (each ~1.5 s here): the resumed run trains again
    r = run_cli("qat.py", "quantize", "--resume", killed, "--device", "cpu", "--workers", 0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stdout + r.stderr
    first = next(line for line in (r.stdout + r.stderr).splitlines() if "resume=" in line)
    # the argument line says what it runs: the run's own settings, not the parser's defaults (data/coco.yaml, 640)
    assert f"data={report['config']['data']}" in first and "imgsz=640" not in first and "max_loss=0" in first
    assert "qat: " in first and "io_utils" not in first  # named after the script, as upstream's lines are
    assert _summary(killed) == _summary(full)
    assert not list(killed.rglob("*.tmp")) and not list(killed.rglob("qat_state.pt"))
    again = call_cli("qat.py", "quantize", "--resume", killed, "--device", "cpu")
    assert again.returncode == 2 and "nothing to resume" in again.stderr
    delivered = load_quantized_model(killed / "weights" / "best_gelan-t-demo.pt")
    kept = {c["name"] for c in report["mixed_precision"]["kept_float"]}
    assert {n for n, q in named_quantizers(delivered, activations_only=True) if q._disabled} == kept


def test_engine_graph_counts_kept_float_layers_as_intended(tmp_path):
    """A dequantizing Reformat inside the network is a problem, unless it feeds a layer the ONNX names as kept in
    float: then it is counted and named as intended (TensorRT 11 layer JSON; the names as TensorRT fuses them)."""
    def t(name, dtype):
        return {"Name": name, "Format": "kLINEAR", "DataType": dtype}
    layers = {"I/O Tensors": [{"Name": "images"}, {"Name": "out"}], "Layers": [
        {"Name": "/model.0/conv/Conv + /model.0/act/Sigmoid", "LayerType": "CaskConvolution",
         "Inputs": [t("a", "Int8")], "Outputs": [t("b", "Int8")]},
        {"Name": "deq", "LayerType": "Reformat", "Origin": "QDQ", "Inputs": [t("b", "Int8")], "Outputs": [t("c", "Half")]},
        {"Name": "/model.1/conv/Conv + PWN(/model.1/act/Sigmoid)", "LayerType": "CaskConvolution",
         "Inputs": [t("c", "Half")], "Outputs": [t("out", "Half")]}]}
    path = tmp_path / "m.layer.json"
    path.write_text(json.dumps(layers))
    from utils.engine_graph import load_layers
    plain = analyse(*load_layers(path))
    assert [v["name"] for v in plain.violations] == ["deq"] and plain.intended == []
    kept = analyse(*load_layers(path), kept_float=("/model.1/conv/Conv",))
    assert kept.violations == [] and kept.intended == [{"name": "deq", "layer": layers["Layers"][2]["Name"]}]
    graph = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    graph.metadata_props.append(onnx.StringStringEntryProto(key=FLOAT_LAYERS_KEY, value='["/model.1/conv/Conv"]'))
    onnx.save(graph, tmp_path / "m.onnx")
    run = lambda *a: call_cli("utils/engine_graph.py", path, "--strict", *a)  # noqa: E731
    assert run().returncode == 1
    r = run("--onnx", str(tmp_path / "m.onnx"))
    assert r.returncode == 0 and "kept in float on purpose: 1 reformat(s) into /model.1/conv/Conv" in r.stdout
