"""The benchmark's tables, rendered from the JSON under results/ (what scripts/benchmark_accuracy.py and the other
benchmarks wrote): the per-model accuracy entries (a segmenter's boxes and masks), the float trainings, the recipe
ablations, the training cost, the demo, and the experiments (utils/benchmark_experiments.py: kept `qat.py quantize`
runs set beside an entry).
"""
from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from utils.benchmark_experiments import EXPERIMENTS, comparable_reports, entry_beside, experiment_table, report_run
from utils.io_utils import write_json
from utils.provenance import overlay_repo
from utils.results import difference, fmt, fmt_difference, render_files, selection_score, spread

REPO = overlay_repo()
PER_QUANTIZER = "per-quantizer"  # ranges chosen quantizer by quantizer (models/quantization/ranges.py)


def summarize(e: dict, metric: str = "ap") -> dict:
    """Mean +- std over seeds of every stage that ran, on val, and the differences the claims rest on, in `metric`
    (box mAP50-95); a segmenter's entry also has the same for its masks under "mask"."""
    over = lambda runs, key: spread([r[key][metric] for r in runs.values()])  # noqa: E731
    # where every seed calibrated on the same images (a fit split smaller than the sample), PTQ is one measurement
    one_sample = same_calibration_sample(e)
    one = lambda runs, key: spread([next(iter(runs.values()))[key][metric]])  # noqa: E731
    ptq_over = one if one_sample else over
    s = {"fp": spread([e["fp"]["val"][metric]], fixed=True),
         "ptq": {m: ptq_over(runs, "val") for m, runs in e["ptq"].items()},
         "ptq_select": {m: ptq_over(runs, "select") for m, runs in e["ptq"].items()},
         "one_calibration_sample": one_sample}
    best_ptq = s["ptq"][e["ptq_choice"]]
    s["best_ptq_vs_fp"] = difference(best_ptq, s["fp"])
    s["best_fixed_on_val"] = max(s["ptq"], key=lambda m: s["ptq"][m]["mean"])  # the hardest bar, known only after
    best_fixed = s["ptq"][s["best_fixed_on_val"]]
    if "qat" in e:
        s["auto"] = ptq_over({k: r["auto"] for k, r in e["qat"].items()}, "val")
        s["auto_vs_best_fixed"] = difference(s["auto"], best_fixed)
        s["qat_best"], s["qat_last"] = over(e["qat"], "val_best"), over(e["qat"], "val_last")
        s["final"] = over(e["qat"], "val_final")
        s["user_gain"] = difference(s["final"], s["fp"])                      # delivered - the float model
        s["final_vs_best_fixed"] = difference(s["final"], best_fixed)
        s["qat_vs_best_ptq"] = difference(s["qat_best"], best_ptq)
    if "fp_ft" in e:
        s["fp_ft_best"], s["fp_ft_last"] = over(e["fp_ft"], "val_best"), over(e["fp_ft"], "val_last")
    if "mixed" in e:
        s["mixed"] = over(e["mixed"], "val_final")
        s["mixed_vs_fp"] = difference(s["mixed"], s["fp"])
        s["mixed_int8_share"] = spread([r["mixed_precision"]["int8_mac_share"] for r in e["mixed"].values()])
        if "fp_ft" in e:
            s["mixed_vs_fp_ft"] = difference(s["mixed"], s["fp_ft_best"])
    if "qat" in e and "fp_ft" in e:
        s["quantization_cost"] = difference(s["final"], s["fp_ft_best"])      # delivered - its float control
    if "ort" in e:  # against the same seeds' delivered checkpoint in PyTorch: that is the file exported
        s["ort"] = {d: over(runs, "val") for d, runs in e["ort"].items()}
        s["ort_vs_pytorch"] = {d: difference(v, spread([e["qat"][seed]["val_final"][metric] for seed in e["ort"][d]]))
                               for d, v in s["ort"].items()}
    if "ort_ptq" in e:  # PTQ rebuilt from kept ranges: against the same rebuilt model in PyTorch, seed by seed
        rows = e["ort_ptq"].values()
        s["ort_ptq_pytorch"] = spread([r["pytorch"][metric] for r in rows])
        s["ort_ptq"] = {g: spread([r[g]["val"][metric] for r in rows]) for g in ORT_GRAPHS}
        s["ort_ptq_vs_pytorch_max"] = {g: round(max(abs(r[g]["val"][metric] - r["pytorch"][metric]) for r in rows), 5)
                                       for g in ORT_GRAPHS}
    if PER_QUANTIZER in e["ptq"] and len(e["ptq"]) > 1:
        s["global_auto_choices"] = global_auto_choices(e)
        s["global_auto"] = spread([e["ptq"][m][seed]["val"][metric] for seed, m in s["global_auto_choices"].items()])
        s["per_quantizer_vs_global_auto"] = difference(s["ptq"][PER_QUANTIZER], s["global_auto"])
        s["per_quantizer_won"] = per_quantizer_wins(e, s["global_auto_choices"])
        s["auto_with_per_quantizer"] = spread([e["ptq"][PER_QUANTIZER if seed in s["per_quantizer_won"] else m][seed]
                                               ["val"][metric] for seed, m in s["global_auto_choices"].items()])
        s["auto_with_vs_without_per_quantizer"] = difference(s["auto_with_per_quantizer"], s["global_auto"])
    if "modelopt" in e:  # the peer may have run on some of the entry's seeds: ours on the same ones
        s["modelopt"] = {m: over(runs, "val") for m, runs in e["modelopt"].items()}
        peer, peer_seeds = s["modelopt"][e["modelopt_choice"]], list(e["modelopt"][e["modelopt_choice"]])
        on_peer_seeds = lambda runs: {k: runs[k] for k in peer_seeds}  # noqa: E731
        s["ptq_vs_modelopt"] = difference(ptq_over(on_peer_seeds(e["ptq"][e["ptq_choice"]]), "val"), peer)
        if "qat" in e:
            s["qat_vs_modelopt"] = difference(over(on_peer_seeds(e["qat"]), "val_best"), peer)
    if metric == "ap" and "mask_ap" in e["fp"]["val"]:
        s["mask"] = summarize(e, "mask_ap")
    return s


ORT_GRAPHS = ("fp32", "fp32_e2e", "fp16", "fp16_e2e")  # the keys of an entry's ort_ptq rows
GRAPH_NAMES = {"fp32": "FP32 Q/DQ graph", "fp32_e2e": "FP32 Q/DQ graph with NMS (ONNX)",
               "fp16": "FP16 Q/DQ graph (TensorRT 11's)", "fp16_e2e": "FP16 Q/DQ graph with NMS (ONNX)"}


def same_calibration_sample(e: dict) -> bool:
    """Whether every seed's PTQ calibrated on the same images, so its PTQ numbers are one measurement: the fit split
    holds no more images than one calibration sample takes (each seed draws them all, in its own order, and the
    statistics do not depend on the order)."""
    st = e["settings"]
    return len(e["provenance"]["seeds"]) > 1 and \
        e["provenance"]["split"]["images"]["fit"] <= st["calib_batches"] * st["batch_size"]


def global_auto_choices(e: dict) -> dict[str, str]:
    """Per seed, what `auto` chooses among the methods that give every quantizer a range by one rule (every
    candidate but the per-quantizer one): the best on select."""
    methods = [m for m in e["ptq"] if m != PER_QUANTIZER]
    return {seed: max(methods, key=lambda m: (selection_score(e["ptq"][m][seed]["select"]), -methods.index(m)))
            for seed in e["ptq"][methods[0]]}


def per_quantizer_wins(e: dict, one_rule: dict[str, str]) -> list[str]:
    """The seeds where `auto` with the per-quantizer candidate among its candidates (last, so a tie keeps the
    one-rule method) would have chosen it: its select mAP above the best one-rule method's."""
    per_q = e["ptq"][PER_QUANTIZER]
    return [seed for seed, m in one_rule.items()
            if selection_score(per_q[seed]["select"]) > selection_score(e["ptq"][m][seed]["select"])]


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------
def entries(out: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob("*/*/entry.json"))]


def model_table(e: dict, metric: str = "ap") -> str:
    """One model: every stage's mAP50-95 on val (mean +- std over seeds) and on select where choices were made; of
    the boxes, or with `metric` "mask_ap" of a segmenter's masks."""
    s, seeds = e["summary"] if metric == "ap" else e["summary"]["mask"], len(e["provenance"]["seeds"])
    not_run = "not run (" + ", ".join(e.get("not_run", [])) + " skipped)"
    rows = [("FP32 (the trained model)", s["fp"], fmt(spread([e["fp"]["select"][metric]])))]
    for m in s["ptq"]:
        chosen = " (chosen on select)" if m == e["ptq_choice"] else ""
        rows.append((f"PTQ {m}{chosen}", s["ptq"][m], fmt(s["ptq_select"][m])))
    if "auto" in s:
        chosen = ", ".join(r["auto"]["chosen"] for r in e["qat"].values())
        rows.append((f"PTQ auto, the default (chose {chosen})", s["auto"], fmt(auto_select(e, metric))))
    for key, name in (("fp_ft_best", "FP fine-tune control, best epoch on select"),
                      ("fp_ft_last", "FP fine-tune control, last epoch"), ("qat_best", "QAT, best epoch on select"),
                      ("qat_last", "QAT, last epoch")):
        rows.append((name, s.get(key), "" if key in s else not_run))
    if "final" in s:
        stages = ", ".join(r["final"]["stage"] + (f" {r['final']['epoch']}" if r["final"]["epoch"] else "")
                           for r in e["qat"].values())
        rows.append((f"**Delivered by the default command** (best on select of PTQ and QAT epochs: {stages})",
                     s["final"], ""))
    if "mixed" in s:
        runs = e["mixed"].values()
        budget = next(iter(runs))["mixed_precision"]["max_loss"]
        kept = ", ".join(str(len(r["mixed_precision"]["float_convs"])) for r in runs)
        rows.append((f"Delivered with --max-loss {budget:g} (convs kept in float per seed: {kept}; INT8 share of "
                     f"conv MACs {fmt(s['mixed_int8_share'])})", s["mixed"], ""))
    for dtype, name in (("fp32", "QAT, FP32 Q/DQ graph in ONNX Runtime"),
                        ("fp16", "QAT, FP16 Q/DQ graph in ONNX Runtime (TensorRT 11's)")):
        why = not_run + ("; the QAT weights are not kept with the entry: the rebuilt PTQ rows below are not them"
                         if "ort_ptq" in s else "")
        rows.append((name, s.get("ort", {}).get(dtype), "" if "ort" in s else why))
    if "ort_ptq" in s:
        seeds_of = ", ".join(f"seed {k}: {r['method']}" for k, r in e["ort_ptq"].items())
        rows.append((f"PTQ auto rebuilt from its kept ranges ({seeds_of}), PyTorch", s["ort_ptq_pytorch"], ""))
        rows += [(f"PTQ auto rebuilt, {GRAPH_NAMES[g]} in ONNX Runtime", s["ort_ptq"][g], "") for g in ORT_GRAPHS]
    for m, v in s.get("modelopt", {}).items():
        chosen = " (chosen on select)" if m == e.get("modelopt_choice") else ""
        rows.append((f"Model Optimizer ONNX PTQ {m}{chosen}", v,
                     fmt(spread([r["select"][metric] for r in e["modelopt"][m].values()]))))
    prov = e["provenance"]
    peer = f"; Model Optimizer rows added later on {_where(prov['peer']['machine'])}, commit " \
           f"{_commit(prov['peer']['commit'])}" if "peer" in prov else ""
    what = ("masks" if metric == "mask_ap" else "boxes") if "mask" in e["summary"] else ""
    trained_on = {r.get("training_masks") for r in e.get("qat", {}).values()} - {None}  # older entries: none kept
    fine_tuned = f" fine-tuned on {'full instance masks' if trained_on == {'full'} else 'one mask per image'}" \
        if what == "masks" and len(trained_on) == 1 else ""
    lines = [f"**{e['model']}** on {e['dataset']}{', ' + what if what else ''}{fine_tuned} "
             f"({prov['split']['images']['val']} val "
             f"images, imgsz {e['imgsz']}; {seeds} seeds; {_where_measured(prov)}; commit {_commit(prov['commit'])}"
             f"{peer})", "",
             f"| Stage | {what.capitalize() + ' ' if what else ''}mAP50-95 val, mean ± std (seeds) | mAP50-95 select |",
             "|---|---|---|"]
    lines += [f"| {name} | {fmt(v)} | {sel} |" for name, v, sel in rows]
    if s.get("one_calibration_sample"):
        lines += ["", "Every seed calibrated on the same images (the fit split holds fewer than --calib-batches x "
                      "--batch-size), so the PTQ rows are one measurement each, with no seed-to-seed noise."]
    claims = [("Quantization cost (delivered - its FP control)", s.get("quantization_cost")),
              ("Mixed precision - its FP control", s.get("mixed_vs_fp_ft")), ("Mixed precision - FP32", s.get("mixed_vs_fp")),
              ("Delivered - FP32", s.get("user_gain")),
              (f"Delivered - best fixed PTQ on val ({s['best_fixed_on_val']})", s.get("final_vs_best_fixed")),
              (f"PTQ auto - best fixed PTQ on val ({s['best_fixed_on_val']})", s.get("auto_vs_best_fixed")),
              ("QAT best epoch - PTQ chosen on select", s.get("qat_vs_best_ptq")),
              ("PTQ per-quantizer - PTQ auto among the one-rule methods", s.get("per_quantizer_vs_global_auto")),
              ("PTQ chosen on select - FP32", s.get("best_ptq_vs_fp"))]
    lines += [""] + [f"- {name}: {fmt_difference(d)}" for name, d in claims if d]
    if "ort_vs_pytorch" in s:
        lines.append("- Deployed graphs - PyTorch: " + ", ".join(f"{d} {fmt_difference(v)}"
                                                                  for d, v in s["ort_vs_pytorch"].items()))
    if "ort_ptq" in s:
        lines.append("- " + ort_ptq_line(e, s))
    if "modelopt" in s:
        ours = "QAT" if "qat_vs_modelopt" in s else "Best PTQ"
        peer_rows = e["modelopt"][e["modelopt_choice"]]
        lint, on = next(iter(peer_rows.values()))["lint"], ""
        if len(peer_rows) < seeds:
            on = f" on the same seed{'s' if len(peer_rows) > 1 else ''} ({', '.join(peer_rows)})"
        lines.append(f"- {ours}{on} - Model Optimizer ({e['modelopt_choice']}): "
                     f"{fmt_difference(s.get('qat_vs_modelopt') or s['ptq_vs_modelopt'])}; unshared-scale joins: "
                     f"ours {e['ours_lint']['unshared_joins']} ({e['ours_lint']['graph']} graph), Model Optimizer "
                     f"{lint['unshared_joins']}")
    return "\n".join(lines)


def auto_select(e: dict, metric: str) -> dict | None:
    """The select mAP of the candidate `auto` chose, per seed: its PTQ row where the entry measured that method,
    else the score the run chose by where that score is `metric` (a detector's box mAP); None where neither is
    (a segmenter's score mixes boxes and masks)."""
    values = []
    for seed, r in e["qat"].items():
        chosen = r["auto"]["chosen"]
        if chosen in e["ptq"]:
            values.append(e["ptq"][chosen][seed]["select"][metric])
        elif "mask" not in e["summary"]:
            values.append(r["auto"]["candidates"][chosen])
        else:
            return None
    return spread(values)


def ort_ptq_line(e: dict, s: dict) -> str:
    """Where the rebuilt PTQ graphs ran, how long, their lint, and ONNX Runtime against PyTorch."""
    runs = e["ort_ptq"].values()
    lint = [r[g]["lint"] for r in runs for g in ORT_GRAPHS]
    where = "; ".join(f"seed {k} on the CPU ({r['machine']['cpu']}, {r['machine']['cpu_count']} cores"
                      f"{' of the ' + r['machine']['gpu'] + ' machine' if r['machine']['gpu'] else ''}, "
                      f"{r['wall_s']:.0f} s)" for k, r in e["ort_ptq"].items())
    worst = ", ".join(f"{g} {v:.4f}" for g, v in s["ort_ptq_vs_pytorch_max"].items())
    return (f"Rebuilt PTQ graphs ({where}): unshared-scale joins {sum(x['unshared_joins'] for x in lint)}, "
            f"unquantized convs {sum(x['unquantized_convs'] for x in lint)} over {len(lint)} graphs; "
            f"|ONNX Runtime - PyTorch| per seed at most: {worst}")


def _where(machine: dict) -> str:
    return machine["gpu"] or "CPU: " + machine["cpu"]


def _where_measured(prov: dict) -> str:
    """Where an entry's steps ran; where they ran elsewhere than the machine that wrote it (a benchmark resumed from
    their outputs), both."""
    steps, writer = prov.get("steps_ran_on") or [], _where(prov["machine"])
    if not steps or all(s.startswith(writer + " ") for s in steps):
        return writer
    return f"steps on {', '.join(steps)}; written on {writer} from their outputs"


def _commit(commit: str) -> str:
    """A short commit (the entry's provenance says whether the tree held changes beyond it)."""
    return commit[:10]


def training_table(out: Path) -> str:
    """The float models' trainings (scripts/train_float.py): how long, the best select epoch, convergence."""
    rows = []
    for f in sorted(out.glob("*/*/float/train.json")):
        t = json.loads(f.read_text())
        start, end = t["started"], t.get("last_epochs")
        since = f"{t['epochs_since_best']} epoch{'' if t['epochs_since_best'] == 1 else 's'} since the best"
        plateau = "" if not end or end["noise"] is None else \
            f"; last {end['window']}: rise {end['rise']:+.4f}, noise {end['noise']:.4f}"
        gpus = re.search(r"--nproc-per-node (\d+)", start["command"])
        sessions = start.get("sessions") or [{}]
        # the recorded sessions' total; where the last one exited non-zero, say so (a cut-off session may be missing)
        total = f"{t['train_seconds'] / 60:.1f} min" if t.get("train_seconds") else "not recorded"
        last = sessions[-1].get("exit")
        seconds = total if last == 0 or total == "not recorded" else \
            f"{total} in the {len(sessions)} recorded session(s), the last exited {last}"
        masks = f" / {t['best_select_mask_map']:.4f}" if "best_select_mask_map" in t else ""
        rows.append(f"| {f.parts[-4]} | {f.parts[-3]} | {t['epochs_run']} of {t['max_epochs']} | {t['best_epoch']} | "
                    f"{t['best_select_map']:.4f}{masks} | {'yes' if t['converged'] else 'no'} ({since}{plateau}) | "
                    f"{seconds} | {gpus[1] if gpus else 1} x {start['machine']['gpu']} | "
                    f"[curve](../{f.parent.relative_to(out.parent)}/curve.png) |")
    return _markdown(("Data", "Model", "Epochs run", "Best epoch", "Best select mAP50-95 (box / mask)", "Converged",
                      "Time", "GPUs", "Curve"), rows, "No float training recorded yet.")


LEAD = ("yolov9-c", "gelan-c")  # the family's flagship first


def headline_table(out: Path) -> str:
    """One row per accuracy entry, the flagship first: the float model, PTQ as `auto` delivers it, the default
    command's delivered INT8 model and its float control, on the reported val images (mean over seeds)."""
    rows = []
    for e in _lead_first(e for e in entries(out) if "mask" not in e["summary"]):
        s, prov = e["summary"], e["provenance"]
        images = prov["split"]["images"]
        steps = prov.get("steps_ran_on") or [f"{_where(prov['machine'])} (torch {prov['machine']['torch']})"]
        rows.append(f"| **{e['model']}** | {e['dataset']} ({images['fit']} + {images['select']} train, "
                    f"{images['val']} val) | {e['imgsz']} | {fmt(s['fp'])} | {fmt(s.get('auto'))} | "
                    f"{fmt(s.get('final'))} | {fmt_difference(s['user_gain']) if 'user_gain' in s else '-'} | "
                    f"{fmt(s.get('fp_ft_best'))} | {'; '.join(steps)} |")
    return _markdown(("Model", "Data (fit + select train images, val)", "px", "FP32", "INT8 PTQ (auto)",
                      "**INT8 delivered**", "Delivered - FP32", "FP32 fine-tune control", "Measured on"),
                     rows, "No benchmark entry yet.")


def _lead_first(found) -> list[dict]:
    return sorted(found, key=lambda e: (LEAD.index(e["model"].removesuffix("-seg")) if e["model"].removesuffix("-seg")
                                        in LEAD else len(LEAD), e["model"], e["dataset"]))


def segment_headline_table(out: Path) -> str:
    """The segmenters' entries: box and mask mAP50-95 of the same stages as the detectors' headline, masks scored
    whole as upstream's segment/val.py scores them."""
    rows = []
    for e in _lead_first(e for e in entries(out) if "mask" in e["summary"]):
        box, mask, prov = e["summary"], e["summary"]["mask"], e["provenance"]
        images = prov["split"]["images"]
        both = lambda k: f"{fmt(box.get(k))} / {fmt(mask.get(k))}"  # noqa: E731
        gains = " / ".join(fmt_difference(s["user_gain"]) if "user_gain" in s else "-" for s in (box, mask))
        rows.append(f"| **{e['model']}** | {e['dataset']} ({images['fit']} + {images['select']} train, "
                    f"{images['val']} val) | {e['imgsz']} | {both('fp')} | {both('auto')} | {both('final')} | "
                    f"{gains} | {both('fp_ft_best')} | {'; '.join(prov.get('steps_ran_on') or [_where(prov['machine'])])} |")
    return _markdown(("Model", "Data (fit + select train images, val)", "px", "FP32 box / mask", "INT8 PTQ (auto)",
                      "**INT8 delivered**", "Delivered - FP32", "FP32 fine-tune control", "Measured on"),
                     rows, "No segmentation entry yet.")


def recovery_table(out: Path) -> str:
    """What each tool of the toolkit recovered in the published runs (val mAP50-95 unless it says select)."""
    rows = []

    def row(tool, e, before, after, where="val"):
        rows.append(f"| {tool} | {e['model']} on {e['dataset']} | {fmt(before)} -> {fmt(after)} ({where}) | "
                    f"{fmt_difference(difference(after, before))} |")
    for e in entries(out):
        s = e["summary"]
        worst = min(s["ptq"], key=lambda m: s["ptq"][m]["mean"])
        if "auto" in s:
            row(f"`--calib-method auto` instead of the worst single method ({worst})", e, s["ptq"][worst], s["auto"])
            row("QAT (the default command) after the PTQ `auto` chose", e, s["auto"], s["final"])
    for e in entries(out) + [json.loads(f.read_text()) for f in sorted(out.glob("ptq-ranges/*/*/entry.json"))]:
        s = e["summary"]
        if "per_quantizer_vs_global_auto" in s:
            row("per-quantizer ranges instead of one method for every quantizer", e, s["global_auto"],
                s["ptq"][PER_QUANTIZER])
    for folder in sorted(out.glob("*/*/max-loss")):
        e, runs = entry_beside(folder), comparable_reports(folder, entry_beside(folder))
        for budget in sorted({r["config"]["max_loss"] for r in runs if r["config"]["max_loss"] is not None}):
            mixed = [report_run(r) for r in runs if r["config"]["max_loss"] == budget]
            share = spread([m["int8_share"] for m in mixed])
            row(f"`--max-loss {budget:g}` (INT8 share of conv MACs {share['mean']:.3f})", e,
                spread([m["ptq_select"] for m in mixed]), spread([m["mixed_select"] for m in mixed]), "PTQ, select")
    return _markdown(("Tool", "Model", "Before -> after", "Gain"), rows, "No benchmark entry yet.")


def _sharing(entry: dict) -> str:
    """How many of the benchmark's runs shared how many devices, from its command line (--device, --jobs): the
    default command's runs, its float control's and its --max-loss variant's go side by side, --jobs of each."""
    args = shlex.split(entry["provenance"]["command"])
    value = lambda flag, default: args[args.index(flag) + 1] if flag in args else default  # noqa: E731
    phases = sum(k in entry for k in ("qat", "fp_ft", "mixed"))
    runs = min(int(value("--jobs", "1")), len(entry["provenance"]["seeds"])) * phases
    devices = value("--device", "0").split(",")
    where = "the CPU" if devices == ["cpu"] else f"{len(devices)} GPU{'s' if len(devices) > 1 else ''}"
    return f"{runs} runs at a time on {where}"


def timing_table(out: Path) -> str:
    """The default command's stages as the published runs took them (range over seeds; the runs shared their GPUs
    with the benchmark's other runs, so these are upper bounds for a run alone)."""
    def span(values, unit="s", digits=0):
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
        return f"{low} {unit}" if low == high else f"{low}-{high} {unit}"
    rows = []
    for e in entries(out):
        if "qat" not in e:
            continue
        runs, prov, st = list(e["qat"].values()), e["provenance"], e["settings"]
        steps = prov.get("steps_ran_on") or [_where(prov["machine"])]
        sec = [r["auto"]["seconds"] for r in runs]
        rows.append(f"| {e['model']} | {e['dataset']} | {'; '.join(steps)}, {_sharing(e)} | {st['imgsz']} | "
                    f"{st['calib_batches'] * st['batch_size']} images: {span([x['collect'] for x in sec])} | "
                    f"{prov['split']['images']['select']} images x {len(runs[0]['auto']['candidates'])} candidates: "
                    f"{span([x['ranges_and_evaluations'] for x in sec])} | "
                    f"{span([x['ranges'].get(PER_QUANTIZER) for x in sec])} | "
                    f"{span([r['train_img_s'] for r in runs], 'img/s')} |")
    return _markdown(("Model", "Data", "GPU", "px", "Calibration pass", "`auto`: ranges + select evaluations",
                      "of which the per-quantizer search", "QAT training"), rows, "No benchmark entry yet.")


def ptq_ranges_table(out: Path) -> str:
    """PTQ with every quantizer's range by one rule (auto's choice among max, mse, entropy, percentiles) against
    ranges chosen quantizer by quantizer, per model: the entries' and the PTQ-only ones under OUT/ptq-ranges."""
    rows = []
    for f in sorted(out.glob("*/*/entry.json")) + sorted(out.glob("ptq-ranges/*/*/entry.json")):
        e = json.loads(f.read_text())
        s = e["summary"]
        if "per_quantizer_vs_global_auto" not in s:
            continue
        per_q = e["ptq"][PER_QUANTIZER]
        choices = ", ".join(s["global_auto_choices"].values())
        select = [spread([e["ptq"][m][seed]["select"]["ap"] for seed, m in s["global_auto_choices"].items()]),
                  spread([r["select"]["ap"] for r in per_q.values()])]
        search = [r["ranges_s"] for r in per_q.values() if "ranges_s" in r]
        rows.append(f"| {e['model']} | {e['dataset']} | {_where_measured(e['provenance'])} | {fmt(s['fp'])} | "
                    f"{fmt(select[0])} | {fmt(select[1])} | {fmt(s['global_auto'])} ({choices}) | "
                    f"{fmt(s['ptq'][PER_QUANTIZER])} | {fmt_difference(s['per_quantizer_vs_global_auto'])} | "
                    f"{len(s['per_quantizer_won'])} of {len(per_q)} | "
                    f"{fmt_difference(s['auto_with_vs_without_per_quantizer'])} | "
                    + (f"{min(search):.0f}-{max(search):.0f} s |" if search else "not recorded |"))
    return _markdown(("Model", "Data", "Where", "Float, val", "One-rule auto, select", "Per-quantizer, select",
                      "One-rule auto, val (its choice per seed)", "Per-quantizer, val", "Per-quantizer - one-rule",
                      "Seeds it won on select", "Auto with it - without it, val", "Search time per seed"),
                     rows, "No per-quantizer PTQ recorded yet.")


def _markdown(header: tuple[str, ...], rows: list[str], none: str) -> str:
    """A markdown table of already formatted rows, or `none` where there are none."""
    if not rows:
        return none
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows])


def demo_table(out: Path) -> str:
    """The demo's last recorded run (scripts/demo.sh with RECORD=1)."""
    f = out / "demo" / "demo.json"
    if not f.is_file():
        return "No demo run recorded yet."
    d = json.loads(f.read_text())
    return (f"{d['table']}\n\n({d['where']}, commit {d['commit'][:10]}: {d['minutes']:.1f} min in all, "
            f"{d['install']}; "
            f"{d['data']}. A single run: the calibration method and the delivered stage were chosen on "
            f"{d['report']['select']['images']} held-out training images (the select rows), the other rows are "
            f"measured on the val images; it shows the workflow runs, not an accuracy claim (the table below is "
            f"that); on another CPU a few INT8 roundings flip and these figures move a little.)")


def backends_table(out: Path) -> str:
    """The two quantization backends side by side (scripts/benchmark_backends.py), one table per recorded model."""
    parts = []
    for f in sorted((out / "backends").glob("*.json")):
        b = json.loads(f.read_text())
        r, m = b["ranges"], b["machine"]
        parts.append(f"{b['table']}\n\n(`{Path(b['weights']).name}` at {b['imgsz']} px, {b['val_images']} val images of "
                     f"`{b['data']}`; both calibrated on the same {b['calibration_images']} training images; "
                     f"{m['cpu']}, {m['cpu_count']} cores, commit {_commit(b['commit'])}. Same quantizers: "
                     f"{b['backends']['modelopt']['quantizers']['distinct']} of each; weight ranges equal bit for bit "
                     f"for {r['weights_equal']} of {r['weights']}; activation ranges, `max`: median relative "
                     f"difference {r['max']['median_rel']:.1e}, largest {r['max']['largest_rel']:.1e}; `mse`: the "
                     f"same for {r['mse']['same']} of {r['mse']['of']}, largest {r['mse']['largest_rel']:.1e}.)")
    parts += [backends_qat_table(d) for d in sorted((out / "backends").iterdir()) if d.is_dir()]
    return "\n\n".join(parts) if parts else "No backend comparison recorded yet."


def backends_qat_table(folder: Path) -> str:
    """`qat.py quantize` with each backend, same flags and seeds: the runs' own report.json files, as BACKEND-SEED.json
    in `folder` (named after model, data and machine)."""
    runs: dict[str, list[dict]] = {}
    for f in sorted(folder.glob("*.json")):
        r = json.loads(f.read_text())
        runs.setdefault(r["config"]["quant"]["backend"], []).append(r)
    first = next(iter(runs.values()))[0]
    cfg = first["config"]
    lines = [f"**{folder.name}**: `qat.py quantize --calib-method {cfg['quant']['calib_method']} --epochs {cfg['epochs']} "
             f"--iters {cfg['iters']} --batch-size {cfg['batch_size']} --imgsz {cfg['imgsz']}`, seeds "
             f"{sorted({r['config']['seed'] for rs in runs.values() for r in rs})} (mean ± std over seeds; float model "
             f"on val {first['val']['origin']['ap']:.4f})", "",
             "| Backend | PTQ, select | last QAT epoch, select | delivered, val | last epoch's loss | s per epoch | "
             "s to insert quantizers |", "|---|---|---|---|---|---|---|"]
    for backend, rs in runs.items():
        lines.append(f"| {backend} | {fmt(spread([r['ptq']['ap'] for r in rs]))} | "
                     f"{fmt(spread([r['qat'][-1]['ap'] for r in rs]))} | "
                     f"{fmt(spread([r['val']['final']['ap'] for r in rs]))} | "
                     f"{fmt(spread([r['qat'][-1]['loss'] for r in rs]))} | "
                     f"{fmt(spread([r['qat'][-1]['train_s'] for r in rs]), 1)} | "
                     f"{fmt(spread([r['calibration']['seconds']['insert_quantizers'] for r in rs]), 1)} |")
    return "\n".join(lines)


def ablation_table(out: Path) -> str:
    """Recipe variants on the select split (scripts/benchmark_accuracy.py --ablation): each dataset's latest
    (ablation.json) first, then earlier ones kept under another name (ablation-COMMIT.json)."""
    parts = []
    for f in sorted(out.glob("*/*/ablation*.json"), key=lambda f: (f.parent, f.name != "ablation.json", f.name)):
        a = json.loads(f.read_text())
        select = a["provenance"]["split"]["images"]["select"]
        entry = f.parent / "entry.json"
        other = json.loads(entry.read_text())["provenance"]["weights_sha256"] if entry.is_file() else None
        model = f"; another float model than the accuracy entry's (weights sha256 " \
                f"{a['provenance']['weights_sha256'][:8]}, the entry's {other[:8]})" \
            if other and other != a["provenance"]["weights_sha256"] else ""
        lines = [f"**{a['model']}** on {a['dataset']}, select split ({select} images), from PTQ {a['calibration']} "
                 f"({len(a['provenance']['seeds'])} seeds, commit {_commit(a['provenance']['commit'])}{model})", "",
                 "| Variant | What | Best-epoch mAP50-95 on select | vs default | Last epoch | vs default | "
                 "Delivered (best of PTQ and epochs) | vs default |",
                 "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {v} | {r['what']} | {fmt(r['select_best'])} | {fmt_difference(r['vs_default'])} | "
                  + " | ".join(f"{fmt(r[column])} | {fmt_difference(r[vs])}" if column in r else "not recorded | "
                               for column, vs in (("select_last", "last_vs_default"),
                                                  ("select_delivered", "delivered_vs_default"))) + " |"
                  for v, r in a["variants"].items()]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else "No ablation recorded yet."


def rendered(out: Path, docs: bool) -> dict[Path, dict[str, str]]:
    """Every rendered block, by file: OUT/accuracy.md, and with `docs` this repository's docs/RESULTS.md and
    README.md (nothing outside --out otherwise)."""
    tables = [model_table(e, metric) for e in entries(out) for metric in ("ap", "mask_ap")
              if metric == "ap" or "mask" in e["summary"]]
    accuracy = "\n\n".join(tables) if tables else "No benchmark entry yet."
    files = {out / "accuracy.md": {"accuracy": accuracy}}
    if docs:
        files[REPO / "docs" / "RESULTS.md"] = {"accuracy": accuracy, "float-training": training_table(out),
                                               "ablation": ablation_table(out),
                                               "ptq-ranges": ptq_ranges_table(out),
                                               **{name: experiment_table(out, x) for name, x in EXPERIMENTS.items()}}
        files[REPO / "README.md"] = {"headline": headline_table(out), "headline-segment": segment_headline_table(out),
                                     "recovery": recovery_table(out),
                                     "timing": timing_table(out), "demo": demo_table(out),
                                     "backends": backends_table(out)}
    return files


def refresh_summaries(out: Path, check: bool) -> list[str]:
    """Each entry's stored summary recomputed from its per-seed numbers by today's rules (derived, never measured):
    written back, or with `check` the entries whose summary is out of date."""
    stale = []
    for f in sorted(out.glob("*/*/entry.json")) + sorted(out.glob("ptq-ranges/*/*/entry.json")):
        e = json.loads(f.read_text())
        summary = json.loads(json.dumps(summarize(e)))  # as stored: JSON types
        if e.get("summary") != summary:
            stale.append(f"{f}: summary out of date")
            if not check:
                e["summary"] = summary
                write_json(f, e)
    return stale


def render(out: Path, check: bool, docs: bool) -> int:
    try:
        stale = refresh_summaries(out, check)
        if check and stale:
            print("\n".join(stale))
            print("benchmark_accuracy: run `python scripts/benchmark_accuracy.py --render`", file=sys.stderr)
            return 1
        files = rendered(out, docs)
        diffs = render_files(files, check)
    except ValueError as e:  # a file whose markers were removed, results that do not fit: name it, write nothing
        print(f"benchmark_accuracy: error: {e}", file=sys.stderr)
        return 1
    if check and diffs:
        print("\n".join(diffs))
        print("benchmark_accuracy: the files above are not what the results JSON renders to; run "
              "`python scripts/benchmark_accuracy.py --render`", file=sys.stderr)
        return 1
    print(f"benchmark_accuracy: {'checked' if check else 'rendered'} {len(files)} files")
    return 0
