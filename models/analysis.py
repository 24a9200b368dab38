"""`qat.py eval` and `qat.py sensitive`: the metrics of a quantized checkpoint on the val images, and what each
INT8 tensor class of a float model costs on the select split (PTQ, then each class alone in float: the per-candidate
costs that `quantize --max-loss` measures, models/mixed_precision.py)."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from models.core.distributed import world_from_env
from models.core.task import task_of
from models.deployment.evaluate import metrics_table, val_loader
from models.mixed_precision import costs_of, float_candidates
from models.pipeline import (PREFIX, Inputs, RunConfig, check_classes, load_inputs, measure, measure_each_in_float,
                             open_select_split, train_loader)
from models.quantization.checkpoint import load_quantized_model, read_checkpoint
from models.quantization.quantize import backend_of, calibrate, is_quantized, quantize_model, quantizer_counts
from utils.batches import load_data, seeded_batches
from utils.general import LOGGER, colorstr
from utils.io_utils import OutputDir, atomic_write, write_json
from utils.torch_utils import select_device


def single_process(command: str) -> None:
    if world_from_env().distributed:
        raise ValueError(f"qat.py {command} runs in one process: start it without torchrun")


def evaluate_checkpoint(cfg: RunConfig, out: OutputDir) -> dict:
    """`qat.py eval`: the metrics of a quantized checkpoint on the validation images."""
    single_process("eval")
    device = select_device(cfg.device)
    data_dict = load_data(cfg.data)
    model = load_quantized_model(cfg.weights, device, cfg.trust_checkpoint)
    check_classes(model, data_dict, cfg.weights, cfg.data)
    task = task_of(model)
    val = val_loader(task, data_dict, cfg.imgsz, cfg.batch_size, cfg.workers, cfg.num_image, cfg.data)
    save_dir = out.create()
    t0 = time.perf_counter()
    inputs = Inputs(device, data_dict, model, task, val)
    metrics = measure(model, inputs, cfg.nms, str(cfg.weights))
    result = {"weights": str(cfg.weights), "data": str(cfg.data), "imgsz": cfg.imgsz, "task": task.name, **metrics,
              "eval_s": round(time.perf_counter() - t0, 2), "backend": backend_of(model),
              "quantizers": quantizer_counts(model)}
    result["table"] = metrics_table([(f"INT8 (PyTorch, {result['backend']}) {Path(cfg.weights).name}", metrics)])
    LOGGER.info("\n" + result["table"])
    write_json(save_dir / "eval.json", result)
    return result


def sensitivity(cfg: RunConfig, out: OutputDir) -> dict:
    """`qat.py sensitive`: PTQ with every quantizer, then each INT8 tensor class alone in float, measured on the
    select split."""
    single_process("sensitive")
    if is_quantized(read_checkpoint(cfg.weights, cfg.trust_checkpoint)["model"]):
        raise ValueError(f"--weights {cfg.weights}: sensitivity analysis starts from the float (converted) model, "
                         "not a quantized one")
    inputs = load_inputs(replace(cfg, epochs=0))
    save_dir = out.create()
    open_select_split(inputs, cfg, save_dir / "split")
    model = inputs.model
    origin = measure(model, inputs, cfg.nms, "origin (float)", "select")
    quantize_model(model, cfg.quant)
    loader = train_loader(inputs.task, inputs.data_dict, cfg, inputs.hyp_dict, augment=False)
    n = min(cfg.quant.calib_batches, len(loader))
    images = (b.images for b in seeded_batches(loader, inputs.device, n, cfg.seed))
    calibrate(model, cfg.quant, tqdm(images, total=n, desc=f"{PREFIX}calibrating"))
    task = inputs.task
    baseline = measure(model, inputs, cfg.nms, "PTQ baseline (all INT8)", "select")
    candidates = float_candidates(model, cfg.imgsz)
    costs = costs_of(candidates, lambda cs: measure_each_in_float(model, cs, inputs, cfg.nms), task.score,
                     task.score(baseline))
    total = sum(c.macs for c in candidates) or 1
    ranked = sorted(({"name": c.name, "layer": int(c.name.split(".")[1]), "convs": list(c.convs),
                      "mac_share": round(c.macs / total, 5), "cost": costs[c.name]} for c in candidates),
                    key=lambda d: d["cost"], reverse=True)
    lines = ["| Rank | Tensor class (its quantizer) | Convs | MAC share | select mAP gained in float |",
             "|---|---|---|---|---|"]
    lines += [f"| {k + 1} | {d['name'].removesuffix('._input_quantizer')} | {len(d['convs'])} | {d['mac_share']:.2%} | "
              f"{d['cost']:+.4f} |" for k, d in enumerate(ranked[:10])]
    summary = {"weights": str(cfg.weights), "data": str(cfg.data), "calib_method": cfg.quant.calib_method,
               "select": inputs.split.info(), "origin_select": origin, "baseline_ptq": baseline,
               "candidates": ranked, "table": "\n".join(lines)}
    LOGGER.info(f"\nselect: float {task.score(origin):.4f}, PTQ (all INT8) {task.score(baseline):.4f}; the tensor "
                "classes whose INT8 costs the most:\n" + summary["table"])
    write_json(save_dir / "summary-sensitive-analysis.json", summary)
    _bar_chart(ranked, baseline, save_dir / "sensitive-analysis.png")
    LOGGER.info(f"{PREFIX}results saved to {colorstr('bold', save_dir)}")
    return summary


def _bar_chart(candidates: list[dict], baseline: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    order = sorted(candidates, key=lambda d: d["layer"])  # model order within a layer: a stable sort
    fig, ax = plt.subplots(figsize=(max(6, len(order) * 0.12), 4))
    ax.bar(range(len(order)), [d["cost"] for d in order], color="tab:blue")
    starts = [k for k, d in enumerate(order) if k == 0 or order[k - 1]["layer"] != d["layer"]]
    ax.set_xticks(starts, [str(order[k]["layer"]) for k in starts], fontsize=7)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("tensor class kept in float (ticks: the layer it starts)")
    ax.set_ylabel("select mAP gain over full INT8 PTQ")
    ax.set_title(f"Quantization sensitivity on select (PTQ AP {baseline['ap']:.4f})")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
