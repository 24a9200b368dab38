#!/usr/bin/env python3
"""The fine-tuning step's modes side by side on one host: one `qat.py quantize` run per seed and `--step` mode of
one model and dataset, spread over the GPUs and all started together, so each mode sees the same machine. For each
run: its plan, the select mAP50-95 after every epoch, the delivered stage with its select and val mAP50-95 (box and
mask for a segmenter), the compiled step's first iteration, the epochs' training seconds and the wall time (start to
finish, compile included).

    python scripts/benchmark_step.py --weights W.pt --data D.yaml --imgsz 416 --seeds 0 1 2 \
        --steps inductor eager --devices 0 1 --out results/fast-step/gelan-s-helmet-416.json -- --workers 4

Run from the patched YOLOv9 checkout, on CUDA GPUs. Each run compiles with an inductor cache of its own, empty at
its start: a first run's compile, as a user's first run pays it (`--devices cpu`, a trial: nothing compiles).
Arguments after `--` go to every qat.py run.
Writes --out (JSON, with each run's report.json beside it under --project), the select curves beside it (PNG) and
prints a table; `--render OUT.json` draws the curves of a recorded result again.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from models.finetuning.fast_step import STEP_MODES  # noqa: E402
from utils.benchmark_steps import log_beside  # noqa: E402
from utils.io_utils import atomic_write, write_json  # noqa: E402
from utils.provenance import command_line, machine, toolkit_commit  # noqa: E402


def parse_opt(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--render"]:
        p = argparse.ArgumentParser()
        p.add_argument("--render", type=Path, required=True, help="a JSON this script wrote: its curves drawn again")
        return p.parse_args(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--seeds", type=int, nargs="+", default=[57])
    p.add_argument("--steps", nargs="+", choices=STEP_MODES, default=["auto", "eager"])
    p.add_argument("--devices", nargs="+", default=["0"], help="GPUs, used in turn by the runs (cpu: a trial run)")
    p.add_argument("--compile-threads", type=int, default=None,
                   help="inductor's compile workers per run (its default: one per core, up to 32)")
    p.add_argument("--project", type=Path, default=Path("runs/step"))
    p.add_argument("--out", type=Path, required=True)
    opt = p.parse_args(argv)
    opt.extra = extra
    return opt


def start(opt, seed: int, step: str, device: str) -> dict:
    name = f"{Path(opt.weights).stem}-{opt.imgsz}-seed{seed}-{step}"
    folder = opt.project / name
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if device != "cpu":  # the run sees its GPU alone, as device 0, and compiles cold, in a cache of its own
        env.update(CUDA_VISIBLE_DEVICES=device, TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor-cache"))
    if opt.compile_threads:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(opt.compile_threads)
    cmd = [sys.executable, "qat.py", "quantize", "--weights", opt.weights, "--data", opt.data, "--imgsz",
           str(opt.imgsz), "--device", "cpu" if device == "cpu" else "0", "--seed", str(seed), "--step", step,
           "--project", str(opt.project), "--name", name, "--exist-ok", *opt.extra]
    log = open(log_beside(folder), "w")
    return {"seed": seed, "step": step, "device": device, "folder": folder, "t0": time.perf_counter(),
            "process": subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), "log": log}


def summary(run: dict) -> dict:
    """One run's figures from its report.json; a segmenter's mask mAP50-95 beside each box figure (keys `mask_*`)."""
    out = {"seed": run["seed"], "step": run["step"], "gpu": run["device"], "rc": run["rc"],
           "wall_s": run["wall_s"], "report": str(run["folder"] / "report.json")}
    report_file = run["folder"] / "report.json"
    if run["rc"] or not report_file.is_file():
        return out
    r = json.loads(report_file.read_text())
    final, val = r.get("final") or {}, r.get("val", {})
    epochs = [e for e in r.get("qat", []) if e.get("stage") == "qat"]
    out.update({"plan": r.get("step", {}).get("plan"), "first_step_s": r.get("step", {}).get("first_step_s"),
                "train_s": [e["train_s"] for e in epochs], "calibration": r["calibration"]["chosen"]})
    for metric, prefix in (("ap", ""), ("mask_ap", "mask_")):
        if metric not in r["ptq"]:
            continue
        out.update({f"{prefix}select_curve": [e[metric] for e in epochs],
                    f"{prefix}origin": {"select": (r.get("origin") or {}).get(metric),
                                        "val": val.get("origin", {}).get(metric)},
                    f"{prefix}ptq_select": r["ptq"][metric],
                    f"{prefix}delivered": {"stage": final.get("stage"), "epoch": final.get("epoch"),
                                           "select": final.get(metric), "val": val.get("final", {}).get(metric)}})
    return out


def by_step(runs: list[dict]) -> dict:
    """Per --step mode: mean and spread over seeds of what a user gets and waits for."""
    out = {}
    for step in dict.fromkeys(r["step"] for r in runs):
        done = [r for r in runs if r["step"] == step and "delivered" in r]
        if not done:
            continue
        figures = {"wall_s": [r["wall_s"] for r in done]}
        for prefix in ("", "mask_") if all("mask_delivered" in r for r in done) else ("",):
            figures[f"{prefix}delivered_val"] = [r[f"{prefix}delivered"]["val"] for r in done]
            figures[f"{prefix}delivered_select"] = [r[f"{prefix}delivered"]["select"] for r in done]
        row = {key: {"mean": round(statistics.mean(values), 4),
                     "std": round(statistics.stdev(values), 4) if len(values) > 1 else None}
               for key, values in figures.items()}
        row["delivered_stages"] = [f"{r['delivered']['stage']} {r['delivered']['epoch']}" for r in done]
        out[step] = row
    return out


def _shown(box: float, mask: float | None) -> str:
    """A table cell: the box figure, and a segmenter's mask figure after it."""
    return f"{box:.4f}" if mask is None else f"{box:.4f} / {mask:.4f}"


def table(runs: list[dict]) -> str:
    """A row per run; a segmenter's figures as box / mask mAP50-95."""
    head = ("| seed | --step | plan | first step s | train s (all epochs) | wall s | select after each epoch | PTQ select "
            "| delivered | select | val |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in runs:
        if "delivered" not in r:
            rows.append(f"| {r['seed']} | {r['step']} | failed (rc {r['rc']}) | | | {r['wall_s']} | | | | | |")
            continue
        d, md = r["delivered"], r.get("mask_delivered", {})
        masks = r.get("mask_select_curve", [None] * len(r["select_curve"]))
        curve = " ".join(_shown(box, mask) for box, mask in zip(r["select_curve"], masks))
        rows.append(f"| {r['seed']} | {r['step']} | {r['plan']} | {r['first_step_s'] or '-'} | "
                    f"{sum(r['train_s']):.0f} | {r['wall_s']:.0f} | {curve} "
                    f"| {_shown(r['ptq_select'], r.get('mask_ptq_select'))} | {d['stage']} {d['epoch']} "
                    f"| {_shown(d['select'], md.get('select'))} | {_shown(d['val'], md.get('val'))} |")
    return "\n".join([head, *rows])


def plot_curves(result: dict, path: Path) -> Path:
    """The select mAP50-95 after each epoch, one line per run (colour: --step mode, style: seed), PTQ at epoch 0; a
    segmenter's masks in a second panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [r for r in result["runs"] if "select_curve" in r]
    colours = {step: f"C{i}" for i, step in enumerate(dict.fromkeys(r["step"] for r in runs))}
    seeds = list(dict.fromkeys(r["seed"] for r in runs))
    panels = [("", "box")] + ([("mask_", "mask")] if runs and all("mask_select_curve" in r for r in runs) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, (prefix, what) in zip(axes[0], panels):
        for r in runs:
            curve = [r[f"{prefix}ptq_select"], *r[f"{prefix}select_curve"]]
            ax.plot(range(len(curve)), curve, color=colours[r["step"]],
                    ls=("-", "--", ":", "-.")[seeds.index(r["seed"]) % 4], marker=".",
                    label=f"{r['step']}, seed {r['seed']}")
        ax.set(xlabel="epoch (0: PTQ)", ylabel=f"select {what} mAP50-95",
               title=f"{Path(result['weights']).stem}, {result['imgsz']} px, {result['machine']['gpu'] or 'CPU'}")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return path


def main(argv=None) -> int:
    opt = parse_opt(argv)
    if getattr(opt, "render", None):
        if not opt.render.is_file():
            raise SystemExit(f"benchmark_step: --render {opt.render}: file not found")
        print(plot_curves(json.loads(opt.render.read_text()), opt.render.with_suffix(".png")))
        return 0
    jobs = [(seed, step) for seed in opt.seeds for step in opt.steps]
    running = [start(opt, seed, step, opt.devices[i % len(opt.devices)]) for i, (seed, step) in enumerate(jobs)]
    while any("rc" not in r for r in running):
        for run in running:
            if "rc" not in run and run["process"].poll() is not None:
                run["rc"], run["wall_s"] = run["process"].returncode, round(time.perf_counter() - run["t0"], 1)
                run["log"].close()
        time.sleep(0.1)  # each run's wall time to the 0.1 s it is reported in
    runs = [summary(r) for r in running]
    result = {"what": "qat.py quantize runs side by side on one host, one per seed and --step mode",
              "weights": opt.weights, "data": opt.data, "imgsz": opt.imgsz, "extra_args": opt.extra,
              "runs": runs, "by_step": by_step(runs), "table": table(runs),
              "commit": toolkit_commit(), "command": command_line(), "machine": machine()}
    write_json(opt.out, result)
    plot_curves(result, opt.out.with_suffix(".png"))
    print(result["table"])
    return int(any(r["rc"] for r in runs))


if __name__ == "__main__":
    sys.exit(main())
