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
import torch.nn.functional as F  # noqa: E402


def _step_time(model, teacher, images, steps: int, amp: bool) -> tuple[float, float]:
    """Median seconds of one distillation step (forward both, MSE on head maps, backward, Adam) and peak GiB."""
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    model.train()
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps + 3):
        im = images[i % len(images)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            with torch.no_grad():
                ref = teacher(im)[1]
            out = model(im)
            loss = sum(F.mse_loss(a.float(), b.float()) for a, b in zip(out, ref))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="models/detect/gelan-c.yaml")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--methods", nargs="+", default=["max", "mse", "percentile", "entropy"])
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--out", type=Path, default=Path("costs.json"))
    opt = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmark_costs: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
    from models.quantize import calibrate_model, copy_float, quantize_model, quantizer_counts
    from models.yolo import Model
    dev = torch.device("cuda:0")
    amp = not opt.no_amp
    torch.manual_seed(0)
    model = Model(opt.cfg, nc=80).to(dev).eval()
    model.fuse()
    for m in model.modules():  # fused convs can hold non-leaf tensors; train fresh leaf parameters
        for name, param in list(m._parameters.items()):
            if param is not None:
                m._parameters[name] = torch.nn.Parameter(param.detach().clone())
    teacher = copy_float(model)
    g = torch.Generator(device=dev).manual_seed(0)
    images = [torch.rand(opt.batch_size, 3, opt.imgsz, opt.imgsz, device=dev, generator=g) for _ in range(4)]
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cfg": opt.cfg,
              "batch_size": opt.batch_size, "imgsz": opt.imgsz, "amp": amp}
    fp_s, fp_mem = _step_time(model, teacher, images, opt.steps, amp)
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
    qat_s, qat_mem = _step_time(model, teacher, images, opt.steps, amp)
    result.update({"fp_step_s": round(fp_s, 4), "qat_step_s": round(qat_s, 4), "qat_over_fp": round(qat_s / fp_s, 3),
                   "fp_peak_gib": round(fp_mem, 2), "qat_peak_gib": round(qat_mem, 2)})
    opt.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
