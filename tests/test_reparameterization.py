"""reparameterization.py on real upstream YOLOv9 training models (random weights, non-trivial BN)."""
from __future__ import annotations

import pytest
import torch
from conftest import IMGSZ, build_model, call_cli, run_cli, save_float_checkpoint


@pytest.mark.parametrize("size", ["t", "s", "m", "c", "e"])
def test_converted_gelan_equals_main_branch(size, tmp_path):
    import reparameterization
    train = build_model(f"yolov9-{size}", seed=1)
    weights = save_float_checkpoint(train, tmp_path / f"yolov9-{size}.pt")
    train = torch.load(weights, weights_only=False)["model"].float().eval()  # what the converter reads
    out = tmp_path / f"yolov9-{size}-converted.pt"
    opt = reparameterization.parse_opt(["--weights", str(weights), "--model", size, "--classes_num", "12",
                                        "--save", str(out)])
    summary = reparameterization.run(**vars(opt))
    gelan = summary["gelan"].float().eval()
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        main = train(x)[0][1]   # Dual head in eval: ([aux, main], raw maps)
        got = gelan(x)[0]
    diff = float((got - main).abs().max())
    print(f"yolov9-{size}: max abs diff {diff:.2e}, params {summary['params_before']:,} -> {summary['params_after']:,}")
    assert diff < 1e-4
    assert summary["params_after"] < summary["params_before"]
    saved = torch.load(out, weights_only=False)
    assert next(saved["model"].parameters()).dtype == torch.float16
    assert list(saved["model"].names) == list(train.names)
    with torch.no_grad():
        assert float((saved["model"].float().eval()(x)[0] - main).abs().max()) < 0.05 * float(main.abs().max())


def test_segmentation_pair_equals_main_branch(tmp_path):
    import reparameterization
    train = build_model("yolov9-c-dseg", seed=3)
    # trained with upstream's --no-overlap (full instance masks): the converted file keeps it for the fine-tune
    weights = save_float_checkpoint(train, tmp_path / "yolov9-c-seg.pt", opt={"no_overlap": True, "save_dir": "r"})
    train = torch.load(weights, weights_only=False)["model"].float().eval()
    opt = reparameterization.parse_opt(["--weights", str(weights), "--model", "c-seg", "--classes_num", "12",
                                        "--save", str(tmp_path / "seg.pt")])
    assert opt.cfg is None  # derived from the training model: no upstream yaml is its main branch
    summary = reparameterization.run(**vars(opt))
    gelan = summary["gelan"].float().eval()
    assert type(gelan.model[-1]).__name__ == "DSegment" and type(gelan).__name__ == "SegmentationModel"
    assert summary["head"]["proto"] == "proto2" and summary["head"]["cv4"] == "cv7"
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        (t_det, (_, t_mc, t_proto)), (g_det, (_, g_mc, g_proto)) = train(x), gelan(x)
    diffs = [float((g - t).abs().max()) for g, t in ((g_det, t_det), (g_mc, t_mc), (g_proto, t_proto))]
    print(f"yolov9-c-seg: max abs diff det/mask coef/proto {diffs}, "
          f"params {summary['params_before']:,} -> {summary['params_after']:,}")
    assert max(diffs) < 1e-4 and float(t_proto.abs().max()) > 0
    assert summary["params_after"] < summary["params_before"]
    saved = torch.load(tmp_path / "seg.pt", weights_only=False)
    assert saved["opt"] == {"no_overlap": True}
    saved = saved["model"]
    assert next(saved.parameters()).dtype == torch.float16 and list(saved.names) == list(train.names)
    # what QAT takes: the converted model quantizes, its segmentation head included, under the derived sharing rules
    from pytorch_quantization.nn import QuantConv2d
    from models.quantization.checkpoint import load_float_model
    from models.quantization.quantize import QuantRecipe, calibrate, quantize_model, quantizer_counts
    from utils.onnx_utils import model_to_onnx, unshared_joins
    model = quantize_model(load_float_model(tmp_path / "seg.pt"))
    calibrate(model, QuantRecipe(calib_method="max"), [x])
    head = model.model[-1]
    convs = [m for m in (*head.cv4.modules(), *head.proto.modules()) if isinstance(m, torch.nn.modules.conv._ConvNd)]
    assert convs and all(isinstance(m, QuantConv2d) for m in convs)
    print("yolov9-c-seg converted, quantizers:", quantizer_counts(model))
    graph = model_to_onnx(model, 64).graph
    assert len(graph.output) == 2 and unshared_joins(graph) == []


@pytest.mark.parametrize("size", ["t", "c"])
def test_derived_definition_rebuilds_upstream_gelan(size):
    """The main-branch derivation used for yolov9-c-seg gives exactly upstream's gelan-X for detection."""
    from reparameterization import derived_gelan_yaml
    from models.yolo import Model
    derived = Model(derived_gelan_yaml(build_model(f"yolov9-{size}")), nc=12)
    upstream = build_model(f"gelan-{size}")
    shapes = [(k, tuple(v.shape)) for k, v in derived.state_dict().items()]
    assert shapes == [(k, tuple(v.shape)) for k, v in upstream.state_dict().items()]


def test_segmentation_weights_refuse_a_segment_head_cfg(tmp_path):
    weights = save_float_checkpoint(build_model("yolov9-c-dseg"), tmp_path / "yolov9-c-seg.pt")
    cfg = build_model.__globals__["CHECKOUT"] / "models" / "segment" / "gelan-c-seg.yaml"
    r = run_cli("reparameterization.py", "--weights", weights, "--model", "c-seg", "--cfg", cfg, "--classes_num", 12,
                "--save", tmp_path / "out.pt")
    assert r.returncode != 0 and "converts to a DSegment head" in r.stdout + r.stderr, r.stderr[-1500:]
    assert "leave --cfg out" in r.stdout + r.stderr  # the way out, not upstream's non-matching gelan-c-dseg.yaml
    assert "Traceback" not in r.stderr and not (tmp_path / "out.pt").exists()


@pytest.fixture(scope="module")
def yolov9_t_weights(tmp_path_factory):
    return save_float_checkpoint(build_model("yolov9-t", seed=2), tmp_path_factory.mktemp("y9t") / "yolov9-t.pt")


def test_converted_weights_go_through_qat(yolov9_t_weights, demo_data, tmp_path):
    out = tmp_path / "yolov9-t-converted.pt"
    r = run_cli("reparameterization.py", "--weights", yolov9_t_weights, "--model", "t", "--classes_num", 12,
                "--save", out)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("qat.py", "quantize", "--weights", out, "--data", demo_data, "--imgsz", IMGSZ, "--batch-size", 4,
                "--device", "cpu", "--workers", 0, "--epochs", 1, "--iters", 1, "--calib-batches", 1,
                "--calib-method", "max", "--no-eval-origin", "--num-image", 4, "--project", tmp_path, "--name", "q")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "q" / "weights" / "qat_best_yolov9-t-converted.pt").is_file()


@pytest.mark.parametrize("case", ["wrong_model", "nc", "already_converted", "missing", "exists"])
def test_bad_input(case, yolov9_t_weights, tmp_path):
    gelan = save_float_checkpoint(build_model("gelan-t"), tmp_path / "gelan-t.pt")
    (tmp_path / "taken.pt").write_text("x")
    args, expect = {
        "wrong_model": (["--weights", yolov9_t_weights, "--model", "s", "--classes_num", 12], "differ in shape"),
        "nc": (["--weights", yolov9_t_weights, "--model", "t", "--classes_num", 80], "trained with 12 classes"),
        "already_converted": (["--weights", gelan, "--model", "t", "--classes_num", 12], "already converted"),
        "missing": (["--weights", tmp_path / "none.pt", "--model", "t"], "file not found"),
        "exists": (["--weights", yolov9_t_weights, "--model", "t", "--classes_num", 12, "--save", tmp_path / "taken.pt"],
                   "--exist-ok"),
    }[case]
    if "--save" not in args:
        args += ["--save", tmp_path / "out.pt"]
    r = call_cli("reparameterization.py", *args)
    assert r.returncode != 0 and expect in r.stdout + r.stderr, r.stdout[-1500:] + r.stderr[-1500:]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out.pt").exists()
