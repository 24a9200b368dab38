"""Segmentation end to end on the CPU: a GELAN segmentation model trained on the generated outline data
(assets/gelan-t-seg-demo.pt: upstream segment/train.py on the H100, assets/gelan-t-seg.yaml) quantized by
qat.py, exported with its prototypes, and evaluated (box and mask mAP) in PyTorch and ONNX Runtime."""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, SHARED, call_cli, end2end_result, one_box, run_cli, save_float_checkpoint

TRAINED_SEG = REPO / "assets" / "gelan-t-seg-demo.pt"
SIZE = 320  # the size it was trained at
COMMON = ["--imgsz", SIZE, "--batch-size", 4, "--device", "cpu", "--workers", 0]


@pytest.fixture(scope="module")
def select_data(seg_data, tmp_path_factory) -> Path:
    """The first 10 val images as a yaml of their own: what the run chooses on (each candidate, stage and epoch is
    evaluated there)."""
    folder = tmp_path_factory.mktemp("select")
    data = yaml.safe_load(seg_data.read_text())
    images = sorted((seg_data.parent / "images" / "val").glob("*.png"))[:10]
    (folder / "select.txt").write_text("".join(f"{f}\n" for f in images))
    data.update(path=str(seg_data.parent), val=str(folder / "select.txt"))
    (folder / "select.yaml").write_text(yaml.safe_dump(data))
    return folder / "select.yaml"


@pytest.fixture(scope="module")
def seg_run(seg_data, select_data, tmp_path_factory):
    project = tmp_path_factory.mktemp("seg")
    # 8 training images: all of them fine-tune, the first 2 calibrate, the choices are made on val images
    # (--select-data)
    r = run_cli("qat.py", "quantize", "--weights", TRAINED_SEG, "--data", seg_data, *COMMON[:2], "--batch-size", 2,
                *COMMON[4:], "--epochs", 1, "--iters", 4, "--calib-batches", 1, "--select-data", select_data,
                "--num-image", 16, "--project", project, "--name", "run")  # 16: whole batches of 4 and of 8
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return project / "run", r


def test_quantize_reports_box_and_mask_metrics(seg_run):
    save_dir, r = seg_run
    report = json.loads((save_dir / "report.json").read_text())
    for stage in ("origin", "ptq", "qat_best"):
        assert set(report[stage]) >= {"ap", "ap50", "precision", "recall", "mask_ap", "mask_ap50", "mask_precision",
                                      "mask_recall"}, stage
    assert report["origin"]["mask_ap50"] > 0.1  # a trained model: masks are really matched, not all zero
    assert report["training_masks"] == "overlap"  # its checkpoint does not say: upstream's default
    # the QAT step distilled the masks and trained on upstream's segmentation loss
    assert {"distill", "distill_mask", "det"} <= set(report["qat"][0])
    assert "Mask AP" in r.stdout + r.stderr
    cal = report["calibration"]  # auto chose by box + mask mAP50-95 on the select images
    assert cal["chosen"] == max(cal["candidates"], key=cal["candidates"].get) and report["select"]["source"] == \
        "select-data"
    assert cal["candidates"][cal["chosen"]] == pytest.approx(report["ptq"]["ap"] + report["ptq"]["mask_ap"], abs=1e-5)


def test_step_benchmark_shows_a_segmenters_masks(seg_run, tmp_path):
    """scripts/benchmark_step.py on a segmenter's run (the one above, as the script finds it when its process ends):
    the mask mAP after every epoch and delivered, beside the box figures, in the JSON, the table and a second panel
    of curves."""
    from conftest import CHECKOUT, load_script
    save_dir, _ = seg_run
    report = json.loads((save_dir / "report.json").read_text())
    step = load_script(CHECKOUT / "scripts" / "benchmark_step.py", "benchmark_step")
    run = step.summary({"seed": 0, "step": "auto", "device": "cpu", "rc": 0, "wall_s": 9.0, "folder": save_dir})
    epochs = [e for e in report["qat"] if e.get("stage") == "qat"]
    assert run["mask_select_curve"] == [e["mask_ap"] for e in epochs] and len(epochs) == 1
    assert run["select_curve"] == [e["ap"] for e in epochs] and run["mask_ptq_select"] == report["ptq"]["mask_ap"]
    assert run["mask_delivered"]["val"] == report["val"]["final"]["mask_ap"]
    assert run["delivered"]["val"] == report["val"]["final"]["ap"]
    result = {"runs": [run], "weights": "w.pt", "imgsz": SIZE, "machine": {"gpu": None}}
    assert set(step.by_step([run])["auto"]) >= {"delivered_val", "mask_delivered_val", "wall_s"}
    assert f"| {run['ptq_select']:.4f} / {run['mask_ptq_select']:.4f} |" in step.table([run])
    png = step.plot_curves(result, tmp_path / "curves.png")
    import cv2
    assert cv2.imread(str(png)).shape[1] == 2 * 7 * 110  # two panels: boxes, masks


def test_segmentation_head_is_quantized_under_the_sharing_rules(seg_run):
    from pytorch_quantization.nn import QuantConv2d
    from models.quantization.checkpoint import load_quantized_model
    from models.quantization.quantize import QuantUpsample
    from utils.onnx_utils import model_to_onnx, unshared_joins
    model = load_quantized_model(seg_run[0] / "weights" / "qat_best_gelan-t-seg-demo.pt")
    head = model.model[-1]
    convs = [m for m in (*head.cv4.modules(), *head.proto.modules()) if isinstance(m, torch.nn.modules.conv._ConvNd)]
    assert len(convs) == 3 * 3 + 3 and all(isinstance(m, QuantConv2d) for m in convs)  # coefficients, prototypes
    assert isinstance(head.proto.upsample, QuantUpsample)  # the prototypes' upsampling runs in INT8
    assert unshared_joins(model_to_onnx(model, SIZE).graph) == []


def test_eval_reproduces_the_report(seg_run, seg_data, tmp_path):
    save_dir, _ = seg_run
    report = json.loads((save_dir / "report.json").read_text())
    r = run_cli("qat.py", "eval", "--weights", report["final"]["file"], "--data", seg_data, *COMMON[:2], "--batch-size",
                8, *COMMON[4:], "--num-image", 16, "--project", tmp_path, "--name", "e")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "e" / "eval.json").read_text())
    want = report["val"]["final"]  # the delivered model, measured on val at the end of the run
    assert want["mask_ap50"] > 0.1  # masks really matched: the numbers compared are not zeros
    # Same weights, loop, batches and thread count (conftest gives every process the tests start one count): the
    # same arithmetic, so equal to rounding of the printed digits. Another checkpoint of the run (the QAT-best file
    # where PTQ was delivered, or the last epoch's) scores thousandths apart and fails.
    for k in ("ap", "mask_ap"):
        assert result[k] == pytest.approx(want[k], abs=1e-4), k


@pytest.fixture(scope="module")
def seg_onnx(seg_run, seg_data):
    """The delivered segmenter exported, and compared with PyTorch in ONNX Runtime on the first 24 val images (66 to
    69 detections above 0.05 there, by CPU kernels and threads: the parity test below asks for more than 50)."""
    weights = seg_run[0] / "weights" / "qat_best_gelan-t-seg-demo.pt"
    r = run_cli("export_qat.py", "--weights", weights, "--imgsz", SIZE, "--dynamic", "--simplify", "--dtype", "fp32",
                "--verify", "--data", seg_data, "--batch-size", 2, "--verify-batches", 12, "--conf-thres", 0.05,
                "--json", weights.with_suffix(".json"))
    assert r.returncode == 0, r.stderr[-3000:]
    return weights, weights.with_suffix(".onnx"), json.loads(weights.with_suffix(".json").read_text())


def test_export_has_predictions_and_prototypes_and_is_lint_clean(seg_onnx):
    import onnx
    _, onnx_path, summary = seg_onnx
    graph = onnx.load(str(onnx_path)).graph
    shapes = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in graph.output}
    assert shapes == {"output0": ["batch", 4 + 12 + 32, 2100], "output1": ["batch", 32, SIZE // 4, SIZE // 4]}
    assert summary["lint"]["unshared_joins"] == [] and summary["lint"]["unquantized_convs"] == []
    # ONNX Runtime vs PyTorch. Both compute the FP32 Q/DQ arithmetic as written but sum each convolution in another
    # order, so values on an INT8 rounding boundary flip one step and carry it downstream. How many flip depends on
    # the CPU's kernels and thread count (the predictions' norm-relative error was 0.006 to 0.028 across CPUs and
    # 1 or 2 threads, the prototypes' 0.05 to 0.10), so no raw-output norm is bounded here. What holds on any kernels
    # is what a flip cannot do: remove a detection or move it past the tolerances of models/deployment/export.py (IoU
    # 0.8, score 0.1), which a wrong scale, a missing quantizer or a transposed axis does for most boxes. The masks the
    # prototypes make are bounded by the mask mAP comparison below.
    parity = summary["parity"]
    assert set(parity["rel_err"]) == {"output0", "output1"}, parity
    assert parity["detections_counted"] > 50 and parity["detections_matched"] >= 0.95, parity


def test_fp16_export_for_strongly_typed_engines(seg_run, tmp_path):
    weights = tmp_path / "seg16.pt"
    shutil.copy(seg_run[0] / "weights" / "qat_best_gelan-t-seg-demo.pt", weights)
    r = run_cli("export_qat.py", "--weights", weights, "--imgsz", SIZE, "--json", tmp_path / "e.json")  # fp16 default
    assert r.returncode == 0, r.stderr[-3000:]
    lint = json.loads((tmp_path / "e.json").read_text())["lint"]
    assert lint["dtype"] == "fp16" and lint["fp32_compute"] == [] and lint["unshared_joins"] == []


@pytest.fixture(scope="module")
def plain_ort(seg_onnx, seg_data) -> dict:
    """The plain FP32 graph's box and mask metrics in ONNX Runtime (batch 4), by the one evaluation loop."""
    from models.core.task import SEGMENT
    from models.deployment.evaluate import evaluate, val_loader
    from models.deployment.runners import OnnxRuntimeRunner
    from utils.batches import load_data
    data = load_data(seg_data)
    return evaluate(OnnxRuntimeRunner(seg_onnx[1]), val_loader(SEGMENT, data, SIZE, 4, 0), SEGMENT, data["nc"])


def test_onnxruntime_box_and_mask_map_equal_pytorch(seg_onnx, plain_ort, seg_data):
    """The same loop (square letterbox, NMS, upstream's mask assembly and matching) over the PyTorch model and over
    ONNX Runtime running its export. As for detection (test_val_trt.py), only the summation order inside the
    convolutions differs, which flips a few INT8 roundings and moves a few boxes (and their masks) by a step: box
    and mask mAP within three boxes of the rarest class (conftest.one_box)."""
    from models.core.task import SEGMENT
    from models.deployment.evaluate import evaluate, val_loader
    from models.deployment.runners import open_runner
    from utils.batches import load_data
    weights, _, _ = seg_onnx
    data = load_data(seg_data)
    ref = evaluate(open_runner(weights, "cpu"), val_loader(SEGMENT, data, SIZE, 4, 0), SEGMENT, data["nc"])
    ours = plain_ort
    print("ORT", ours, "PyTorch", ref)
    assert ours["images"] == ref["images"] == 40 and ref["mask_ap50"] > 0.1
    for k in ("ap", "ap50", "mask_ap", "mask_ap50"):
        assert ours[k] == pytest.approx(ref[k], abs=3 * one_box(data)), (k, one_box(data))


def test_val_trt_detects_segmentation_and_refuses_what_it_cannot_do(seg_onnx, select_data, tmp_path):
    """val_trt.py on a segmentation graph: it finds the task from the graph's outputs and reports mask metrics (on
    the 10 select images; the mask mAP over all 40 is test_onnxruntime_box_and_mask_map_equal_pytorch's); and the
    refusals. (scripts/val_trt.sh runs this same command after an export that takes no task: tests/test_upstream.py
    runs it as users do.)"""
    seg_data = select_data
    weights, onnx_path, _ = seg_onnx
    r = run_cli("val_trt.py", "--onnx-file", onnx_path, "--data", seg_data, "--imgsz", SIZE, "--batch-size", 4,
                "--workers", 0, "--project", tmp_path, "--name", "o")
    assert r.returncode == 0, r.stderr[-3000:]
    saved = Path(re.search(r"results saved to (\S+)", r.stdout + r.stderr).group(1))  # where it says it wrote
    assert saved == tmp_path / "o" / "val_trt.json"
    result = json.loads(saved.read_text())
    assert result["task"] == "segment" and result["mask_ap50"] > 0.1 and "Mask AP" in result["table"]
    r = call_cli("val_trt.py", "--onnx-file", onnx_path, "--data", seg_data, "--imgsz", SIZE, "--no-nms",
                 "--project", tmp_path)
    assert r.returncode == 2 and "--no-nms" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("export_qat.py", "--weights", weights, "--imgsz", SIZE, "--include", "onnx_end2end", "--nms",
                "efficient")
    assert r.returncode == 2 and "EfficientNMS_TRT does not" in r.stderr and "--nms onnx" in r.stderr
    assert not weights.with_name(weights.stem + "-end2end-efficientnms.onnx").exists()


def test_end_to_end_graph_gathers_the_kept_masks(seg_onnx, plain_ort, seg_data, tmp_path):
    """Segmentation end to end in standard ONNX: NonMaxSuppression's kept (anchor, class) pairs gather their mask
    coefficients, the graph assembles the masks (coefficients x prototypes, cropped to the box, > 0.5), and its box
    and mask mAP in ONNX Runtime equal the plain graph's (exported at the evaluation's thresholds)."""
    from utils.batches import load_data
    out = {"plain": plain_ort, "e2e": end2end_result(seg_onnx[0], seg_data, SIZE, tmp_path, "--dtype", "fp32")}
    assert out["e2e"]["task"] == "segment" and out["plain"]["mask_ap50"] > 0.1
    # boxes: the same thresholds, but ONNX's NonMaxSuppression and upstream's loop break ties and round IoUs near the
    # threshold each their own way (seen over 40 images: 0.0066 in box mAP, 0.63 of a box); masks: the graph
    # thresholds each mask at the prototypes' resolution (a quarter of the image's), the loop after upsampling to
    # the image, so boundary pixels differ and a few mask IoUs near a threshold cross it (seen over 100 images:
    # 0.0059 in mask mAP50, 1.4 boxes' worth; over 40: 0.0028, 0.27). Two boxes' worth each: a mask threshold of 0.6
    # instead of 0.5 moved mask mAP50 by 3.2 boxes' worth (0.0335).
    box = one_box(load_data(seg_data))
    for k in ("ap", "ap50", "mask_ap", "mask_ap50"):
        assert out["e2e"][k] == pytest.approx(out["plain"][k], abs=2 * box), (k, box)


@pytest.mark.skipif(SHARED is None or not (SHARED / "datasets" / "coco128-seg-416").is_dir(),
                    reason="shared/datasets/coco128-seg-416 not found (set YOLOV9_QAT_SHARED)")
def test_real_photographs_with_polygons_run_end_to_end(checkout, tmp_path):
    """Smoke test on 128 COCO photographs with instance polygons (80 classes): quantize, QAT, evaluate. The model
    is untrained (no COCO weights exist offline), so only that every stage runs and reports masks is checked."""
    src = SHARED / "datasets" / "coco128-seg-416"
    data = yaml.safe_load((src / "data.yaml").read_text())
    data["path"] = str(src)  # upstream resolves a relative path against its checkout
    (tmp_path / "data.yaml").write_text(yaml.safe_dump(data))
    from models.yolo import SegmentationModel
    torch.manual_seed(0)
    model = SegmentationModel(str(REPO / "assets" / "gelan-t-seg.yaml"), nc=80).eval()
    model.names = data["names"]
    # as upstream's segment/train.py --no-overlap records it: the fine-tune trains on full instance masks too
    weights = save_float_checkpoint(model, tmp_path / "gelan-t-seg-coco.pt", opt={"no_overlap": True})
    r = run_cli("qat.py", "quantize", "--weights", weights, "--data", tmp_path / "data.yaml", "--imgsz", 160,
                "--batch-size", 8, "--device", "cpu", "--workers", 0, "--epochs", 1, "--iters", 1, "--calib-batches", 1,
                "--calib-method", "max", "--num-image", 16, "--project", tmp_path, "--name", "coco")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "coco" / "report.json").read_text())
    # an untrained student equals its teacher up to the INT8 step, so the distillation terms round to 0 in the report;
    # upstream's segmentation loss (boxes, classes, masks) is what must have run
    step = report["qat"][0]
    assert report["finished"] and "mask_ap" in report["qat_best"] and {"distill", "distill_mask"} <= set(step)
    assert step["det"] > 0 and math.isfinite(step["distill_mask"])
    assert report["training_masks"] == "full" and "fine-tuning on full instance masks (as the float model was" in \
        r.stdout + r.stderr


SQUARES = {120: (5, 35), 40: (15, 25)}  # side -> its pixels at 1/4 of the input: squares centred on (80, 80)


class _SquareSegmenter:
    """A runner whose predictions are squares centred on (80, 80), each `(side, class, confidence)`, with a mask
    equal to its box: one prototype per square of SQUARES (at 1/4 of the input, as the Proto module's output)."""
    input_shape = (None, 3, 160, 160)

    def __init__(self, nc: int, predictions: list[tuple[int, int, float]]):
        self.nc, self.predictions = nc, predictions

    def __call__(self, images):
        n, k = len(images), len(SQUARES)
        pred = torch.zeros(n, 4 + self.nc + k, len(self.predictions))  # xywh, class scores, mask coefficients
        for a, (side, cls, conf) in enumerate(self.predictions):
            pred[:, :4, a] = torch.tensor([80, 80, side, side])
            pred[:, 4 + cls, a] = conf
            pred[:, 4 + self.nc + list(SQUARES).index(side), a] = 1
        protos = torch.full((n, k, 40, 40), -10.0)
        for i, (lo, hi) in enumerate(SQUARES.values()):
            protos[:, i, lo:hi, lo:hi] = 10
        return {"output0": pred, "output1": protos}


@pytest.fixture
def nested_squares(tmp_path) -> dict:
    """One grey image labelled with the full polygons of class 0 a large square and class 1 a small square lying on
    it (a dent on a panel)."""
    import cv2
    import numpy as np
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    cv2.imwrite(str(tmp_path / "images" / "a.png"), np.full((160, 160, 3), 114, np.uint8))
    square = lambda c, lo, hi: f"{c} " + " ".join(f"{x / 160} {y / 160}" for x, y in  # noqa: E731
                                                    ((lo, lo), (hi, lo), (hi, hi), (lo, hi)))
    (tmp_path / "labels" / "a.txt").write_text(square(0, 20, 140) + "\n" + square(1, 60, 100) + "\n")
    return {"val": str(tmp_path / "images")}


def test_masks_are_scored_whole_where_instances_nest(checkout, nested_squares):
    """segment/val.py scores each instance's full mask; training's one mask per image (overlap) cuts the small
    instance out of the large one. A prediction equal to the large polygon is a perfect mask: scored whole, mask mAP
    equals box mAP; against the overlap mask its IoU would be (120² - 40²) / 120² = 0.89, failing 0.90 and 0.95."""
    from models.core.task import SEGMENT
    from models.deployment.evaluate import evaluate, val_loader
    data = nested_squares
    perfect = _SquareSegmenter(2, [(120, 0, 0.9), (40, 1, 0.9)])
    whole = evaluate(perfect, val_loader(SEGMENT, data, 160, 1, 0), SEGMENT, nc=2)
    assert whole["ap"] > 0.99 and whole["mask_ap"] == pytest.approx(whole["ap"], abs=1e-6)
    # the two scorings differ here: training's overlap mask of the large square lacks the small one's pixels
    overlap = next(iter(SEGMENT.dataloader(data["val"], 160, 1, 32, pad=0.5, workers=0)[0]))[4][0]
    full = next(iter(val_loader(SEGMENT, data, 160, 1, 0)))[4]
    assert full.shape == (2, 40, 40) and full[0].sum() == 30 * 30 and full[1].sum() == 10 * 10
    assert (overlap == 1).sum() < (overlap >= 1).sum()  # the small instance took its area out of the large one


def test_fine_tune_trains_on_the_masks_its_float_model_was_trained_on(checkout, nested_squares):
    """A segmenter trained with upstream's --no-overlap learned every instance's full mask; fine-tuned on one mask per
    image it would learn to cut the small square out of the large one again. The run's task follows the flag, else
    the checkpoint's record (upstream's opt.no_overlap), else upstream's default; its training loader and its loss
    then agree on the masks: upstream's loss reads per-instance masks only with overlap off."""
    from models.core.task import DETECT, SEGMENT
    from models.pipeline import training_task
    from models.quantization.checkpoint import load_float_model, trained_overlap, training_record
    from utils.segment.loss_tal import ComputeLoss
    full, why = training_task(SEGMENT, None, trained_overlap({"opt": {"no_overlap": True}}), "w.pt")
    assert not full.overlap and "opt.no_overlap" in why and full.training_masks == "full"
    assert training_task(SEGMENT, True, False, "w.pt")[0].overlap  # the flag wins over the record
    assert training_task(SEGMENT, None, trained_overlap({"opt": {}}), "w.pt")[0] == SEGMENT  # unrecorded: upstream's
    assert training_record({"opt": {"no_overlap": True, "save_dir": "/home/x"}}) == {"opt": {"no_overlap": True}}
    with pytest.raises(ValueError, match="--no-overlap: --weights w.pt is a detector"):
        training_task(DETECT, False, None, "w.pt")
    batch = {t.overlap: next(iter(t.dataloader(nested_squares["val"], 160, 1, 32, pad=0.5, workers=0)[0]))
             for t in (SEGMENT, full)}
    assert batch[True][4].shape == (1, 40, 40) and (batch[True][4] == 1).sum() < 30 * 30  # the large one cut
    masks = batch[False][4]
    assert masks.shape == (2, 40, 40) and masks[0].sum() == 30 * 30 and masks[1].sum() == 10 * 10  # each whole
    model = load_float_model(TRAINED_SEG).train()
    model.hyp = yaml.safe_load((checkout / "data/hyps/hyp.scratch-high.yaml").read_text())
    images, targets = batch[False][0].float() / 255, batch[False][1]
    preds = model(images)
    loss = full.loss(model)(preds, targets, masks)
    assert float(loss) == pytest.approx(float(ComputeLoss(model, overlap=False)(preds, targets, masks.float())[0]),
                                        rel=1e-5)  # upstream's loss, summed in another order (test_finetune)
    assert loss != SEGMENT.loss(model)(preds, targets, masks)  # the same masks read as one per image score otherwise


def test_masks_score_as_their_boxes_among_predictions_of_other_classes(checkout, nested_squares):
    """The evaluation makes masks only for the predictions of a labelled class (the others cannot match one); each
    of those masks must still be judged as its own prediction. Masks equal to their boxes score exactly as the boxes
    do: here each square is predicted as its own class, as the other labelled class and as a class no label has, at
    interleaved confidences, so a mask verdict given to another prediction, or one left out, changes the mask
    metrics and not the box ones. The matching's single CPU thread is scoped to it."""
    from models.core.task import SEGMENT
    from models.deployment.evaluate import evaluate, val_loader
    runner = _SquareSegmenter(3, [(120, 2, 0.95), (120, 0, 0.9), (120, 1, 0.85), (40, 1, 0.8), (40, 0, 0.7),
                                  (40, 2, 0.6)])
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # the matching runs on one thread: the forward passes get theirs back
    try:
        m = evaluate(runner, val_loader(SEGMENT, nested_squares, 160, 1, 0), SEGMENT, nc=3)
        assert torch.get_num_threads() == threads + 1
    finally:
        torch.set_num_threads(threads)
    assert 0.5 < m["ap"] < 0.99  # both instances found, class 1's behind a false positive of its class
    assert {k: m[f"mask_{k}"] for k in ("ap", "ap50", "precision", "recall")} == \
        {k: m[k] for k in ("ap", "ap50", "precision", "recall")}


def _coco128_seg(tmp_path: Path, val: int = 8, train: int = 16) -> Path:
    """shared/datasets/coco128-seg-416 as a yaml of absolute paths whose last `val` images are val and the first
    `train` train (it ships train = val, which a select split refuses): 16 train images carve into 8 fit and 8
    select."""
    src = SHARED / "datasets" / "coco128-seg-416"
    data = yaml.safe_load((src / "data.yaml").read_text())
    images = sorted(p for p in (src / data["train"]).iterdir() if p.suffix in (".jpg", ".png", ".webp"))
    for split, files in (("train", images[:-val][:train]), ("val", images[-val:])):
        (tmp_path / f"{split}.txt").write_text("".join(f"{f}\n" for f in files))
        data[split] = str(tmp_path / f"{split}.txt")
    data["path"] = str(src)
    (tmp_path / "coco128-seg.yaml").write_text(yaml.safe_dump(data))
    return tmp_path / "coco128-seg.yaml"


needs_coco128_seg = pytest.mark.skipif(SHARED is None or not (SHARED / "datasets" / "coco128-seg-416").is_dir(),
                                       reason="shared/datasets/coco128-seg-416 not found (set YOLOV9_QAT_SHARED)")


@needs_coco128_seg
def test_float_training_records_a_segmenter_from_upstreams_segment_train(checkout, tmp_path):
    """scripts/train_float.py with --train-script segment/train.py: upstream's real run (1 epoch on 8 COCO128
    photographs with polygons, 64 px; its select split 8 more) and its results.csv of box (B) and mask (M) columns,
    plus the final validation row segment/train.py appends without its loss columns, which is no epoch: the record
    has the box and mask curve on select, the best epoch by box + mask, and the weights' sha256. A segmenter trains
    on full instance masks (upstream's --no-overlap) unless --overlap is given, and its weights keep that for the
    fine-tune."""
    from models.quantization.checkpoint import read_checkpoint, trained_overlap
    from utils.provenance import sha256
    out = tmp_path / "out"
    cfg = REPO / "assets" / "gelan-t-seg.yaml"
    data = _coco128_seg(tmp_path)
    r = run_cli("scripts/train_float.py", "--data", data, "--cfg", cfg, "--name", "seg", "--out", out,
                "--train-script", "segment/train.py", "--imgsz", 64, "--batch", 32, "--epochs", 1, "--workers", 0,
                "--device", "cpu", "--project", tmp_path / "runs", "--split-dir", tmp_path / "split",
                "--weights-out", tmp_path / "w" / "seg.pt", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    header = (out / "results.csv").read_text().splitlines()[0]
    assert "metrics/mAP_0.5:0.95(M)" in header  # upstream's segmentation columns, read as they are
    t = json.loads((out / "train.json").read_text())
    assert t["epochs_run"] == 1 and t["best_epoch"] == 0 and t["model"] == "gelan-t-seg"
    assert {"best_select_map", "best_select_map50", "best_select_mask_map", "best_select_mask_map50"} <= set(t)
    assert t["weights_sha256"] == sha256(tmp_path / "w" / "seg.pt") and (out / "curve.png").stat().st_size > 0
    assert "masks" in r.stdout and t["upstream_args"]["no_overlap"] is True  # full instance masks, as scored
    assert trained_overlap(read_checkpoint(tmp_path / "w" / "seg.pt")) is False
    r = call_cli("scripts/train_float.py", "--data", tmp_path / "coco128-seg.yaml", "--cfg", "x.yaml", "--name", "d",
                 "--out", tmp_path / "d", "--no-overlap")  # upstream's train.py has no such flag
    assert r.returncode == 2 and "--no-overlap" in r.stderr and not (tmp_path / "d").exists()


@needs_coco128_seg
def test_benchmark_entry_of_a_segmenter_is_written_resumed_and_rendered(checkout, tmp_path):
    """scripts/benchmark_accuracy.py on a segmenter (the tiny GELAN with gelan-c-seg's head: its path, not its
    accuracy, so the fewest layers to export a dozen times; 24 COCO128 photographs with polygons at 128 px, 16 train
    (8 fit, 8 select) and 8 val; random weights: no COCO model exists offline): every measured stage carries box and
    mask metrics, the summary has the masks' own, the delivered graph and the PTQ graphs rebuilt from the kept
    ranges (FP32 and FP16, plain and end to end) have ONNX Runtime rows of both, lint clean; a second run reruns
    nothing; the tables render boxes and masks and pass --check."""
    from conftest import tiny_gelan
    from models.yolo import SegmentationModel
    data = _coco128_seg(tmp_path)
    cfg = tmp_path / "tiny-gelan-seg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_gelan(80, segment=True)))
    torch.manual_seed(0)
    model = SegmentationModel(str(cfg), nc=80).eval()
    weights = save_float_checkpoint(model, tmp_path / "tiny-gelan-seg.pt")
    out, work = tmp_path / "results", tmp_path / "work"
    args = ["--dataset", "coco128seg", "--models", f"tiny-gelan-seg={weights}", "--data", data, "--imgsz", 128,
            "--batch-size", 4, "--device", "cpu", "--workers", 0, "--seeds", 0, "--methods", "max", "--qat-epochs", 1,
            "--iters", 1, "--calib-batches", 1, "--skip", "fp_ft", "--work", work, "--out", out]
    r = run_cli("scripts/benchmark_accuracy.py", *args, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    r = run_cli("scripts/benchmark_accuracy.py", *args, "--add-ort", timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    e = json.loads((out / "coco128seg" / "tiny-gelan-seg" / "entry.json").read_text())
    both = {"ap", "ap50", "mask_ap", "mask_ap50"}
    measured = [e["fp"]["val"], e["fp"]["select"], e["ptq"]["max"]["0"]["val"], e["qat"]["0"]["val_final"],
                e["ort"]["fp32"]["0"]["val"], e["ort"]["fp16"]["0"]["val"],
                *(e["ort_ptq"]["0"][g]["val"] for g in ("fp32", "fp32_e2e", "fp16", "fp16_e2e"))]
    assert all(both <= set(m) for m in measured)
    assert "select_mask_by_epoch" in e["qat"]["0"] and e["qat"]["0"]["training_masks"] == "overlap"  # no record
    assert e["summary"]["mask"]["fp"]["values"] == [e["fp"]["val"]["mask_ap"]]
    assert all(e["ort_ptq"]["0"][g]["lint"]["unshared_joins"] == 0 for g in ("fp32", "fp16"))
    again = call_cli("scripts/benchmark_accuracy.py", *args)
    assert again.returncode == 0 and not [line for line in again.stdout.splitlines() if line.startswith("+ ")]
    rendered = (out / "accuracy.md").read_text()
    assert "**tiny-gelan-seg** on coco128seg, boxes" in rendered
    assert "**tiny-gelan-seg** on coco128seg, masks fine-tuned on one mask per image (" in rendered
    r = call_cli("scripts/benchmark_accuracy.py", "--render", "--check", "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
