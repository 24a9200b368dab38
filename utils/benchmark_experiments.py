"""The experiments of the benchmark's tables: kept `qat.py quantize` runs set beside an accuracy entry.

An experiment table is data, not code (`EXPERIMENTS`): the folder its report.json files sit in, which setting
groups them into rows, which columns (a metric of an arm, or the difference of two cells), and which settings may
differ from the entry's (the rest must agree, or the table refuses to render). Every run, an entry's or a kept
report's, is read into the same per-seed metrics first (`entry_runs`, `report_run`), so a new experiment needs a
new `Experiment`, not a new function.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from utils.results import difference, fmt, fmt_difference, spread


def entry_runs(e: dict) -> dict[str, dict[str, dict[str, float]]]:
    """An entry's default-command runs ("qat") and float controls ("control"), per seed, as the metrics the experiments read."""
    qat = {s: {"select_best": max(r["select_by_epoch"]), "select_last": r["select_by_epoch"][-1],
               "select_delivered": max(r["auto"]["candidates"][r["auto"]["chosen"]], *r["select_by_epoch"]),
               "val_delivered": r["val_final"]["ap"], "float_select": e["fp"]["select"]["ap"],
               "ptq_select": r["auto"]["candidates"][r["auto"]["chosen"]]} for s, r in e["qat"].items()}
    control = {s: {"select_best": max(r["select_by_epoch"]), "select_last": r["select_by_epoch"][-1],
                   "select_delivered": max(r["select_by_epoch"]), "val_delivered": r["val_best"]["ap"]}
               for s, r in e.get("fp_ft", {}).items()}
    return {"qat": qat, "control": control}


def report_run(r: dict) -> dict[str, float]:
    """A kept qat.py report.json as the same metrics: its fine-tune epochs (float epochs aside), the delivered model (the best
    on select) on select and val, and where it fine-tuned in float first, the float model and PTQ of it."""
    tuned = [e["ap"] for e in r["qat"] if e.get("stage") != "float"]
    k = r["config"].get("float_epochs", 0)
    mixed = r.get("mixed_precision")
    return {"select_best": max(tuned), "select_last": tuned[-1], "select_delivered": r["final"]["ap"],
            "val_delivered": r["val"]["final"]["ap"],
            **({"float_select": r["qat"][k - 1]["ap"], "ptq_select": r["recalibrated"]["metrics"]["ap"]} if k else {}),
            **({"float_select": mixed["origin_select"], "ptq_select": mixed["all_int8_select"],
                "mixed_select": mixed["mixed_select"], "int8_share": mixed["int8_mac_share"],
                "boundaries": mixed["boundaries"]} if mixed else {})}


@dataclass(frozen=True)
class Cell:
    """A column: `metric` of `arm` in this row, minus (when `minus` is set) another cell: (row or None for this
    row, arm, metric); arm "float model" is the entry's float model on val."""
    header: str
    arm: str
    metric: str
    minus: tuple[object, str, str] | None = None
    digits: int = 4


@dataclass(frozen=True)
class Experiment:
    folder: str                                  # OUT/<dataset>/<model>/<folder>/: the runs' report.json files
    title: str                                   # after "**model** on dataset, select split (N images), "
    row_header: str
    row_of: Callable[[dict], object]             # a kept report's row
    arm_of: Callable[[dict], str]                # and its arm within the row
    entry_rows: Callable[[dict], dict]           # the entry's own runs: {row: {arm: entry arm name}}
    row_label: Callable[[object, dict], str]     # (row, entry) -> the first cell
    cells: tuple[Cell, ...]
    ignore: tuple[str, ...] = ()                 # settings the kept runs may change (the rest must be the entry's)
    none: str = "No run recorded yet."
    order: Callable[[object], object] = lambda row: row  # rows sorted by it


PARTS = {"": "weights and activations (QAT, the default command)", "weights": "activations only (weights float)",
         "activations": "weights only (activations float)", "all": "nothing (the float control)"}
_VS_QAT = ("", "run")
EXPERIMENTS = {
    "partial-control": Experiment(
        "partial-control", "{qat_epochs} x {iters} iterations, seeds {seeds}", "INT8 during the fine-tune",
        row_of=lambda r: r["config"]["control"], arm_of=lambda r: "run",
        entry_rows=lambda e: {"": {"run": "qat"}, "all": {"run": "control"}},
        row_label=lambda row, e: PARTS[row],
        cells=(Cell("Best epoch on select", "run", "select_best"),
               Cell("vs QAT", "run", "select_best", (*_VS_QAT, "select_best")),
               Cell("Last epoch", "run", "select_last"),
               Cell("vs QAT", "run", "select_last", (*_VS_QAT, "select_last")),
               Cell("Best epoch on val", "run", "val_delivered")),
        none="No partial control recorded yet.", order=lambda row: list(PARTS).index(row)),
    "float-first": Experiment(
        "float-first", "{qat_epochs} x {iters} iterations, {n_seeds} seeds", "Float epochs before PTQ",
        row_of=lambda r: r["config"]["float_epochs"], arm_of=lambda r: "run",
        entry_rows=lambda e: {0: {"run": "qat"}},
        row_label=lambda row, e: f"{row}{' (the default command)' if not row else ''}",
        cells=(Cell("Float model, select", "run", "float_select"), Cell("PTQ (auto), select", "run", "ptq_select"),
               Cell("PTQ - float", "run", "ptq_select", (None, "run", "float_select")),
               Cell("QAT after it, best epoch", "run", "select_best"),
               Cell("Delivered, select", "run", "select_delivered"), Cell("Delivered, val", "run", "val_delivered")),
        none="No float-first run recorded yet."),
    "longer": Experiment(
        "longer", "{iters} iterations per epoch, delivered models (best on select)", "Epochs",
        row_of=lambda r: r["config"]["epochs"], arm_of=lambda r: "control" if r["config"]["control"] else "qat",
        entry_rows=lambda e: {e["settings"]["qat_epochs"]: {"qat": "qat", "control": "control"}},
        row_label=lambda row, e: f"{row}{' (the entry)' if row == e['settings']['qat_epochs'] else ''}",
        cells=(Cell("QAT, select", "qat", "select_delivered"), Cell("Float control, select", "control",
                                                                    "select_delivered"),
               Cell("QAT - control, select", "qat", "select_delivered", (None, "control", "select_delivered")),
               Cell("QAT, val", "qat", "val_delivered"), Cell("Float control, val", "control", "val_delivered"),
               Cell("QAT - control, val", "qat", "val_delivered", (None, "control", "val_delivered")),
               Cell("QAT - float model, val", "qat", "val_delivered", (None, "float model", "val"))),
        ignore=("epochs",), none="No longer run recorded yet."),
    "max-loss": Experiment(
        "max-loss", "{qat_epochs} x {iters} iterations, seeds {seeds}; every figure from the runs' own report.json "
        "(the delivered model's val mAP as qat.py measured it, batch 2 x --batch-size)", "Budget (--max-loss)",
        row_of=lambda r: "none" if r["config"]["max_loss"] is None else r["config"]["max_loss"],
        arm_of=lambda r: "run", entry_rows=lambda e: {},
        row_label=lambda row, e: "none (the default command, all INT8)" if row == "none" else f"{row:g}",
        cells=(Cell("Float, select", "run", "float_select"), Cell("All-INT8 PTQ, select", "run", "ptq_select"),
               Cell("Mixed PTQ, select", "run", "mixed_select"),
               Cell("Mixed - float, select", "run", "mixed_select", (None, "run", "float_select")),
               Cell("INT8 share of conv MACs", "run", "int8_share", digits=3),
               Cell("INT8/float boundaries", "run", "boundaries", digits=1),
               Cell("Delivered, val", "run", "val_delivered"),
               Cell("vs the default command, val", "run", "val_delivered", ("none", "run", "val_delivered"))),
        none="No mixed-precision run recorded yet.", order=lambda row: (-1.0, 0.0) if row == "none" else (0.0, row)),
}


def _run_settings(run: dict) -> dict:
    """What must match for a kept run to sit beside an entry's runs: select images, size, batch, schedule."""
    if "config" in run:  # a qat.py report.json
        c = run["config"]
        return {"select": run["select"]["fingerprint"], "imgsz": c["imgsz"], "batch_size": c["batch_size"],
                "epochs": c["epochs"], "iters": c["iters"], "calib_batches": c["quant"]["calib_batches"]}
    s = run["settings"]
    return {"select": run["provenance"]["split"]["fingerprint"]["select"], "imgsz": s["imgsz"],
            "batch_size": s["batch_size"], "epochs": s["qat_epochs"], "iters": s["iters"],
            "calib_batches": s["calib_batches"]}


def entry_beside(folder: Path) -> dict:
    """The entry an experiment's runs are set beside: `folder/entry.json` where the experiment names one (the entry
    made on the machine its runs ran on: hosts of one kind differ by more than these differences), else the
    model's current entry."""
    own = folder / "entry.json"
    return json.loads((own if own.is_file() else folder.parent / "entry.json").read_text())


def comparable_reports(folder: Path, entry: dict, ignore: tuple[str, ...] = ()) -> list[dict]:
    """The qat.py report.json files kept in `folder`, each a finished run with the entry's settings (`ignore`
    aside); anything else is refused: its numbers would not be comparable."""
    want = {k: v for k, v in _run_settings(entry).items() if k not in ignore}
    reports = []
    for f in sorted(p for p in folder.glob("*.json") if p.name != "entry.json"):
        r = json.loads(f.read_text())
        got = {k: v for k, v in _run_settings(r).items() if k not in ignore}
        if got != want or not r.get("finished"):
            raise ValueError(f"{f}: an unfinished run or one made with other settings than the entry's ({got} vs "
                             f"{want}): its numbers are not comparable")
        reports.append(r)
    return reports


def experiment_table(out: Path, x: Experiment) -> str:
    """One table per model that kept runs of experiment `x`: rows of per-seed metrics, mean ± std over seeds."""
    parts = []
    for folder in sorted(out.glob(f"*/*/{x.folder}")):
        e = entry_beside(folder)
        mine = entry_runs(e)
        rows: dict[object, dict[str, dict[str, list[float]]]] = {}
        for row, arms in x.entry_rows(e).items():
            for arm, source in arms.items():
                for run in mine[source].values():
                    for metric, v in run.items():
                        rows.setdefault(row, {}).setdefault(arm, {}).setdefault(metric, []).append(v)
        seeds = {str(s) for s in e["qat"]}
        for r in comparable_reports(folder, e, x.ignore):
            seeds.add(str(r["config"]["seed"]))
            arm = rows.setdefault(x.row_of(r), {}).setdefault(x.arm_of(r), {})
            for metric, v in report_run(r).items():
                arm.setdefault(metric, []).append(v)
        rows["float model"] = {"float model": {"val": [e["fp"]["val"]["ap"]]}}

        def value(row, arm, metric):
            values = rows[row][arm].get(metric) if arm != "float model" else rows["float model"][arm]["val"]
            return spread(values, fixed=arm == "float model") if values else None  # None: the row has no such metric

        s = e["settings"]
        title = x.title.format(qat_epochs=s["qat_epochs"], iters=s["iters"], n_seeds=len(e["qat"]),
                               seeds=", ".join(sorted(seeds)))
        lines = [f"**{e['model']}** on {e['dataset']}, select split ({e['provenance']['split']['images']['select']} "
                 f"images), {title}", "", "| " + " | ".join([x.row_header] + [c.header for c in x.cells])
                 + " |", "|" + "---|" * (len(x.cells) + 1)]
        for row in sorted((k for k in rows if k != "float model"), key=x.order):
            cells = [x.row_label(row, e)]
            for c in x.cells:
                v = value(row, c.arm, c.metric)
                if c.minus is None:
                    cells.append(fmt(v, c.digits))
                else:
                    other_row, arm, metric = c.minus
                    other = value(row if other_row is None else other_row, arm, metric)
                    cells.append(fmt_difference(difference(v, other)) if v and other else "-")
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else x.none
