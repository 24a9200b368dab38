"""INT8 quantization of reparameterized YOLOv9 / GELAN detection and segmentation models for TensorRT.

    python qat.py quantize  --weights yolov9-c-converted.pt --data data/coco.yaml   # PTQ + QAT
    python qat.py quantize  --resume runs/qat/exp                                   # continue an interrupted run
    python qat.py eval      --weights runs/qat/exp/weights/qat_best_yolov9-c-converted.pt --data data/coco.yaml
    python qat.py sensitive --weights yolov9-c-converted.pt --data data/coco.yaml   # per-layer sensitivity
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

FILE = Path(__file__).resolve()
ROOT = FILE.parents[0]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from models.checkpoint import load_float_model, load_quantized_model, read_checkpoint, save_checkpoint  # noqa: E402
from models.finetune import (DISTILL_TARGETS, LR_SCHEDULES, RECIPES, QATObjective, QATRecipe,  # noqa: E402
                             WeightEMA, finetune_epoch, optimizer_for)
from models.quantize import (CALIB_METHODS, QuantRecipe, calibrate_model, copy_float, is_quantized,  # noqa: E402
                             layer_quantizers, learnable_amax_parameters, quantization_disabled, quantize_model,
                             quantizer_counts, skip_patterns)
from utils.general import LOGGER, colorstr, increment_path, init_seeds  # noqa: E402
from utils.io_utils import Interrupted, cli_main  # noqa: E402
from utils.qat_utils import (METRIC_KEYS, MASK_METRIC_KEYS, evaluate, image_batches, load_data,  # noqa: E402
                             load_hyp, metrics_table, selection_score, task_of, train_batches, train_loader,
                             val_loader, write_json)
from utils.torch_utils import select_device  # noqa: E402

PREFIX = colorstr("qat: ")
STATE_FILE = "qat_state.pt"  # model, EMA and optimizer after the last completed QAT epoch (for --resume)
RESUME_KEEPS = ("device", "workers", "trust_checkpoint")  # what a resumed run takes from the new command line


# --------------------------------------------------------------------------------------------------
# Shared steps
# --------------------------------------------------------------------------------------------------
def _new_run_dir(project, name, exist_ok) -> Path:
    """Created only once the inputs were validated: a failed start leaves no empty folder behind."""
    save_dir = Path(increment_path(Path(project) / name, exist_ok=exist_ok))
    save_dir.mkdir(parents=True, exist_ok=True)
    return save_dir


def _stride(model) -> int:
    return max(int(model.stride.max()), 32)


def _check_classes(model, data_dict: dict, weights, data) -> None:
    model_nc, data_nc = int(model.model[-1].nc), int(data_dict["nc"])
    if model_nc != data_nc:
        raise ValueError(f"--weights {weights} predicts {model_nc} classes but --data {data} has nc={data_nc}: "
                         "evaluate a model on the dataset it was trained for")


def _check_skip_layers(model, skip_layers) -> None:
    names = [n for n, _ in model.named_modules()]
    unmatched = [item for item, pattern in zip(skip_layers, skip_patterns(skip_layers))
                 if not any(re.search(pattern, n) for n in names)]
    if unmatched:
        raise ValueError(f"--skip-layers {' '.join(map(str, unmatched))}: matches no module of the model "
                         f"(layers are 0-{len(model.model) - 1}, or regexes over names like 'model.22.cv2')")


def _insert_quantizers(model, calib_method, percentile, skip_layers, share_rules=True):
    """Insert quantizers (with the TensorRT sharing rules). Returns counts and the time taken."""
    recipe = QuantRecipe(calib_method=calib_method, percentile=percentile, skip=skip_patterns(skip_layers),
                         share_rules=share_rules)
    t0 = time.perf_counter()
    quantize_model(model, recipe)
    insert_s = time.perf_counter() - t0
    counts = quantizer_counts(model)
    LOGGER.info(f"{PREFIX}inserted {counts['distinct']} quantizers ({counts['weight']} weight, "
                f"{counts['activation']} activation) in {insert_s:.1f}s")
    return counts, insert_s


def _calibrate(model, data_dict, device, imgsz, batch_size, stride, hyp, workers, method, percentile,
               calib_batches):
    loader = train_loader(data_dict, imgsz, batch_size, stride, hyp, workers, augment=False, task=task_of(model))
    n = min(calib_batches, len(loader))
    batches = tqdm(image_batches(loader, device, n), total=n, desc=f"{PREFIX}calibrating ({method})")
    times = calibrate_model(model, batches, method, percentile)
    LOGGER.info(f"{PREFIX}calibration: collect {times['collect_s']:.1f}s, amax {times['compute_amax_s']:.1f}s")
    return times


def _print_report(rows):
    table = metrics_table(rows)
    LOGGER.info("\n" + table)
    return table


def qat_recipe(recipe: str, **overrides) -> QATRecipe:
    """A preset with the fields given on the command line replaced."""
    return RECIPES[recipe].with_overrides(**overrides)


# --------------------------------------------------------------------------------------------------
# quantize: PTQ, then QAT; resumable
# --------------------------------------------------------------------------------------------------
def run_quantize(resume=None, **opt):
    """`qat.py quantize`. With `resume`, the run folder's own settings are used (and device/workers anew)."""
    if resume:
        save_dir = Path(resume)
        settings = _resume_settings(save_dir)
        settings.update({k: opt[k] for k in RESUME_KEEPS if k in opt})
        report = json.loads((save_dir / "report.json").read_text())
        for leftover in save_dir.rglob(".*.tmp"):  # half-written files of the interrupted run
            leftover.unlink()
        LOGGER.info(f"{PREFIX}resuming {save_dir} after {len(report.get('qat', []))} completed QAT epoch(s)")
        return _quantize(save_dir, report, **settings)
    inputs = _validated_inputs(**opt)
    save_dir = _new_run_dir(opt["project"], opt["name"], opt["exist_ok"])
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in opt.items()},
              "weights": str(opt["weights"]), "data": str(opt["data"]), "save_dir": str(save_dir)}
    return _quantize(save_dir, report, inputs=inputs, **opt)


def _resume_settings(save_dir: Path) -> dict:
    report_file = save_dir / "report.json"
    if not report_file.is_file():
        raise FileNotFoundError(f"--resume {save_dir}: no report.json there; is it a `qat.py quantize` run folder?")
    report = json.loads(report_file.read_text())
    if "settings" not in report:
        raise ValueError(f"--resume {save_dir}: its report.json was written by an older version (no settings)")
    if report.get("finished"):
        raise ValueError(f"--resume {save_dir}: this run finished all its epochs; nothing to resume")
    return dict(report["settings"])


def _validated_inputs(weights, data, hyp, device, batch_size, imgsz, workers, num_image, skip_layers,
                      trust_checkpoint, epochs, iters, **_) -> dict:
    """Everything checked before a run folder exists: files, class counts, labels, layer patterns."""
    device = select_device(device)
    data_dict = load_data(data)
    hyp_dict = load_hyp(hyp)
    model = load_float_model(weights, device, trust_checkpoint)
    _check_classes(model, data_dict, weights, data)
    _check_skip_layers(model, skip_layers)
    task = task_of(model)
    val = val_loader(data_dict, imgsz, batch_size * 2, _stride(model), workers, num_image, data, task)
    if epochs > 0 and iters > 0:
        train_loader(data_dict, imgsz, batch_size, _stride(model), hyp_dict, workers, augment=False, task=task)
    return {"device": device, "data_dict": data_dict, "hyp_dict": hyp_dict, "model": model, "val": val}


def _quantize(save_dir: Path, report: dict, weights, data, hyp, device, batch_size, imgsz, iters, epochs, seed,
              no_eval_origin, no_eval_ptq, calib_method, calib_batches, percentile, skip_layers, workers, num_image,
              conf_thres, iou_thres, trust_checkpoint, recipe, no_share_rules=False, inputs=None, **overrides):
    inputs = inputs or _validated_inputs(weights, data, hyp, device, batch_size, imgsz, workers, num_image,
                                         skip_layers, trust_checkpoint, epochs, iters)
    device, data_dict, hyp_dict, model, val = (inputs[k] for k in ("device", "data_dict", "hyp_dict", "model", "val"))
    qat = qat_recipe(recipe, **{k: overrides.get(k) for k in QATRecipe.__dataclass_fields__})
    report.update({"qat_recipe": qat.to_dict(), "calib_method": calib_method, "epochs": epochs, "iters": iters})
    stem = Path(weights).stem
    try:
        teacher = copy_float(model)
        if report.get("ptq_file") and Path(report["ptq_file"]).is_file():  # resumed after PTQ
            model = load_quantized_model(report["ptq_file"], device)
        else:
            _ptq_stage(model, report, save_dir, stem, data_dict, hyp_dict, device, imgsz, batch_size, workers, val,
                       calib_method, calib_batches, percentile, skip_layers, no_eval_origin, no_eval_ptq, conf_thres,
                       iou_thres, not no_share_rules)
        if epochs > 0 and iters > 0:
            _qat_stage(model, teacher, qat, report, save_dir, stem, data_dict, hyp_dict, device, imgsz, batch_size,
                       workers, val, epochs, iters, seed, conf_thres, iou_thres)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; resume with: python qat.py quantize --resume {save_dir}") from None
    best = report.get("qat_best")
    rows = [("Origin (PyTorch)", report.get("origin")), ("PTQ (PyTorch INT8)", report.get("ptq")),
            ("QAT best (PyTorch INT8)", None if best is None else {k: best[k] for k in METRIC_KEYS + MASK_METRIC_KEYS
                                                                   if k in best})]
    report["table"] = _print_report(rows)
    report["finished"] = True
    (save_dir / "weights" / STATE_FILE).unlink(missing_ok=True)  # only needed to resume an unfinished run
    write_json(save_dir / "report.json", report)
    LOGGER.info(f"{PREFIX}results saved to {colorstr('bold', save_dir)}")
    return report


def _ptq_stage(model, report, save_dir, stem, data_dict, hyp_dict, device, imgsz, batch_size, workers, val,
               calib_method, calib_batches, percentile, skip_layers, no_eval_origin, no_eval_ptq, conf_thres,
               iou_thres, share_rules=True):
    report["origin"] = None if no_eval_origin else evaluate(model, val, data_dict, conf_thres, iou_thres,
                                                            "origin (float)")
    write_json(save_dir / "report.json", report)
    counts, insert_s = _insert_quantizers(model, calib_method, percentile, skip_layers, share_rules)
    report["quantizers"] = counts
    times = _calibrate(model, data_dict, device, imgsz, batch_size, _stride(model), hyp_dict, workers, calib_method,
                       percentile, calib_batches)
    report["timing"] = {"insert_quantizers_s": round(insert_s, 2), "calib_collect_s": round(times["collect_s"], 2),
                        "calib_amax_s": round(times["compute_amax_s"], 2)}
    report["ptq"] = None if no_eval_ptq else evaluate(model, val, data_dict, conf_thres, iou_thres,
                                                      "PTQ (int8 fake-quant)")
    ptq_file = save_dir / "weights" / f"ptq_ap_{_ap_tag(report['ptq'])}_{stem}.pt"
    report["ptq_file"] = str(save_checkpoint(model, ptq_file, stage="ptq", metrics=report["ptq"]))
    report["qat"] = []
    write_json(save_dir / "report.json", report)


def _qat_stage(model, teacher, recipe: QATRecipe, report, save_dir, stem, data_dict, hyp_dict, device, imgsz,
               batch_size, workers, val, epochs, iters, seed, conf_thres, iou_thres):
    """QAT epochs; after each: evaluation, checkpoints, report.json and the state `--resume` continues from."""
    state_file = save_dir / "weights" / STATE_FILE
    state = read_checkpoint(state_file, flag="--resume") if state_file.is_file() else None
    if state is not None:
        model = state["model"].to(device)
    if recipe.learn_amax:
        learnable_amax_parameters(model)
    optimizer = optimizer_for(model, recipe)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" else None
    ema = WeightEMA(model, recipe.ema) if recipe.ema else None
    start, step = 0, 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if ema is not None:
            ema.model, ema.updates = state["ema"].to(device), state["ema_updates"]
        start, step = state["epoch"], state["step"]
    # epochs past the saved state are run again (seeded: the same); their entries would be duplicates
    report["qat"] = report.get("qat", [])[:start]
    kept = [e for e in report["qat"] if e["epoch"] <= start]
    report["qat_best"] = max(kept, key=selection_score) if kept else None
    loader = train_loader(data_dict, imgsz, batch_size, _stride(model), hyp_dict, workers, augment=True,
                          task=task_of(model))
    with QATObjective(recipe, model, teacher, hyp_dict) as objective:
        for epoch in range(start, epochs):
            t0 = time.perf_counter()
            batches = train_batches(loader, device, iters, seed=seed + 1 + epoch)
            losses, step = finetune_epoch(objective, batches, optimizer, scaler, ema, step, epochs * iters, epochs,
                                          iters, f"{PREFIX}epoch {epoch + 1}/{epochs}")
            train_s = time.perf_counter() - t0
            trained = ema.model if ema is not None else model
            metrics = evaluate(trained, val, data_dict, conf_thres, iou_thres, f"QAT epoch {epoch + 1}")
            f = save_dir / "weights" / f"qat_ep_{epoch + 1}_ap_{_ap_tag(metrics)}_{stem}.pt"
            save_checkpoint(trained, f, stage="qat", epoch=epoch + 1, metrics=metrics)
            entry = {"epoch": epoch + 1, **{k: round(v, 6) for k, v in losses.items()},
                     "lr_end": optimizer.param_groups[0]["lr"], "train_s": round(train_s, 2), **metrics,
                     "file": str(f)}
            report["qat"].append(entry)
            best = report.get("qat_best")
            if best is None or selection_score(metrics) > selection_score(best):
                report["qat_best"] = entry
                report["qat_best_file"] = str(save_checkpoint(trained, save_dir / "weights" / f"qat_best_{stem}.pt",
                                                              stage="qat", epoch=epoch + 1, metrics=metrics))
            # report first: a kill between the two repeats this epoch (the same, it is seeded) rather than lose it
            write_json(save_dir / "report.json", report)
            save_checkpoint(model, state_file, epoch=epoch + 1, step=step, optimizer=optimizer.state_dict(),
                            scaler=None if scaler is None else scaler.state_dict(),
                            **({} if ema is None else {"ema": ema.model, "ema_updates": ema.updates}))


# --------------------------------------------------------------------------------------------------
# eval and sensitive
# --------------------------------------------------------------------------------------------------
def run_eval(weights, data, device, batch_size, imgsz, project, name, exist_ok, workers, num_image, conf_thres,
             iou_thres, trust_checkpoint, **_):
    device = select_device(device)
    data_dict = load_data(data)
    model = load_quantized_model(weights, device, trust_checkpoint)
    _check_classes(model, data_dict, weights, data)
    val = val_loader(data_dict, imgsz, batch_size, _stride(model), workers, num_image, data, task_of(model))
    save_dir = _new_run_dir(project, name, exist_ok)
    t0 = time.perf_counter()
    metrics = evaluate(model, val, data_dict, conf_thres, iou_thres, f"{weights}")
    result = {"weights": str(weights), "data": str(data), "imgsz": imgsz, **metrics,
              "eval_s": round(time.perf_counter() - t0, 2), "quantizers": quantizer_counts(model)}
    result["table"] = _print_report([(f"INT8 (PyTorch) {Path(weights).name}", metrics)])
    write_json(save_dir / "eval.json", result)
    return result


def run_sensitive(weights, data, hyp, device, batch_size, imgsz, project, name, exist_ok, calib_method,
                  calib_batches, percentile, workers, num_image, conf_thres, iou_thres, seed, trust_checkpoint, **_):
    device = select_device(device)
    init_seeds(seed, deterministic=False)
    data_dict, hyp_dict = load_data(data), load_hyp(hyp)
    if is_quantized(read_checkpoint(weights, trust_checkpoint)["model"]):
        raise ValueError(f"--weights {weights}: sensitivity analysis starts from the float (converted) model, "
                         "not a quantized one")
    model = load_float_model(weights, device, trust_checkpoint)
    _check_classes(model, data_dict, weights, data)
    stride = _stride(model)
    val = val_loader(data_dict, imgsz, batch_size, stride, workers, num_image, data, task_of(model))
    save_dir = _new_run_dir(project, name, exist_ok)
    _insert_quantizers(model, calib_method, percentile, [])
    _calibrate(model, data_dict, device, imgsz, batch_size, stride, hyp_dict, workers, calib_method, percentile,
               calib_batches)
    baseline = evaluate(model, val, data_dict, conf_thres, iou_thres, "PTQ baseline (all layers INT8)")
    layers = []
    for i in range(len(model.model)):
        quantizers = layer_quantizers(model, i)
        if not quantizers:
            continue
        with quantization_disabled(quantizers):
            metrics = evaluate(model, val, data_dict, conf_thres, iou_thres,
                               f"layer {i} ({type(model.model[i]).__name__}) in float")
        layers.append({"layer": i, "module": type(model.model[i]).__name__, **metrics,
                       "ap_gain": round(metrics["ap"] - baseline["ap"], 5)})
    ranked = sorted(layers, key=lambda d: d["ap"], reverse=True)
    summary = {"weights": str(weights), "data": str(data), "calib_method": calib_method, "baseline_ptq": baseline,
               "layers": ranked}
    top = ranked[:10]
    lines = ["| Rank | Layer | Module | AP (layer float) | AP gain vs PTQ | AP50 |", "|---|---|---|---|---|---|"]
    lines += [f"| {k + 1} | {d['layer']} | {d['module']} | {d['ap']:.4f} | {d['ap_gain']:+.4f} | {d['ap50']:.4f} |"
              for k, d in enumerate(top)]
    summary["table"] = "\n".join(lines)
    LOGGER.info(f"\nPTQ baseline AP {baseline['ap']:.4f}; the most sensitive layers:\n" + summary["table"])
    write_json(save_dir / "summary-sensitive-analysis.json", summary)
    _bar_chart(ranked, baseline, save_dir / "sensitive-analysis.png")
    LOGGER.info(f"{PREFIX}results saved to {colorstr('bold', save_dir)}")
    return summary


def _bar_chart(layers, baseline, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from utils.io_utils import atomic_write
    order = sorted(layers, key=lambda d: d["layer"])
    fig, ax = plt.subplots(figsize=(max(6, len(order) * 0.35), 4))
    ax.bar([str(d["layer"]) for d in order], [d["ap_gain"] for d in order], color="tab:blue")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("layer kept in float")
    ax.set_ylabel("AP gain over full INT8 PTQ")
    ax.set_title(f"Quantization sensitivity (PTQ AP {baseline['ap']:.4f})")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def _ap_tag(metrics) -> str:
    return "na" if metrics is None else f"{metrics['ap']:.4f}"


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def _common(p, project, weights_required=True):
    p.add_argument("--weights", type=str, required=weights_required, help="model.pt path")
    p.add_argument("--data", type=str, default=str(ROOT / "data/coco.yaml"), help="dataset.yaml path")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   help="cuda device, i.e. cuda:0 or cpu")
    p.add_argument("--batch-size", type=int, default=10, help="total batch size")
    p.add_argument("--imgsz", "--img", "--img-size", type=int, default=640, help="train, val image size (pixels)")
    p.add_argument("--project", default=str(ROOT / project), help="save to project/name")
    p.add_argument("--name", default="exp", help="save to project/name")
    p.add_argument("--exist-ok", action="store_true", help="existing project/name ok, do not increment")
    p.add_argument("--workers", type=int, default=8, help="max dataloader workers")
    p.add_argument("--num-image", type=int, default=None, help="evaluate on the first N validation images only")
    p.add_argument("--conf-thres", type=float, default=0.001, help="confidence threshold")
    p.add_argument("--iou-thres", type=float, default=0.7, help="NMS IoU threshold")
    p.add_argument("--seed", type=int, default=57, help="global training seed")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle --weights fully if it holds objects outside the YOLO allow-list (can run code)")


def _calibration(p):
    p.add_argument("--hyp", type=str, default=str(ROOT / "data/hyps/hyp.scratch-high.yaml"), help="hyperparameters path")
    p.add_argument("--calib-method", choices=CALIB_METHODS, default="mse",
                   help="activation amax: max, or from a histogram by mse / percentile / entropy")
    p.add_argument("--calib-batches", type=int, default=25, help="batches of training images used for calibration")
    p.add_argument("--percentile", type=float, default=99.999, help="percentile for --calib-method percentile")


def _qat_flags(q):
    q.add_argument("--iters", type=int, default=200, help="QAT iterations per epoch")
    q.add_argument("--epochs", type=int, default=10, help="QAT epochs (0: PTQ only)")
    q.add_argument("--recipe", choices=sorted(RECIPES), default="default",
                   help="QAT preset: default (measured best, docs/RESULTS.md) or reference (per-layer MSE, Adam 1e-5); "
                        "the flags below override single fields")
    q.add_argument("--distill", choices=DISTILL_TARGETS, default=None,
                   help="distillation target: head outputs, every layer's output (MSE), or none")
    q.add_argument("--supervision-stride", type=int, default=None, help="--distill layers: every N-th layer")
    q.add_argument("--det-loss", type=float, default=None, help="weight of the detection loss on labels (0: off)")
    q.add_argument("--lr", type=float, default=None, help="peak QAT learning rate (Adam)")
    q.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None,
                   help="cosine (warm-up + cosine decay per iteration) or step (the reference's)")
    q.add_argument("--learn-amax", action=argparse.BooleanOptionalAction, default=None,
                   help="train the activation ranges (amax) too")
    q.add_argument("--ema", type=float, default=None, help="weight EMA decay (0: off)")
    q.add_argument("--skip-layers", nargs="*", default=[], help="layer indices or module-name regexes kept in float")
    q.add_argument("--no-share-rules", action="store_true",
                   help="measurement only: no TensorRT scale sharing (the export gets reformat layers in TensorRT)")
    q.add_argument("--no-eval-origin", action="store_true", help="do not evaluate the float model")
    q.add_argument("--no-eval-ptq", action="store_true", help="do not evaluate the PTQ model")
    q.add_argument("--resume", type=str, default=None, metavar="RUN_DIR",
                   help="continue an interrupted run from its last completed stage (its own settings are used)")


def parse_opt(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    q = sub.add_parser("quantize", help="insert quantizers, calibrate (PTQ), fine-tune (QAT), save the best")
    _common(q, "runs/qat", weights_required=False)
    _calibration(q)
    _qat_flags(q)

    s = sub.add_parser("sensitive", help="per-layer quantization sensitivity of a float model")
    _common(s, "runs/qat_sensitive")
    _calibration(s)

    e = sub.add_parser("eval", help="evaluate a quantized checkpoint")
    _common(e, "runs/qat_eval")
    opt = parser.parse_args(argv)
    _check(parser, opt)
    return opt


def _check(parser, opt):
    if opt.cmd == "quantize" and not (opt.weights or opt.resume):
        parser.error("--weights is required (or --resume RUN_DIR)")
    if opt.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {opt.batch_size}")
    if opt.imgsz < 32 or opt.imgsz % 32:
        parser.error(f"--imgsz must be a multiple of 32 (>= 32), got {opt.imgsz}")
    if getattr(opt, "calib_batches", 1) < 1:
        parser.error(f"--calib-batches must be >= 1, got {opt.calib_batches}")
    if opt.num_image is not None and opt.num_image < 1:
        parser.error(f"--num-image must be >= 1, got {opt.num_image}")
    if not 0 <= getattr(opt, "percentile", 50) <= 100:
        parser.error(f"--percentile must be in [0, 100], got {opt.percentile}")
    if opt.cmd == "quantize":
        if opt.epochs < 0 or opt.iters < 0:
            parser.error("--epochs and --iters must be >= 0")
        try:
            skip_patterns(opt.skip_layers)
            qat_recipe(opt.recipe, **{k: getattr(opt, k) for k in QATRecipe.__dataclass_fields__})
        except ValueError as e:
            parser.error(str(e))


def run(cmd: str, **kwargs):
    return {"quantize": run_quantize, "eval": run_eval, "sensitive": run_sensitive}[cmd](**kwargs)


def main(argv=None) -> int:
    return cli_main("qat.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
