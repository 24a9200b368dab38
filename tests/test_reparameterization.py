"""reparameterization.py on real upstream YOLOv9 training models (random weights, non-trivial BN)."""
from __future__ import annotations

import pytest
import torch
from conftest import IMGSZ, build_model, run_cli, save_float_checkpoint


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
                "--no-eval-origin", "--num-image", 4, "--project", tmp_path, "--name", "q")
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
    r = run_cli("reparameterization.py", *args)
    assert r.returncode != 0 and expect in r.stdout + r.stderr, r.stdout[-1500:] + r.stderr[-1500:]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out.pt").exists()
