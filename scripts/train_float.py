#!/usr/bin/env python3
"""Train a float model to convergence with upstream train.py: on the fit split, early-stopped on the select
split (utils/datasplit.py), resumable across machine leases. The benchmark's float models come from here.

    python scripts/train_float.py --data helmet-416/data.yaml --cfg models/detect/gelan-s.yaml --name gelan-s \\
        --out results/helmet/gelan-s/float [--epochs 200 --patience 30 --imgsz 416 --batch 64]
    python scripts/train_float.py ... --collect       # write OUT from a run still in progress
    python scripts/train_float.py ... --nproc-per-node 2 --device 0,1   # upstream DDP through torchrun
    python scripts/train_float.py ... --train-script train_dual.py --cfg models/detect/yolov9-c.yaml   # YOLOv9

Run from the patched YOLOv9 checkout. A run that has weights/last.pt continues with upstream's --resume.
OUT gets results.csv (upstream's, per epoch: select-split metrics), curve.png and train.json: what was run
(upstream's opt.yaml, and the commit, command line, machine and split recorded when the run started), the
best epoch, whether the curve converged (upstream's patience stop, or a plateau over the last 10 % of epochs),
the wall time, and the sha256 of the weights. --weights-out also writes the best epoch's EMA weights in FP16 (what
evaluation and quantization read; upstream's best.pt also holds the optimizer); with --reparameterize (YOLOv9
models trained with train_dual.py) it converts them with reparameterization.py, as a user does next, and records
the converted file too.

Segmenters (segment/train.py, segment/train_dual.py) train on every instance's full mask here (upstream's
--no-overlap), as segment/val.py and this toolkit score them: upstream's default, one mask per image, lets a smaller
instance cut its area out of a larger one it lies on, and the model learns the cut-out masks (`--overlap` for
upstream's way). The weights written keep that choice, and `qat.py quantize` fine-tunes on the same masks.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from utils.datasplit import DEFAULT_FRACTION, DEFAULT_SEED, write_split  # noqa: E402
from utils.io_utils import atomic_write  # noqa: E402
from utils.provenance import command_line, machine, sha256, toolkit_commit  # noqa: E402

MAP = "metrics/mAP_0.5:0.95"
MAP50 = "metrics/mAP_0.5"
MASK_MAP = "metrics/mask_mAP_0.5:0.95"
MASK_MAP50 = "metrics/mask_mAP_0.5"


def column(header: str) -> str:
    """A results.csv header under one name for every task: a segmenter's box columns ('metrics/mAP_0.5(B)') as a
    detector's, its mask columns ('metrics/mAP_0.5(M)') as 'metrics/mask_mAP_0.5'."""
    header = header.strip()
    if header.endswith("(B)"):
        return header[:-3]
    if header.endswith("(M)"):
        return header[:-3].replace("metrics/", "metrics/mask_", 1)
    return header


def read_curve(results_csv: Path) -> list[dict]:
    """Upstream's results.csv (space-padded headers; train.py's or segment/train.py's) as a list of {column: float}."""
    with open(results_csv) as f:
        rows = list(csv.reader(f))
    head = [column(h) for h in rows[0]]
    # segment/train.py appends its final validation of best.pt as a row without the loss columns: not an epoch
    return [{h: float(v) for h, v in zip(head, r)} for r in rows[1:] if len(r) == len(head)]


def select_score(row: dict) -> float:
    """What picks the best epoch, as qat.py picks stages: box mAP50-95, plus mask mAP50-95 for a segmenter."""
    return row[MAP] + row.get(MASK_MAP, 0.0)


def plateau(values: list[float], share: float = 0.1) -> dict:
    """Whether the last `share` of a select curve (at least 4 epochs) stays within noise of the curve's best.
    Noise is one evaluation's scatter around the trend, from that window's epoch-to-epoch differences
    (std / sqrt 2); within noise means: the window's best is within 2 noise of the overall best, and the rise a
    least-squares line fits across the window is under 2 noise (a curve still climbing has a best at its end, so
    the first test alone would pass it)."""
    import numpy as np
    n = max(4, math.ceil(share * len(values)))
    if len(values) < n + 1:
        return {"window": len(values), "noise": None, "rise": None, "gap": None, "plateau": False}
    window = np.asarray(values[-n:], dtype=float)
    noise = float(np.std(np.diff(window), ddof=1) / math.sqrt(2))
    rise = float(np.polyfit(np.arange(n), window, 1)[0] * (n - 1))
    gap = float(max(values) - window.max())
    return {"window": n, "noise": round(noise, 5), "rise": round(rise, 5), "gap": round(gap, 5),
            "plateau": gap <= 2 * noise and rise <= 2 * noise}


def convergence(curve: list[dict], patience: int) -> dict:
    """Best epoch by select mAP50-95 (boxes + masks for a segmenter: `select_score`); whether `patience` epochs passed
    without a new best (upstream's early stop); and whether that curve ended on a plateau (`plateau`): converged is
    either."""
    best = max(range(len(curve)), key=lambda i: select_score(curve[i]))
    since = len(curve) - 1 - best
    end = plateau([select_score(r) for r in curve])
    masks = {"best_select_mask_map": curve[best][MASK_MAP], "best_select_mask_map50": curve[best][MASK_MAP50]} \
        if MASK_MAP in curve[best] else {}
    return {"epochs_run": len(curve), "best_epoch": int(curve[best]["epoch"]), "best_select_map": curve[best][MAP],
            "best_select_map50": curve[best][MAP50], **masks, "epochs_since_best": since, "last_epochs": end,
            "converged": since >= patience or end["plateau"]}


def plot_curve(curve: list[dict], conv: dict, title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [int(r["epoch"]) for r in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    what = "box " if MASK_MAP in curve[0] else ""
    ax.plot(epochs, [r[MAP] for r in curve], label=f"select {what}mAP50-95", color="C0")
    ax.plot(epochs, [r[MAP50] for r in curve], label=f"select {what}mAP50", color="C0", alpha=0.5)
    if what:
        ax.plot(epochs, [r[MASK_MAP] for r in curve], label="select mask mAP50-95", color="C1")
        ax.plot(epochs, [r[MASK_MAP50] for r in curve], label="select mask mAP50", color="C1", alpha=0.5)
    ax.axvline(conv["best_epoch"], color="gray", ls="--", lw=1, label=f"best (epoch {conv['best_epoch']})")
    ax.set(xlabel="epoch", ylabel="mAP", title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


PROVENANCE = "yolov9_qat_provenance.json"  # written into the run folder when a run starts


def record_start(run_dir: Path, split_yaml: Path) -> None:
    """What the run was started with (kept across resumes: the first start is the one that counts)."""
    import yaml
    path = run_dir / PROVENANCE
    if not path.is_file():
        start = {"commit": toolkit_commit(), "command": command_line(), "machine": machine(),
                 "split": yaml.safe_load(split_yaml.read_text())["split"], "sessions": []}
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(start, indent=2) + "\n"))


def record_session(run_dir: Path, seconds: float, returncode: int) -> None:
    """One call of the training script (a start or a resume): its wall time, so the total is known."""
    path = run_dir / PROVENANCE
    record = json.loads(path.read_text())
    record.setdefault("sessions", []).append({"seconds": round(seconds, 1), "exit": returncode,
                                              "machine": machine()["gpu"]})
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=2) + "\n"))


def compact_weights(best: Path, out: Path) -> Path:
    """The EMA model of an upstream training checkpoint, FP16, without the optimizer; a segmenter's record of how its
    masks were trained kept (its fine-tune trains on the same)."""
    import torch
    from models.quantization.checkpoint import read_checkpoint, training_record
    ckpt = read_checkpoint(best, flag="best.pt")
    model = (ckpt.get("ema") or ckpt["model"]).half()
    compact = {"model": model, "epoch": ckpt.get("epoch"), **training_record(ckpt)}
    return atomic_write(out, lambda tmp: torch.save(compact, tmp))


def converted_path(weights: Path) -> Path:
    return weights.with_name(f"{weights.stem}-converted.pt")


def reparameterize(weights: Path, data_yaml: str, model: str) -> dict:
    """reparameterization.py on the trained weights (the auxiliary branch dropped): what a user quantizes."""
    import yaml
    nc = len(yaml.safe_load(Path(data_yaml).read_text())["names"])
    save = converted_path(weights)
    cmd = [sys.executable, "reparameterization.py", "--weights", str(weights), "--model", model, "--classes_num",
           str(nc), "--save", str(save), "--exist-ok"]
    r = subprocess.run(cmd)
    if r.returncode:
        raise ValueError(f"reparameterization.py exited with {r.returncode} on {weights}")
    return {"command": " ".join(cmd[1:]), "weights": str(save), "weights_sha256": sha256(save)}


def collect(run_dir: Path, out: Path, model: str, weights_out: Path | None, reparameterize_as: str | None = None
            ) -> dict:
    """OUT/results.csv, curve.png and train.json (and the FP16 EMA weights) from the run folder as it stands.
    `model`: its name (upstream's opt.yaml of a resumed run has no cfg)."""
    import yaml
    args = yaml.safe_load((run_dir / "opt.yaml").read_text())
    curve = read_curve(run_dir / "results.csv")
    conv = convergence(curve, int(args["patience"]))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "results.csv", lambda tmp: shutil.copyfile(run_dir / "results.csv", tmp))
    plot_curve(curve, conv, f"{model}: float training, select split", out / "curve.png")
    best = run_dir / "weights" / "best.pt"
    if weights_out is not None:
        compact_weights(best, weights_out)
    weights = weights_out or (best if best.is_file() else None)  # without --weights-out: the run's own best.pt
    converted = reparameterize(weights_out, args["data"], reparameterize_as) if reparameterize_as else None
    started = json.loads((run_dir / PROVENANCE).read_text())
    entry = {"model": model, "finished": conv["converged"] or conv["epochs_run"] >= args["epochs"],
             **conv, "patience": args["patience"], "max_epochs": args["epochs"],
             "train_seconds": round(sum(r["seconds"] for r in started.get("sessions", [])), 1),
             "started": started,
             "upstream_args": {k: args[k] for k in ("cfg", "data", "hyp", "epochs", "batch_size", "imgsz", "seed",
                                                    "close_mosaic", "cache", "workers", "optimizer", "no_overlap")
                               if k in args},
             "weights": str(weights) if weights else None, "weights_sha256": sha256(weights) if weights else None,
             "converted": converted,
             "collected": {"commit": toolkit_commit(), "command": command_line(), "machine": machine()}}
    atomic_write(out / "train.json", lambda tmp: Path(tmp).write_text(json.dumps(entry, indent=2) + "\n"))
    return entry


def train_args(opt, split_yaml: Path) -> list[str]:
    return ["--data", str(split_yaml), "--cfg", opt.cfg, "--weights", "", "--hyp", opt.hyp, "--img", str(opt.imgsz),
            "--batch", str(opt.batch), "--epochs", str(opt.epochs), "--patience", str(opt.patience), "--seed",
            str(opt.seed), "--workers", str(opt.workers), "--close-mosaic", str(opt.close_mosaic), "--cache", "ram",
            "--device", opt.device, "--project", opt.project, "--name", opt.name, "--exist-ok",
            *(["--no-overlap"] if trains_full_masks(opt) else [])]


def trains_full_masks(opt) -> bool:
    """A segmenter trains on full instance masks unless --overlap asks for upstream's one mask per image."""
    return segmentation(opt) and not opt.overlap


def segmentation(opt) -> bool:
    return Path(opt.train_script).parent.name == "segment"


def launcher(opt) -> list[str]:
    """How upstream's script is started: this Python, or torchrun with one process per GPU of --device."""
    if opt.nproc_per_node == 1:
        return [sys.executable]
    if len(opt.device.split(",")) != opt.nproc_per_node:
        raise ValueError(f"--nproc-per-node {opt.nproc_per_node} needs as many GPUs in --device (got {opt.device})")
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(opt.nproc_per_node),
            "--master_port", str(opt.master_port)]


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset.yaml (train and val); the select split is carved from train")
    p.add_argument("--cfg", required=True, help="model yaml, e.g. models/detect/gelan-s.yaml")
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True, help="folder for results.csv, curve.png, train.json")
    p.add_argument("--train-script", default="train.py",
                   help="train.py (GELAN) or train_dual.py (YOLOv9); segment/train.py or segment/train_dual.py")
    p.add_argument("--hyp", default="data/hyps/hyp.scratch-high.yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=200, help="upper bound; early stopping usually ends it")
    p.add_argument("--patience", type=int, default=30, help="epochs without a better select mAP before stopping")
    p.add_argument("--close-mosaic", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--device", default="0", help="upstream's: 0, or 0,1 with --nproc-per-node 2")
    p.add_argument("--nproc-per-node", type=int, default=1,
                   help="processes (GPUs) for upstream's DDP, started with torchrun; 1: one process")
    p.add_argument("--master-port", type=int, default=29500, help="torchrun's port (two trainings at once: differ)")
    p.add_argument("--project", default="runs/train")
    p.add_argument("--split-dir", default="runs/split", help="where fit.txt / select.txt / split.yaml go")
    p.add_argument("--fraction", type=float, default=DEFAULT_FRACTION)
    p.add_argument("--split-seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--weights-out", type=Path, help="also write the best epoch's EMA weights (FP16) here")
    p.add_argument("--reparameterize", metavar="MODEL", choices=("t", "s", "m", "c", "e", "c-seg"),
                   help="with --weights-out: also convert them (reparameterization.py --model MODEL) to "
                        "WEIGHTS-converted.pt, for YOLOv9 models trained with train_dual.py or segment/train_dual.py")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="segmentation: --overlap trains on one mask per image (upstream's default), where a smaller "
                        "instance cuts its area out of a larger one it lies on; without it, every instance's full "
                        "mask, as segment/val.py scores (upstream's --no-overlap)")
    p.add_argument("--collect", action="store_true", help="only write OUT from the run as it stands")
    return p.parse_args(argv)


def train(opt) -> dict:
    """Train (or resume, or with opt.collect only collect) and write OUT; the train.json entry."""
    start = [*launcher(opt), opt.train_script]
    split_yaml = write_split(opt.data, opt.split_dir, opt.fraction, opt.split_seed)
    run_dir = Path(opt.project) / opt.name
    done = Path(opt.out) / "train.json"
    if not opt.collect and done.is_file() and json.loads(done.read_text())["finished"]:
        print(f"train_float: {done} says this training finished; nothing to do (--collect rewrites it)")
        return json.loads(done.read_text())
    results = run_dir / "results.csv"
    # every epoch ran but the session ended before train.json (cut off in upstream's final validation, say):
    # upstream's --resume of a finished schedule fails, and nothing is left to train
    ran_all = results.is_file() and len(read_curve(results)) >= opt.epochs
    if ran_all and not opt.collect:
        print(f"train_float: {results} holds all {opt.epochs} epochs; collecting")
    if not (opt.collect or ran_all):
        last = run_dir / "weights" / "last.pt"
        run_dir.mkdir(parents=True, exist_ok=True)
        record_start(run_dir, split_yaml)
        args = ["--resume", str(last)] if last.is_file() else train_args(opt, split_yaml)
        started, returncode = time.monotonic(), "interrupted"
        try:  # a session cut off (a lease's time limit) is recorded too: its epochs count in the total
            returncode = subprocess.run([*start, *args]).returncode
        finally:
            record_session(run_dir, time.monotonic() - started, returncode)
        if returncode:
            raise ValueError(f"{opt.train_script} exited with {returncode}")
    return collect(run_dir, Path(opt.out), Path(opt.cfg).stem, opt.weights_out, opt.reparameterize)


def main(argv=None) -> int:
    opt = parse_opt(argv)
    if opt.overlap is not None and not segmentation(opt):
        print(f"train_float: error: --{'' if opt.overlap else 'no-'}overlap is a segmentation flag; --train-script "
              f"{opt.train_script} trains a detector", file=sys.stderr)
        return 2
    if opt.reparameterize and opt.weights_out is None:
        print("train_float: error: --reparameterize converts the --weights-out file: give --weights-out",
              file=sys.stderr)
        return 2
    try:
        entry = train(opt)
    except (OSError, ValueError) as e:
        print(f"train_float: error: {e}", file=sys.stderr)
        return 2
    masks = f" (masks {entry['best_select_mask_map']:.4f})" if "best_select_mask_map" in entry else ""
    print(f"train_float: {entry['model']}: {entry['epochs_run']} epochs, best {entry['best_select_map']:.4f}{masks} at "
          f"epoch {entry['best_epoch']}, {'converged' if entry['converged'] else 'NOT converged'} "
          f"(patience {entry['patience']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
