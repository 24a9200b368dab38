#!/usr/bin/env python3
"""Cost of quantization on one GPU: QAT step vs float step (same batch, same AMP), calibration time per method,
peak memory. Random weights and images are enough for costs (accuracy needs trained models).

    python scripts/benchmark_costs.py --cfg models/detect/gelan-c.yaml --batch-size 16 --imgsz 640 --out costs.json
Run from the patched YOLOv9 checkout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

import torch  # noqa: E402


def _step_time(recipe, model, teacher, images, targets, hyp: dict, steps: int, amp: bool) -> tuple[float, float]:
    """Median seconds of one QAT training step of `recipe` (teacher forward, student forward and backward, Adam,
    EMA when the recipe has one) and peak GiB. The same code path as `qat.py quantize` (finetune_epoch)."""
    from models.finetune import QATObjective, WeightEMA, finetune_epoch, optimizer_for
    optimizer = optimizer_for(model, recipe)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    ema = WeightEMA(model, recipe.ema) if recipe.ema else None
    times = []
    torch.cuda.reset_peak_memory_stats()
    with QATObjective(recipe, model, teacher, hyp) as objective:
        for i in range(steps + 3):
            batch = iter([(images[i % len(images)], targets, None)])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            finetune_epoch(objective, batch, optimizer, scaler, ema, i, steps + 3, 1, 1, "")
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


def _random_targets(batch_size: int, n: int, nc: int, device) -> torch.Tensor:
    """Upstream targets [image, class, x, y, w, h] (normalised), `n` per image."""
    g = torch.Generator().manual_seed(0)
    img = torch.arange(batch_size).repeat_interleave(n).float()
    cls = torch.randint(0, nc, (batch_size * n,), generator=g).float()
    xy = torch.rand(batch_size * n, 2, generator=g) * 0.8 + 0.1
    wh = torch.rand(batch_size * n, 2, generator=g) * 0.15 + 0.05
    return torch.cat([img[:, None], cls[:, None], xy, wh], 1).to(device)


def copy_float_trainable(model):
    """A deep copy whose parameters are fresh leaves that require grad (fused convs can hold non-leaf tensors;
    quantizer state, amax included, is copied along)."""
    import copy
    model = copy.deepcopy(model)
    for m in model.modules():
        for name, param in list(m._parameters.items()):
            if param is not None:
                m._parameters[name] = torch.nn.Parameter(param.detach().clone())
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="models/detect/gelan-c.yaml")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--methods", nargs="+", default=["max", "mse", "percentile", "entropy"])
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--recipes", nargs="+", default=["--recipe default", "--recipe reference"],
                   help="QAT recipes to time, each as qat.py quantize flags (e.g. '--distill head --det-loss 1')")
    p.add_argument("--out", type=Path, default=Path("costs.json"))
    opt = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmark_costs: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
    import shlex
    import yaml
    from qat import parse_opt, qat_recipe
    from models.finetune import QATRecipe
    from models.quantize import calibrate_model, copy_float, quantize_model, quantizer_counts
    from models.yolo import Model
    dev = torch.device("cuda:0")
    amp = not opt.no_amp
    torch.manual_seed(0)
    model = Model(opt.cfg, nc=80).to(dev).eval()
    model.fuse()
    teacher = copy_float(model)
    g = torch.Generator(device=dev).manual_seed(0)
    images = [torch.rand(opt.batch_size, 3, opt.imgsz, opt.imgsz, device=dev, generator=g) for _ in range(4)]
    targets = _random_targets(opt.batch_size, 8, 80, dev)
    hyp = yaml.safe_load(open("data/hyps/hyp.scratch-high.yaml"))
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cfg": opt.cfg,
              "batch_size": opt.batch_size, "imgsz": opt.imgsz, "amp": amp, "recipes": {}}
    recipes = {}
    for flags in opt.recipes:  # parsed by qat.py itself: the recipe timed is the recipe those flags train
        q = parse_opt(["quantize", "--weights", "-", *shlex.split(flags)])
        recipes[flags] = qat_recipe(q.recipe, **{k: getattr(q, k) for k in QATRecipe.__dataclass_fields__})
    fp = {}
    for flags, recipe in recipes.items():  # the float model trained the same way: what QAT is compared with
        fp[flags] = _step_time(recipe, copy_float_trainable(model), teacher, images, targets, hyp, opt.steps, amp)
    t0 = time.perf_counter()
    quantize_model(model)
    result["insert_quantizers_s"] = round(time.perf_counter() - t0, 2)
    result["quantizers"] = quantizer_counts(model)
    result["calibration"] = {}
    for method in opt.methods:
        batches = (images[i % len(images)] for i in range(opt.calib_batches))
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            t = calibrate_model(model, batches, method, percentile=99.999)
        result["calibration"][method] = {k: round(v, 2) for k, v in t.items()}
        print(f"calibration {method}: {t}", flush=True)
    for flags, recipe in recipes.items():
        qat_s, qat_mem = _step_time(recipe, copy_float_trainable(model), teacher, images, targets, hyp, opt.steps,
                                    amp)
        fp_s, fp_mem = fp[flags]
        result["recipes"][flags] = {"recipe": recipe.to_dict(), "fp_step_s": round(fp_s, 4),
                                   "qat_step_s": round(qat_s, 4), "qat_over_fp": round(qat_s / fp_s, 3),
                                   "fp_peak_gib": round(fp_mem, 2), "qat_peak_gib": round(qat_mem, 2)}
    opt.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
