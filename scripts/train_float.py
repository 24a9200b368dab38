#!/usr/bin/env python3
"""Train a float model to convergence with upstream train.py: on the fit split, early-stopped on the select
split (utils/datasplit.py), resumable across machine leases. The benchmark's float models come from here.

    python scripts/train_float.py --data helmet-416/data.yaml --cfg models/detect/gelan-s.yaml --name gelan-s \\
        --out results/helmet/gelan-s/float [--epochs 200 --patience 30 --imgsz 416 --batch 64]
    python scripts/train_float.py ... --collect       # write OUT from a run still in progress

Run from the patched YOLOv9 checkout. A run that has weights/last.pt and no OUT/train.json continues with
upstream's --resume. OUT gets results.csv (upstream's, per epoch: select-split metrics), curve.png and
train.json (commit, command, split fingerprints, epochs, best epoch, whether the patience criterion stopped it,
sha256 of best.pt).
"""
from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from utils.datasplit import DEFAULT_FRACTION, DEFAULT_SEED, write_split  # noqa: E402
from utils.io_utils import atomic_write  # noqa: E402
from utils.provenance import command_line, machine, sha256, toolkit_commit  # noqa: E402

MAP = "metrics/mAP_0.5:0.95"
MAP50 = "metrics/mAP_0.5"


def read_curve(results_csv: Path) -> list[dict]:
    """Upstream's results.csv (space-padded headers) as a list of {column: float}."""
    with open(results_csv) as f:
        rows = list(csv.reader(f))
    head = [h.strip() for h in rows[0]]
    return [{h: float(v) for h, v in zip(head, r)} for r in rows[1:] if r]


def convergence(curve: list[dict], patience: int) -> dict:
    """Best epoch by select mAP50-95 and whether `patience` epochs have passed without a new best."""
    best = max(range(len(curve)), key=lambda i: curve[i][MAP])
    since = len(curve) - 1 - best
    return {"epochs_run": len(curve), "best_epoch": int(curve[best]["epoch"]), "best_select_map": curve[best][MAP],
            "best_select_map50": curve[best][MAP50], "epochs_since_best": since, "converged": since >= patience}


def plot_curve(curve: list[dict], conv: dict, title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [int(r["epoch"]) for r in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(epochs, [r[MAP] for r in curve], label="select mAP50-95")
    ax.plot(epochs, [r[MAP50] for r in curve], label="select mAP50", alpha=0.6)
    ax.axvline(conv["best_epoch"], color="gray", ls="--", lw=1, label=f"best (epoch {conv['best_epoch']})")
    ax.set(xlabel="epoch", ylabel="mAP", title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def collect(opt, run_dir: Path, split_yaml: Path, finished: bool) -> dict:
    import yaml
    curve = read_curve(run_dir / "results.csv")
    conv = convergence(curve, opt.patience)
    out = Path(opt.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "results.csv", lambda tmp: shutil.copyfile(run_dir / "results.csv", tmp))
    plot_curve(curve, conv, f"{opt.name}: float training, early stopping on the select split", out / "curve.png")
    best = run_dir / "weights" / "best.pt"
    entry = {"model": opt.name, "finished": finished, **conv, "patience": opt.patience, "max_epochs": opt.epochs,
             "split": yaml.safe_load(split_yaml.read_text())["split"], "commit": toolkit_commit(),
             "command": command_line(), "train_args": train_args(opt, split_yaml), "machine": machine(),
             "best_pt_sha256": sha256(best) if best.is_file() else None}
    atomic_write(out / "train.json", lambda tmp: Path(tmp).write_text(json.dumps(entry, indent=2) + "\n"))
    return entry


def train_args(opt, split_yaml: Path) -> list[str]:
    return ["--data", str(split_yaml), "--cfg", opt.cfg, "--weights", "", "--hyp", opt.hyp, "--img", str(opt.imgsz),
            "--batch", str(opt.batch), "--epochs", str(opt.epochs), "--patience", str(opt.patience), "--seed",
            str(opt.seed), "--workers", str(opt.workers), "--close-mosaic", str(opt.close_mosaic), "--cache", "ram",
            "--device", opt.device, "--project", opt.project, "--name", opt.name, "--exist-ok"]


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset.yaml (train and val); the select split is carved from train")
    p.add_argument("--cfg", required=True, help="model yaml, e.g. models/detect/gelan-s.yaml")
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True, help="folder for results.csv, curve.png, train.json")
    p.add_argument("--train-script", default="train.py", help="train.py (GELAN) or train_dual.py (YOLOv9)")
    p.add_argument("--hyp", default="data/hyps/hyp.scratch-high.yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=200, help="upper bound; early stopping usually ends it")
    p.add_argument("--patience", type=int, default=30, help="epochs without a better select mAP before stopping")
    p.add_argument("--close-mosaic", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--device", default="0")
    p.add_argument("--project", default="runs/train")
    p.add_argument("--split-dir", default="runs/split", help="where fit.txt / select.txt / split.yaml go")
    p.add_argument("--fraction", type=float, default=DEFAULT_FRACTION)
    p.add_argument("--split-seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--collect", action="store_true", help="only write OUT from the run as it stands")
    return p.parse_args(argv)


def main(argv=None) -> int:
    opt = parse_opt(argv)
    try:
        split_yaml = write_split(opt.data, opt.split_dir, opt.fraction, opt.split_seed)
    except (OSError, ValueError) as e:
        print(f"train_float: error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(opt.project) / opt.name
    if opt.collect:
        print(json.dumps(collect(opt, run_dir, split_yaml, finished=False), indent=2))
        return 0
    last = run_dir / "weights" / "last.pt"
    if (Path(opt.out) / "train.json").is_file() and json.loads((Path(opt.out) / "train.json").read_text())["finished"]:
        print(f"train_float: {opt.out}/train.json says this training finished; nothing to do")
        return 0
    args = ["--resume", str(last)] if last.is_file() else train_args(opt, split_yaml)
    r = subprocess.run([sys.executable, opt.train_script, *args])
    if r.returncode:
        print(f"train_float: error: {opt.train_script} exited with {r.returncode}", file=sys.stderr)
        return r.returncode
    entry = collect(opt, run_dir, split_yaml, finished=True)
    print(f"train_float: {opt.name}: {entry['epochs_run']} epochs, best {entry['best_select_map']:.4f} at epoch "
          f"{entry['best_epoch']}, {'converged' if entry['converged'] else 'NOT converged'} (patience {opt.patience})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
