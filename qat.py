"""INT8 quantization of reparameterized YOLOv9 / GELAN detection models for TensorRT.

    python qat.py quantize  --weights yolov9-c-converted.pt --data data/coco.yaml   # PTQ + QAT
    python qat.py eval      --weights runs/qat/exp/weights/qat_best_yolov9-c-converted.pt --data data/coco.yaml
    python qat.py sensitive --weights yolov9-c-converted.pt --data data/coco.yaml   # per-layer sensitivity
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

FILE = Path(__file__).resolve()
ROOT = FILE.parents[0]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from models.quantize import (CALIB_METHODS, QuantRecipe, calibrate_model, copy_float, is_quantized,  # noqa: E402
                             layer_quantizers, load_float_model, load_quantized_model, quantization_disabled,
                             quantize_model, quantizer_counts, read_checkpoint, save_checkpoint, skip_patterns)
from utils.general import LOGGER, colorstr, increment_path, init_seeds  # noqa: E402
from utils.io_utils import cli_main  # noqa: E402
from utils.qat_utils import (METRIC_KEYS, distill_epoch, evaluate, image_batches, load_data, load_hyp,  # noqa: E402
                             lr_at, metrics_table, supervised_layers, train_loader, val_loader, write_json)
from utils.torch_utils import select_device  # noqa: E402

PREFIX = colorstr("qat: ")


# --------------------------------------------------------------------------------------------------
# Shared steps
# --------------------------------------------------------------------------------------------------
def _setup(project, name, exist_ok, device, seed=None):
    device = select_device(device)
    if seed is not None:
        init_seeds(seed, deterministic=False)
    save_dir = Path(increment_path(Path(project) / name, exist_ok=exist_ok))
    (save_dir / "weights").mkdir(parents=True, exist_ok=True)
    return device, save_dir


def _stride(model) -> int:
    return max(int(model.stride.max()), 32)


def _insert_quantizers(model, calib_method, percentile, skip_layers):
    """Insert quantizers (with the TensorRT sharing rules). Returns counts and the time taken."""
    recipe = QuantRecipe(calib_method=calib_method, percentile=percentile, skip=skip_patterns(skip_layers))
    t0 = time.perf_counter()
    quantize_model(model, recipe)
    insert_s = time.perf_counter() - t0
    counts = quantizer_counts(model)
    LOGGER.info(f"{PREFIX}inserted {counts['distinct']} quantizers ({counts['weight']} weight, "
                f"{counts['activation']} activation) in {insert_s:.1f}s")
    return counts, insert_s


def _calibrate(model, data_dict, device, imgsz, batch_size, stride, hyp, workers, method, percentile,
               calib_batches):
    loader = train_loader(data_dict, imgsz, batch_size, stride, hyp, workers, augment=False)
    n = min(calib_batches, len(loader))
    batches = tqdm(image_batches(loader, device, n), total=n, desc=f"{PREFIX}calibrating ({method})")
    times = calibrate_model(model, batches, method, percentile)
    LOGGER.info(f"{PREFIX}calibration: collect {times['collect_s']:.1f}s, amax {times['compute_amax_s']:.1f}s")
    return times


def _print_report(rows):
    table = metrics_table(rows)
    LOGGER.info("\n" + table)
    return table


# --------------------------------------------------------------------------------------------------
# Sub-commands
# --------------------------------------------------------------------------------------------------
def run_quantize(weights, data, hyp, device, batch_size, imgsz, project, name, exist_ok, iters, epochs, seed,
                 supervision_stride, no_eval_origin, no_eval_ptq, calib_method, calib_batches, percentile,
                 skip_layers, lr, workers, num_image, conf_thres, iou_thres, **_):
    device, save_dir = _setup(project, name, exist_ok, device, seed)
    data_dict, hyp_dict = load_data(data), load_hyp(hyp)
    model = load_float_model(weights, device)
    stride = _stride(model)
    val = val_loader(data_dict, imgsz, batch_size * 2, stride, workers, num_image)
    stem = Path(weights).stem
    report = {"weights": str(weights), "data": str(data), "imgsz": imgsz, "batch_size": batch_size,
              "device": str(device), "calib_method": calib_method, "calib_batches": calib_batches,
              "percentile": percentile if calib_method == "percentile" else None,
              "skip_layers": list(skip_layers), "epochs": epochs, "iters": iters,
              "supervision_stride": supervision_stride, "lr": lr, "save_dir": str(save_dir)}

    report["origin"] = None if no_eval_origin else evaluate(model, val, data_dict, conf_thres, iou_thres,
                                                            "origin (float)")
    teacher = copy_float(model)
    counts, insert_s = _insert_quantizers(model, calib_method, percentile, skip_layers)
    report["quantizers"] = counts
    times = _calibrate(model, data_dict, device, imgsz, batch_size, stride, hyp_dict, workers, calib_method,
                       percentile, calib_batches)
    report["timing"] = {"insert_quantizers_s": round(insert_s, 2), "calib_collect_s": round(times["collect_s"], 2),
                        "calib_amax_s": round(times["compute_amax_s"], 2)}
    report["ptq"] = None
    if not no_eval_ptq:
        report["ptq"] = evaluate(model, val, data_dict, conf_thres, iou_thres, "PTQ (int8 fake-quant)")
    ptq_file = save_dir / "weights" / f"ptq_ap_{_ap_tag(report['ptq'])}_{stem}.pt"
    report["ptq_file"] = str(save_checkpoint(model, ptq_file, stage="ptq", metrics=report["ptq"]))

    report["qat"] = []
    best = None
    if epochs > 0 and iters > 0:
        layers = supervised_layers(len(model.model), supervision_stride)
        loader = train_loader(data_dict, imgsz, batch_size, stride, hyp_dict, workers, augment=True)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" else None
        for epoch in range(epochs):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(epoch, epochs, lr)
            t0 = time.perf_counter()
            loss = distill_epoch(model, teacher, image_batches(loader, device, iters), layers, optimizer, scaler,
                                 f"{PREFIX}epoch {epoch + 1}/{epochs}", iters)
            train_s = time.perf_counter() - t0
            metrics = evaluate(model, val, data_dict, conf_thres, iou_thres, f"QAT epoch {epoch + 1}")
            f = save_dir / "weights" / f"qat_ep_{epoch + 1}_ap_{_ap_tag(metrics)}_{stem}.pt"
            save_checkpoint(model, f, stage="qat", epoch=epoch + 1, metrics=metrics)
            entry = {"epoch": epoch + 1, "loss": round(loss, 6), "lr": optimizer.param_groups[0]["lr"],
                     "train_s": round(train_s, 2), **metrics, "file": str(f)}
            report["qat"].append(entry)
            if best is None or metrics["ap"] > best["ap"]:
                best = entry
                save_checkpoint(model, save_dir / "weights" / f"qat_best_{stem}.pt", stage="qat", epoch=epoch + 1,
                                metrics=metrics)
            write_json(save_dir / "report.json", report)
    report["qat_best"] = best
    if best is not None:
        report["qat_best_file"] = str(save_dir / "weights" / f"qat_best_{stem}.pt")
    rows = [("Origin (PyTorch)", report["origin"]), ("PTQ (PyTorch INT8)", report["ptq"]),
            ("QAT best (PyTorch INT8)", _metrics_only(best))]
    report["table"] = _print_report(rows)
    write_json(save_dir / "report.json", report)
    LOGGER.info(f"{PREFIX}results saved to {colorstr('bold', save_dir)}")
    return report


def run_eval(weights, data, device, batch_size, imgsz, project, name, exist_ok, workers, num_image, conf_thres,
             iou_thres, **_):
    device, save_dir = _setup(project, name, exist_ok, device)
    data_dict = load_data(data)
    model = load_quantized_model(weights, device)
    val = val_loader(data_dict, imgsz, batch_size, _stride(model), workers, num_image)
    t0 = time.perf_counter()
    metrics = evaluate(model, val, data_dict, conf_thres, iou_thres, f"{weights}")
    result = {"weights": str(weights), "data": str(data), "imgsz": imgsz, **metrics,
              "eval_s": round(time.perf_counter() - t0, 2), "quantizers": quantizer_counts(model)}
    result["table"] = _print_report([(f"INT8 (PyTorch) {Path(weights).name}", metrics)])
    write_json(save_dir / "eval.json", result)
    return result


def run_sensitive(weights, data, hyp, device, batch_size, imgsz, project, name, exist_ok, calib_method,
                  calib_batches, percentile, workers, num_image, conf_thres, iou_thres, seed, **_):
    device, save_dir = _setup(project, name, exist_ok, device, seed)
    data_dict, hyp_dict = load_data(data), load_hyp(hyp)
    ckpt = read_checkpoint(weights)
    if is_quantized(ckpt["model"]):
        raise ValueError(f"--weights {weights}: sensitivity analysis starts from the float (converted) model, "
                         "not a quantized one")
    model = load_float_model(weights, device)
    stride = _stride(model)
    val = val_loader(data_dict, imgsz, batch_size, stride, workers, num_image)
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
    order = sorted(layers, key=lambda d: d["layer"])
    fig, ax = plt.subplots(figsize=(max(6, len(order) * 0.35), 4))
    ax.bar([str(d["layer"]) for d in order], [d["ap_gain"] for d in order], color="tab:blue")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("layer kept in float")
    ax.set_ylabel("AP gain over full INT8 PTQ")
    ax.set_title(f"Quantization sensitivity (PTQ AP {baseline['ap']:.4f})")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def _ap_tag(metrics) -> str:
    return "na" if metrics is None else f"{metrics['ap']:.4f}"


def _metrics_only(entry):
    return None if entry is None else {k: entry[k] for k in METRIC_KEYS}


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def _common(p, project):
    p.add_argument("--weights", type=str, required=True, help="model.pt path")
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


def _calibration(p):
    p.add_argument("--hyp", type=str, default=str(ROOT / "data/hyps/hyp.scratch-high.yaml"), help="hyperparameters path")
    p.add_argument("--calib-method", choices=CALIB_METHODS, default="mse",
                   help="activation amax: max, or from a histogram by mse / percentile / entropy")
    p.add_argument("--calib-batches", type=int, default=25, help="batches of training images used for calibration")
    p.add_argument("--percentile", type=float, default=99.999, help="percentile for --calib-method percentile")


def parse_opt(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    q = sub.add_parser("quantize", help="insert quantizers, calibrate (PTQ), fine-tune (QAT), save the best")
    _common(q, "runs/qat")
    _calibration(q)
    q.add_argument("--iters", type=int, default=200, help="QAT iterations per epoch")
    q.add_argument("--epochs", type=int, default=10, help="QAT epochs (0: PTQ only)")
    q.add_argument("--lr", type=float, default=1e-5, help="peak QAT learning rate (Adam)")
    q.add_argument("--supervision-stride", type=int, default=1, help="supervise every N-th layer's output")
    q.add_argument("--skip-layers", nargs="*", default=[], help="layer indices or module-name regexes kept in float")
    q.add_argument("--no-eval-origin", action="store_true", help="do not evaluate the float model")
    q.add_argument("--no-eval-ptq", action="store_true", help="do not evaluate the PTQ model")

    s = sub.add_parser("sensitive", help="per-layer quantization sensitivity of a float model")
    _common(s, "runs/qat_sensitive")
    _calibration(s)

    e = sub.add_parser("eval", help="evaluate a quantized checkpoint")
    _common(e, "runs/qat_eval")
    opt = parser.parse_args(argv)
    _check(parser, opt)
    return opt


def _check(parser, opt):
    if opt.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {opt.batch_size}")
    if opt.imgsz < 32 or opt.imgsz % 32:
        parser.error(f"--imgsz must be a multiple of 32 (>= 32), got {opt.imgsz}")
    if getattr(opt, "calib_batches", 1) < 1:
        parser.error(f"--calib-batches must be >= 1, got {opt.calib_batches}")
    if getattr(opt, "supervision_stride", 1) < 1:
        parser.error(f"--supervision-stride must be >= 1, got {opt.supervision_stride}")
    if opt.num_image is not None and opt.num_image < 1:
        parser.error(f"--num-image must be >= 1, got {opt.num_image}")
    if not 0 <= getattr(opt, "percentile", 50) <= 100:
        parser.error(f"--percentile must be in [0, 100], got {opt.percentile}")
    try:
        skip_patterns(getattr(opt, "skip_layers", []))
    except ValueError as e:
        parser.error(str(e))


def run(cmd: str, **kwargs):
    return {"quantize": run_quantize, "eval": run_eval, "sensitive": run_sensitive}[cmd](**kwargs)


def main(argv=None) -> int:
    return cli_main("qat.py", parse_opt, run, argv)


if __name__ == "__main__":
    sys.exit(main())
