#!/usr/bin/env python3
"""Accuracy benchmark: float vs PTQ (each calibration method) vs the default `qat.py quantize` command (`auto`
calibration, QAT, the best of PTQ and every QAT epoch delivered) vs its float control (the same fine-tune with
quantizers disabled) vs NVIDIA Model Optimizer's ONNX PTQ, over seeds, with every choice made on a selection split.

    python scripts/benchmark_accuracy.py --dataset helmet --data /data/helmet-416/data.yaml --imgsz 416 \\
        --models gelan-s=assets/gelan-s-helmet.pt --seeds 0 1 2 --device 0 --batch-size 32 [--modelopt [METHOD ...]]
    python scripts/benchmark_accuracy.py --render [--check] [--docs]   # tables in --out [and README, RESULTS]

Run from the patched YOLOv9 checkout. The training images are split into `fit` (calibration and fine-tuning) and
`select` (every choice: calibration method, delivered model, the peer's method) by the rule `qat.py quantize` itself
applies (utils/datasplit.py): each run carves it from --data and the benchmark checks that its
fingerprint is the benchmark's; the val images are only measured. Everything is written under --work and --out;
`--docs` also renders this repository's README.md and docs/RESULTS.md. Each seed draws its own calibration sample and fine-tuning order. Every step is one of this toolkit's
commands (qat.py, export_qat.py, val_trt.py) or Model Optimizer's, logged under --work and skipped when its output
exists, so a call that ran out of time resumes, on this machine or another (a qat.py folder made with other arguments
than --device and --workers is refused). The result of a model is OUT/<dataset>/<model>/entry.json:
provenance (commit, command, machine, seeds, split fingerprints, weights sha256) and every per-seed number.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from utils.benchmark_steps import (Bench, calibration_array, export, images_per_second, lint_summary,  # noqa: E402
                                   measure, mixed_summary, public, quantize_run, recipe_tag, run_step, sample_id,
                                   scored, select_curves, step_devices, yaml_split)
# calibration, not quantization.quantize: that imports upstream's models.common
from models.quantization.calibration import AUTO_CANDIDATES, calib_method_flags  # noqa: E402
from models.deployment.runners import ort_fp16_qdq_problem  # noqa: E402
from utils.batches import CACHE_CHOICES  # noqa: E402
from utils.benchmark_tables import model_table, render, summarize  # noqa: E402
from utils.datasplit import write_split  # noqa: E402
from utils.io_utils import atomic_write, write_json  # noqa: E402
from utils.provenance import command_line, machine, overlay_repo, sha256, toolkit_commit  # noqa: E402
from utils.results import difference, selection_score, spread  # noqa: E402

CALIBRATIONS = tuple(AUTO_CANDIDATES)  # each candidate of the default command's `auto`, measured on val too
# QAT recipe variants, each spelled out in full (the default is QATRecipe()'s): judged on select, over seeds
_HEAD = ["--distill", "head", "--lr-schedule", "cosine"]
ABLATION = {
    "default": ("head distillation + detection loss, Adam 1e-4 cosine", []),
    "lr-3e-5": ("the default at lr 3e-5", ["--lr", "3e-5"]),
    "lr-3e-4": ("the default at lr 3e-4", ["--lr", "3e-4"]),
    "head-only": ("head distillation, no detection loss", [*_HEAD, "--det-loss", "0"]),
    "det-only": ("detection loss on labels, no teacher", ["--distill", "none", "--det-loss", "1"]),
    "reference": ("NVIDIA's: per-layer MSE, Adam 1e-5, step schedule", ["--recipe", "reference"]),
    "ema": ("the default + weight EMA 0.995", ["--ema", "0.995"]),
    "learn-amax": ("the default + learned activation ranges", ["--learn-amax"]),
    "det-3": ("the default, detection loss weighted 3", ["--det-loss", "3"]),
    "layers-det": ("per-layer MSE distillation + detection loss, Adam 1e-4 cosine", ["--distill", "layers"]),
    # finetune_args' --epochs is overridden by the variant's (the last one given wins)
    "long": ("the default over 10 epochs (the published runs have 5)", ["--epochs", "10"]),
    "float-2": ("the first 2 epochs in float, then calibrated anew and QAT", ["--float-epochs", "2"]),
    "float-3": ("the first 3 epochs in float, then calibrated anew and QAT", ["--float-epochs", "3"]),
    "control": ("float fine-tuning with the default recipe", ["--float-control"]),
    "long-control": ("float fine-tuning over 10 epochs", ["--epochs", "10", "--float-control"]),
}
MODELOPT_METHODS = ("max", "entropy")  # Model Optimizer's INT8 calibration methods
DFL_NODES = ".*dfl.*"  # the box decoder's fixed-weight conv: float in our graphs, so excluded from the peer's too
REPO = overlay_repo()


# --------------------------------------------------------------------------------------------------
# One model
# --------------------------------------------------------------------------------------------------
class ModelBench:
    def __init__(self, bench: Bench, name: str, weights: Path):
        self.bench, self.name, self.weights = bench, name, weights.resolve()
        self.work = bench.work / bench.dataset / name
        self.split = write_split(bench.data, bench.work / bench.dataset / "split")  # qat.py's own rule
        self.select_fingerprint = yaml_split(self.split)["fingerprint"]["select"]
        self.report_yaml = self._report_yaml()

    def _report_yaml(self) -> Path:
        """The split's yaml with val = the reported val images (train stays fit)."""
        import yaml
        spec = yaml.safe_load(self.split.read_text())
        spec["val"] = spec.pop("test")
        path = self.split.with_name("report.yaml")
        atomic_write(path, lambda tmp: Path(tmp).write_text(yaml.safe_dump(spec, sort_keys=False)))
        return path

    def pool(self):
        return ThreadPoolExecutor(self.bench.jobs)

    def on_both(self, model: Path, out: Path) -> dict:
        return {"select": measure(model, self.split, out / "select", self.bench),
                "val": measure(model, self.report_yaml, out / "val", self.bench)}

    def quantize(self, folder: str, seed: int, extra: list[str], slot: int) -> dict:
        """A `qat.py quantize` run on --data (it carves the select split itself; checked to be this benchmark's), on
        the device of `slot` (the runs of the phases going side by side are spread over --device)."""
        b = self.bench
        r = quantize_run([*b.common(self.weights, Path(b.data), slot), "--seed", str(seed), "--no-eval-origin", *extra],
                         self.work / folder, b.env_for(b.device_for(slot)))
        if r["select"]["fingerprint"] != self.select_fingerprint:
            raise RuntimeError(f"{self.work / folder}: qat.py held out other select images than the benchmark's split")
        return r

    def finetune_args(self, *extra: str) -> list[str]:
        b = self.bench
        return ["--epochs", str(b.qat_epochs), "--iters", str(b.iters), "--no-eval-ptq", *extra]

    def default_command(self, extra: tuple[str, ...] = (), finetune: bool = True) -> dict[str, dict]:
        """The command users run, per seed: `auto` calibration (every candidate measured on select), QAT, the
        delivered model (the best on select of PTQ and every QAT epoch); its report.json. `extra`: the flags of a
        variant of it (--max-loss). The plain command also saves each calibration candidate's model (measurement
        only: `ptq` measures them on val), and without `finetune` it stops after PTQ."""
        b = self.bench
        tag = ("qat" if finetune else "ptq-auto") + recipe_tag(b.qat_args + extra)
        args = [*self.finetune_args(*b.qat_args, *extra)] if finetune else ["--epochs", "0", *extra]
        save = [] if extra else ["--save-candidates"]
        slot = 2 * len(b.seeds) if extra else 0  # beside the control's runs (slots len(seeds)...)

        def one(s):
            return self.quantize(f"{tag}-seed{s}", s, [*args, *save], slot + b.seeds.index(s))
        with self.pool() as pool:
            return dict(zip(map(str, b.seeds), pool.map(one, b.seeds)))

    def ptq(self, reports: dict[str, dict]) -> dict:
        """Every calibration candidate x seed, from the default command's one calibration per seed (a run with
        `--calib-method X` computes the same ranges from the same statistics: tests/test_quantize.py): select as
        measured in the run, val measured here."""
        b = self.bench
        jobs = [(m, s) for m in b.methods for s in map(str, b.seeds)]

        def one(job):
            m, s = job
            r = reports[s]
            cal, saved = r["calibration"], r["calibration"]["saved"][m]
            seconds = cal["seconds"]["collect"] + cal["seconds"]["ranges"][m]
            return {"select": saved["metrics"],
                    "val": measure(Path(saved["file"]), self.report_yaml, Path(r["save_dir"]) / f"val-ptq-{m}", b),
                    "calib_s": round(seconds, 2), "ranges_s": cal["seconds"]["ranges"][m],
                    "calibration_sample": sample_id(r["calibration_images"]),
                    "calibration_images": r["calibration_images"], "file": saved["file"]}
        with self.pool() as pool:
            runs = dict(zip(jobs, pool.map(one, jobs)))
        return {m: {s: runs[(m, s)] for s in map(str, b.seeds)} for m in b.methods}

    def qat_rows(self, reports: dict[str, dict]) -> dict:
        """What the entry keeps of each default-command run: auto's choice and every candidate's select mAP, QAT
        by epoch, the delivered model; the PTQ model, the best QAT epoch, the last and the delivered one on val."""
        b = self.bench

        def one(s):
            r = reports[s]
            d = Path(r["save_dir"])
            cal, final, epochs = r["calibration"], r["final"], r["qat"]
            # the PTQ model of the plain command is its chosen candidate's: one measurement serves both rows
            ptq_folder = d / (f"val-ptq-{cal['chosen']}" if cal["chosen"] in cal.get("saved", {}) else "val-ptq")
            ptq_val = measure(Path(r["ptq_file"]), self.report_yaml, ptq_folder, b)
            best, last = r["qat_best"], epochs[-1]
            val_best = measure(Path(r["qat_best_file"]), self.report_yaml, d / "val-best", b)
            val_last = val_best if best["epoch"] == last["epoch"] else \
                measure(Path(last["file"]), self.report_yaml, d / "val-last", b)
            per_quantizer = cal.get("per_quantizer")
            return {"recipe": r["config"]["qat"], "auto": {"chosen": cal["chosen"], "candidates": cal["candidates"],
                                                          "seconds": cal["seconds"], "val": ptq_val,
                                                          **({"per_quantizer": per_quantizer["counts"]}
                                                             if per_quantizer else {})},
                    "train_img_s": images_per_second(epochs, r["config"]["batch_size"], b.iters),
                    "best_epoch": best["epoch"], **select_curves(epochs), "val_best": val_best,
                    "val_last": val_last, "final": {"stage": final["stage"], "epoch": final["epoch"]},
                    "val_final": ptq_val if final["stage"] == "ptq" else val_best, "final_file": final["file"],
                    **({"training_masks": r["training_masks"]} if r.get("training_masks") else {}),
                    **({"mixed_precision": mixed_summary(r["mixed_precision"])} if "mixed_precision" in r else {})}
        with self.pool() as pool:
            return dict(zip(reports, pool.map(one, reports)))

    def control(self) -> dict:
        """The float control of the default command per seed: its best epoch on select and its last, on val."""
        b = self.bench
        tag = "fpft" + recipe_tag(b.qat_args)

        def one(s):
            d = self.work / f"{tag}-seed{s}"
            r = self.quantize(f"{tag}-seed{s}", s, self.finetune_args(*b.qat_args, "--float-control"),
                              len(b.seeds) + b.seeds.index(s))
            best, last = r["qat_best"], r["qat"][-1]
            val_best = measure(Path(r["qat_best_file"]), self.report_yaml, d / "val-best", b)
            return {"recipe": r["config"]["qat"], "best_epoch": best["epoch"], **select_curves(r["qat"]),
                    "val_best": val_best,
                    "val_last": val_best if best["epoch"] == last["epoch"] else
                    measure(Path(last["file"]), self.report_yaml, d / "val-last", b)}
        with self.pool() as pool:
            return dict(zip(map(str, b.seeds), pool.map(one, b.seeds)))

    def ablation(self, variants: tuple[str, ...]) -> dict:
        """Recipe variants x seed, as the default command with the variant's flags: the best epoch's and the last
        epoch's select mAP (val is not looked at). The best of more epochs is a maximum over more noisy values;
        the last epoch is not picked, so it compares schedules of different lengths without that bias."""
        b = self.bench
        variants = ("default", *(v for v in variants if v != "default"))
        jobs = [(v, s) for v in variants for s in b.seeds]

        def one(job):
            v, s = job
            same_as_qat = v == "default" and not b.qat_args  # the default command's own run, not a rerun
            r = self.quantize(f"qat-seed{s}" if same_as_qat else f"ablation-{v}-seed{s}", s,
                              [*self.finetune_args(*ABLATION[v][1]), *(["--save-candidates"] if same_as_qat else [])],
                              variants.index(v) * len(b.seeds) + b.seeds.index(s))
            return r["qat_best"]["ap"], r["qat"][-1]["ap"], r["final"]["ap"]
        with self.pool() as pool:
            runs = dict(zip(jobs, pool.map(one, jobs)))
        rows = {v: {"what": ABLATION[v][0], "args": ABLATION[v][1],
                    **{column: spread([runs[(v, s)][k] for s in b.seeds])
                       for k, column in enumerate(("select_best", "select_last", "select_delivered"))}}
                for v in variants}
        for row in rows.values():
            row["vs_default"] = difference(row["select_best"], rows["default"]["select_best"])
            row["last_vs_default"] = difference(row["select_last"], rows["default"]["select_last"])
            row["delivered_vs_default"] = difference(row["select_delivered"], rows["default"]["select_delivered"])
        result = {"model": self.name, "dataset": b.dataset, "calibration": "auto", "provenance": self.provenance(),
                  "settings": self.settings(), "variants": rows}
        write_json(b.out / b.dataset / self.name / "ablation.json", result)
        return result

    def deployed(self, qat: dict) -> dict:
        """The delivered model of the first --ort-seeds seeds as the FP32 and the FP16 graph, in ONNX Runtime on
        val (on the CPU: the bigger models' graphs take minutes each)."""
        b, dtypes = self.bench, ("fp32", "fp16")
        jobs = [(dtype, s) for dtype in dtypes for s in list(qat)[:b.ort_seeds]]

        def one(job):
            dtype, s = job
            graph = export(Path(qat[s]["final_file"]), dtype, b)
            out = self.work / f"ort{recipe_tag(b.qat_args)}-{dtype}-seed{s}"
            return {"val": measure(graph, self.report_yaml, out, b), "lint": lint_summary(graph)}
        with self.pool() as pool:
            runs = dict(zip(jobs, pool.map(one, jobs)))
        return {dtype: {s: r for (d, s), r in runs.items() if d == dtype} for dtype in dtypes}

    def modelopt(self, samples: dict[str, list[str]]) -> dict:
        """Model Optimizer's ONNX INT8 PTQ of the float model, each method x seed, calibrated on the very images our
        calibration of that seed used (`samples`: names per seed, in order), the DFL conv kept float as in ours."""
        b = self.bench
        fp_onnx = export(self._float_copy(), "fp32", b)
        jobs = [(m, s) for m in b.modelopt for s in b.seeds]

        def one(job):
            m, s = job
            files = samples[str(s)]
            calib = calibration_array(self.split, files, b.imgsz, self.work / f"modelopt-calib-seed{s}.npy")
            q = self.work / f"modelopt-{m}-seed{s}" / "model.onnx"
            if not q.is_file():  # its own copy of the input: Model Optimizer writes intermediate files beside it
                q.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(fp_onnx, q.with_name("float.onnx"))
                run_step([sys.executable, "-m", "modelopt.onnx.quantization",
                          "--onnx_path", str(q.with_name("float.onnx")),
                          "--quantize_mode", "int8", "--calibration_method", m, "--calibration_data_path", str(calib),
                          "--calibration_eps", "cpu", "--high_precision_dtype", "fp32", "--nodes_to_exclude", DFL_NODES,
                          "--output_path", str(q)], q.with_suffix(".log"), b.step_env)
            return {**self.on_both(q, self.work / f"ort-modelopt-{m}-seed{s}"), "lint": lint_summary(q),
                    "calib_images": len(files), "calibration_sample": sample_id(files)}
        with self.pool() as pool:
            runs = dict(zip(jobs, pool.map(one, jobs)))
        return {m: {str(s): runs[(m, s)] for s in b.seeds} for m in b.modelopt}

    def add_modelopt(self, entry: dict, samples: dict[str, list[str]], ours: Path | None = None) -> None:
        """The peer's rows of --seeds in `entry` (beside those of other seeds it has), its choice on select, and the
        lint of one of our graphs beside its own (the placement of Q/DQ, which the lint counts, is the same for every
        seed): the delivered FP32 graph, linted when measured, of the peer's first seed if any; else the PTQ graph
        rebuilt from kept ranges (--add-ort); else one exported from `ours`."""
        rows = entry.setdefault("modelopt", {})
        for m, runs in self.modelopt(samples).items():
            rows[m] = dict(sorted({**rows.get(m, {}), **runs}.items(), key=lambda kv: int(kv[0])))
        entry["modelopt_choice"] = max(rows, key=lambda m: spread([selection_score(r["select"])
                                                                   for r in rows[m].values()])["mean"])
        first = next(iter(rows[entry["modelopt_choice"]]))
        same_seed_first = lambda runs: sorted(runs.items(), key=lambda kv: kv[0] != first)  # noqa: E731
        linted = [({"graph": "delivered", "seed": int(s)}, r["lint"])
                  for s, r in same_seed_first(entry.get("ort", {}).get("fp32", {}))] + \
                 [({"graph": f"ptq-{r['method']} rebuilt from kept ranges", "seed": int(s)}, r["fp32"]["lint"])
                  for s, r in same_seed_first(entry.get("ort_ptq", {}))]
        if linted:
            entry["ours_lint"] = {**linted[0][0], **linted[0][1]}
        elif ours is not None:
            entry["ours_lint"] = {"graph": "delivered" if "qat" in entry else f"ptq-{entry['ptq_choice']}",
                                  "seed": self.bench.seeds[0], **lint_summary(export(ours, "fp32", self.bench))}
        else:
            raise RuntimeError(f"{self.name}: the entry has no graph of ours to lint: --add-ort first")

    def existing_entry(self, flag: str, all_seeds: bool) -> tuple[Path, dict]:
        """This model's entry, for a step added to it later (its run folders may be gone): checked to be made from
        these weights, this split and these settings (--seeds: the entry's, or with `all_seeds` False some of
        them)."""
        b = self.bench
        path = b.out / b.dataset / self.name / "entry.json"
        if not path.is_file():
            raise RuntimeError(f"{flag}: {path} not found: run the benchmark first")
        entry = json.loads(path.read_text())
        prov, settings = entry["provenance"], entry["settings"]
        if sha256(self.weights) != prov["weights_sha256"]:
            raise RuntimeError(f"{flag}: --models {self.name}={self.weights} is not the model of {path}")
        if yaml_split(self.split)["fingerprint"] != prov["split"]["fingerprint"]:
            raise RuntimeError(f"{flag}: --data {b.data} splits into other images than {path} records")
        given = {"imgsz": b.imgsz, "batch_size": b.batch_size, "calib_batches": b.calib_batches}
        made = {k: settings[k] for k in given}
        if given != made:
            raise RuntimeError(f"{flag}: the entry was made with {made}, this command gives {given}")
        fits = list(b.seeds) == prov["seeds"] if all_seeds else set(b.seeds) <= set(prov["seeds"])
        if not fits:
            raise RuntimeError(f"{flag}: --seeds {' '.join(map(str, b.seeds))}: the entry's seeds are "
                               f"{' '.join(map(str, prov['seeds']))}")
        return path, entry

    def add_peer(self) -> dict:
        """Model Optimizer's PTQ added to this model's existing entry: each seed's calibration images drawn again
        by qat.py's own sampler (no image read) and checked against the digest the entry recorded; the entry's
        provenance gains where and by what this ran. --seeds may be some of the entry's (the peer is compared with
        ours on the same seeds)."""
        path, entry = self.existing_entry("--add-peer", all_seeds=False)
        from models.core.task import task_of
        from models.quantization.checkpoint import load_float_model
        task = task_of(load_float_model(str(self.weights), "cpu"))  # once: the sampler only needs the task's loader
        samples = {str(s): self._calibration_sample(task, s,
                                                    entry["ptq"][entry["ptq_choice"]][str(s)]["calibration_sample"])
                   for s in self.bench.seeds}
        self.add_modelopt(entry, samples)
        entry["provenance"]["peer"] = {"commit": toolkit_commit(), "command": command_line(), "machine": machine()}
        entry["summary"] = summarize(entry)
        write_json(path, entry)
        return entry

    def auto_method(self, entry: dict, seed: int) -> str:
        """The calibration `auto` delivered for `seed` (the PTQ stage of the default command)."""
        return entry["qat"][str(seed)]["auto"]["chosen"] if "qat" in entry else entry["ptq_choice"]

    def keep_ranges(self, seed: int, report: dict, weights_sha256: str) -> dict:
        """The ranges of a run's PTQ model (auto's candidate) saved beside the entry
        (models/quantization/saved_ranges.py): a
        later --add-ort rebuilds the model from them; the entry's record of them."""
        from models.quantization.checkpoint import load_quantized_model
        from models.quantization.saved_ranges import recipe_from_dict, save_ranges
        method = report["calibration"]["chosen"]
        sample = sample_id(report["calibration_images"])
        rel = Path("ranges") / f"seed{seed}.npz"
        save_ranges(load_quantized_model(report["ptq_file"]), self.bench.out / self.bench.dataset / self.name / rel,
                    recipe_from_dict(report["config"]["quant"]), seed=seed, method=method,
                    calibration_sample=sample, weights_sha256=weights_sha256)
        return {"file": str(rel), "method": method, "calibration_sample": sample}

    def add_ranges(self) -> dict:
        """Each --seeds seed's PTQ calibration made again as the entry's run made it (qat.py with the method `auto`
        chose for that seed: the same statistics give the same ranges; the same images, digest checked), its ranges
        kept beside the entry, and the model's select and val mAP against the entry's figures for that seed."""
        b = self.bench
        path, entry = self.existing_entry("--add-ranges", all_seeds=False)
        kept = entry.setdefault("ranges", {})
        for s in b.seeds:
            method = self.auto_method(entry, s)
            folder = f"ranges-{method}-seed{s}"
            r = self.quantize(folder, s, ["--epochs", "0", *calib_method_flags(method)], b.seeds.index(s))
            # the seed's one calibration sample (every method's row records it) and what auto's model measured
            ptq, auto = entry["ptq"], entry.get("qat", {}).get(str(s), {}).get("auto")
            want = {"calibration_sample": next(iter(ptq.values()))[str(s)]["calibration_sample"],
                    "select": auto["candidates"][method] if auto else selection_score(ptq[method][str(s)]["select"]),
                    "val": auto["val"] if auto else ptq[method][str(s)]["val"]}
            if sample_id(r["calibration_images"]) != want["calibration_sample"]:
                raise RuntimeError(f"--add-ranges: seed {s}: the run calibrated on other images than the entry's "
                                   f"({sample_id(r['calibration_images'])}, the entry {want['calibration_sample']})")
            val = measure(Path(r["ptq_file"]), self.report_yaml, self.work / folder / "val", b)
            select = scored(r["ptq"])
            kept[str(s)] = {**self.keep_ranges(s, r, entry["provenance"]["weights_sha256"]), "select": select,
                            "val": val,
                            "vs_entry": {"select": round(selection_score(select) - want["select"], 5),
                                         "val": round(val["ap"] - want["val"]["ap"], 5)},
                            "ran_on": step_devices(self.work / folder), "commit": toolkit_commit()}
        entry["summary"] = summarize(entry)
        write_json(path, entry)
        return entry

    def add_ort(self) -> dict:
        """For each --seeds seed whose ranges the entry keeps: the PTQ model rebuilt from the float weights and the
        ranges (the entry's weights and calibration sample, checked), measured on val in PyTorch and as the FP32 and
        FP16 Q/DQ graphs, plain and end to end, each linted and run in ONNX Runtime; where and how long."""
        import time
        from models.quantization.checkpoint import load_float_model, save_checkpoint
        from models.quantization.saved_ranges import rebuild_ptq
        b = self.bench
        path, entry = self.existing_entry("--add-ort", all_seeds=False)
        rows = entry.setdefault("ort_ptq", {})
        for s in b.seeds:
            kept = entry.get("ranges", {}).get(str(s))
            if kept is None:
                raise RuntimeError(f"--add-ort: seed {s}: {path} keeps no ranges for it (--add-ranges first)")
            t0 = time.perf_counter()
            try:
                model, meta = rebuild_ptq(load_float_model(self.weights), path.parent / kept["file"])
            except ValueError as e:  # not a ranges file, or ranges of another model
                raise RuntimeError(f"--add-ort: {e}") from None
            if (meta["calibration_sample"], meta["weights_sha256"]) != (kept["calibration_sample"],
                                                                        entry["provenance"]["weights_sha256"]):
                raise RuntimeError(f"--add-ort: {path.parent / kept['file']} was not calibrated for this entry's "
                                   f"seed {s} (its calibration sample or float weights differ)")
            folder = self.work / f"ort-ranges-seed{s}"
            weights = save_checkpoint(model, folder / f"{self.name}-ptq-{kept['method']}-seed{s}.pt")
            graphs = [(dtype, e2e) for dtype in ("fp32", "fp16") for e2e in (False, True)]

            def one(graph, weights=weights, folder=folder):
                dtype, e2e = graph
                t = time.perf_counter()
                onnx_file = export(weights, dtype, b, end2end=e2e)
                result = {"val": measure(onnx_file, self.report_yaml, folder / onnx_file.stem, b),
                          "lint": lint_summary(onnx_file)}
                return {**result, "seconds": round(time.perf_counter() - t, 1)}
            pytorch = measure(weights, self.report_yaml, folder / "pytorch", b)
            with self.pool() as pool:
                measured = dict(zip(graphs, pool.map(one, graphs)))
            rows[str(s)] = {"method": kept["method"], "pytorch": pytorch,
                            **{f"{d}{'_e2e' if e else ''}": r for (d, e), r in measured.items()},
                            "machine": machine(), "jobs": b.jobs, "wall_s": round(time.perf_counter() - t0, 1),
                            "commit": toolkit_commit()}
        entry["summary"] = summarize(entry)
        write_json(path, entry)
        return entry

    def _calibration_sample(self, task, seed: int, digest: str) -> list[str]:
        import yaml
        from models.pipeline import RunConfig, calibration_sample
        from models.quantization.quantize import QuantRecipe
        b = self.bench
        cfg = RunConfig(str(self.weights), b.data, "", imgsz=b.imgsz, batch_size=b.batch_size, workers=0, seed=seed,
                        quant=QuantRecipe(calib_batches=b.calib_batches))
        names = calibration_sample(task, yaml.safe_load(self.split.read_text())["train"], cfg)
        if sample_id(names) != digest:
            raise RuntimeError(f"--add-peer: seed {seed}: the calibration sample drawn again is not the one the entry "
                               "records (other --batch-size, --calib-batches or fit images?)")
        return names

    def _float_copy(self) -> Path:
        copy = self.work / f"fp-{self.weights.name}"  # exports are written beside their .pt: not the user's folder
        if not copy.is_file():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.weights, copy)
        return copy

    def run(self, ablation: tuple[str, ...] = ()) -> dict:
        """The independent phases side by side, each with --jobs runs at a time: the default command, its float
        control and its --max-loss variant; once the default command is done, its candidates and stages measured on
        val and its delivered graphs in ONNX Runtime."""
        b, skip = self.bench, self.bench.skip
        finetune = "qat" not in skip
        with ThreadPoolExecutor(6) as phases:
            fp = phases.submit(self.on_both, self.weights, self.work / "fp")
            default = phases.submit(self.default_command, (), finetune)
            control = phases.submit(self.control) if finetune and "fp_ft" not in skip else None
            mixed = phases.submit(self.default_command, ("--max-loss", f"{b.max_loss:g}")) \
                if finetune and b.max_loss is not None else None
            reports = default.result()
            ptq = phases.submit(self.ptq, reports)
            qat = self.qat_rows(reports) if finetune else None
            deployed = phases.submit(self.deployed, qat) if qat and "ort" not in skip else None
            ptq = ptq.result()
            choice = max(ptq, key=lambda m: spread([selection_score(r["select"]) for r in ptq[m].values()])["mean"])
            entry = {"model": self.name, "dataset": b.dataset, "imgsz": b.imgsz, "provenance": self.provenance(),
                     "settings": self.settings(), "fp": fp.result(),
                     "ptq": {m: {s: public(r) for s, r in runs.items()} for m, runs in ptq.items()},
                     "ptq_choice": choice, "not_run": list(skip)}
            entry["ranges"] = {s: self.keep_ranges(int(s), r, entry["provenance"]["weights_sha256"])
                               for s, r in reports.items()}
            ours = Path(ptq[choice][str(b.seeds[0])]["file"])  # the deployed graph of our best stage
            if qat:
                entry["qat"] = {s: public(r) for s, r in qat.items()}
                ours = Path(qat[str(b.seeds[0])]["final_file"])
            if deployed:
                entry["ort"] = deployed.result()
            if control:
                entry["fp_ft"] = control.result()
            if mixed:
                entry["mixed"] = {s: public(r) for s, r in self.qat_rows(mixed.result()).items()}
        if ablation:
            self.ablation(ablation)
        if b.modelopt:
            self.add_modelopt(entry, {s: r["calibration_images"] for s, r in ptq[choice].items()}, ours)
        entry["summary"] = summarize(entry)
        write_json(b.out / b.dataset / self.name / "entry.json", entry)
        return entry

    def provenance(self) -> dict:
        digest = sha256(self.weights)
        train = self.bench.out / self.bench.dataset / self.name / "float" / "train.json"
        trained = json.loads(train.read_text()) if train.is_file() else {}
        return {"commit": toolkit_commit(), "command": command_line(), "machine": machine(),
                "steps_ran_on": step_devices(self.work),
                "weights": str(self.weights.relative_to(REPO) if self.weights.is_relative_to(REPO) else self.weights),
                "weights_sha256": digest, "seeds": list(self.bench.seeds),
                "split": yaml_split(self.split),
                "float_training": {k: trained[k] for k in ("epochs_run", "best_epoch", "best_select_map", "converged")}
                if digest in (trained.get("weights_sha256"), (trained.get("converted") or {}).get("weights_sha256"))
                else None}

    def settings(self) -> dict:
        return {k: v for k, v in asdict(self.bench).items() if k not in ("work", "out", "data", "jobs", "device",
                                                                        "skip", "ort_seeds", "max_loss", "cache")}


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="helmet", help="label of the data (entries are grouped by it)")
    p.add_argument("--data", help="dataset.yaml (train and val); the select split is carved from train")
    p.add_argument("--models", nargs="*", default=[], help="NAME=weights.pt (trained, converted float models)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", choices=CALIBRATIONS, default=list(CALIBRATIONS),
                   help="the default command's calibration candidates also measured on val (each one's PTQ row)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--device", default="0")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--qat-epochs", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--qat-args", default="", help="extra qat.py quantize flags for QAT and its control")
    p.add_argument("--workers", type=int, default=8, help="dataloader workers per run")
    p.add_argument("--cache", choices=CACHE_CHOICES, default=None,
                   help="qat.py quantize --cache for every run (default: qat.py's; the same batches: where it runs, "
                        "not what it measures)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time in each of two phases side by side")
    p.add_argument("--ort-seeds", type=int, default=None,
                   help="the first N seeds' delivered graphs measured in ONNX Runtime (default: every seed)")
    p.add_argument("--modelopt", nargs="*", choices=MODELOPT_METHODS, default=None, metavar="METHOD",
                   help=f"also run NVIDIA Model Optimizer's ONNX PTQ with these calibration methods (none named: "
                        f"{' and '.join(MODELOPT_METHODS)}); with --add-peer, the methods it adds")
    p.add_argument("--add-peer", action="store_true",
                   help="only add Model Optimizer's PTQ to each model's existing entry (its run folders may be gone): "
                        "the entry's command with --add-peer (--seeds: all of the entry's, or some)")
    p.add_argument("--add-ranges", action="store_true",
                   help="only calibrate --seeds again as each model's entry did and keep the ranges beside it")
    p.add_argument("--add-ort", action="store_true",
                   help="only add ONNX Runtime rows of the PTQ models rebuilt from the ranges an entry keeps")
    p.add_argument("--max-loss", type=float, default=None,
                   help="also run the default command with this mixed-precision budget (qat.py quantize --max-loss)")
    p.add_argument("--ablation", nargs="*", choices=sorted(ABLATION), default=None, metavar="VARIANT",
                   help=f"also run these QAT recipe variants beside the default, judged on select (none named: all "
                        f"of {', '.join(ABLATION)})")
    p.add_argument("--skip", nargs="*", choices=("qat", "fp_ft", "ort"), default=[],
                   help="stages left out (e.g. on a CPU, where fine-tuning takes hours); the entry says so")
    p.add_argument("--work", type=Path, default=Path("runs/benchmark"), help="run folders, logs, models")
    p.add_argument("--out", type=Path, default=REPO / "results", help="entries and rendered tables")
    p.add_argument("--render", action="store_true", help="only render the tables from the entries")
    p.add_argument("--check", action="store_true", help="with --render: fail if a rendered file is out of date")
    p.add_argument("--docs", action="store_true",
                   help="also render this repository's README.md and docs/RESULTS.md from --out (default: only --out)")
    opt = p.parse_args(argv)
    opt.models = dict(_pairs(p, opt.models))
    for name, weights in opt.models.items():
        if not Path(weights).is_file():
            p.error(f"--models {name}={weights}: file not found")
    if opt.models and not (opt.data and Path(opt.data).is_file()):
        p.error(f"--data {opt.data}: file not found")
    if len(set(opt.seeds)) < len(opt.seeds):
        p.error(f"--seeds {' '.join(map(str, opt.seeds))}: repeated")
    if (opt.modelopt is not None or opt.add_peer) and importlib.util.find_spec("modelopt") is None:
        p.error(f"{'--add-peer' if opt.add_peer else '--modelopt'}: nvidia-modelopt is not installed "
                "(./install_dependencies.sh --modelopt)")
    if sum((opt.add_peer, opt.add_ranges, opt.add_ort)) > 1:
        p.error("--add-peer, --add-ranges and --add-ort: one at a time")
    if opt.models and (opt.add_ort or not (opt.add_peer or opt.add_ranges or "ort" in opt.skip)):
        # the FP16 graphs' rows come last: refused now, not after every other step has run
        import onnxruntime
        if problem := ort_fp16_qdq_problem(onnxruntime.__version__):
            p.error(f"--add-ort: {problem}" if opt.add_ort else f"the ONNX Runtime rows (FP16 graphs): {problem}, "
                    "or --skip ort")
    if opt.check and not opt.render:
        p.error("--check goes with --render")
    return opt


def _pairs(parser, items):
    for item in items:
        name, _, value = item.partition("=")
        if not name or not value:
            parser.error(f"--models {item}: expected NAME=weights.pt")
        yield name, value


def peer_methods(opt: argparse.Namespace) -> tuple[str, ...]:
    """Model Optimizer's calibration methods this command runs: none without --modelopt or --add-peer, every one
    where --modelopt names none."""
    if opt.modelopt is None and not opt.add_peer:
        return ()
    return tuple(dict.fromkeys(opt.modelopt or MODELOPT_METHODS))


def bench_from(opt: argparse.Namespace) -> Bench:
    """The run's settings; its steps' thread count is the caller's, read now, before the models' loading imports
    upstream's utils.general (which resets OMP_NUM_THREADS for every process started after it)."""
    return Bench(opt.dataset, str(Path(opt.data).resolve()), opt.imgsz, opt.device, opt.batch_size, opt.workers,
                 tuple(opt.seeds), tuple(opt.methods), opt.qat_epochs, opt.iters, opt.calib_batches,
                 tuple(shlex.split(opt.qat_args)), peer_methods(opt), tuple(opt.skip), opt.jobs,
                 opt.ort_seeds or len(opt.seeds), opt.work.resolve(), opt.out.resolve(), opt.max_loss, opt.cache,
                 os.environ.get("OMP_NUM_THREADS"))


def main(argv=None) -> int:
    opt = parse_opt(argv)
    if opt.render:
        return render(opt.out, opt.check, opt.docs)
    bench = bench_from(opt)
    ablation = () if opt.ablation is None else tuple(opt.ablation) or tuple(ABLATION)
    for name, weights in opt.models.items():
        try:
            model = ModelBench(bench, name, Path(weights))
            entry = model.add_peer() if opt.add_peer else model.add_ranges() if opt.add_ranges else \
                model.add_ort() if opt.add_ort else model.run(ablation)
        except RuntimeError as e:  # a step that failed (its log's tail), or a folder of another run: no traceback
            print(f"benchmark_accuracy: error: {e}", file=sys.stderr)
            return 1
        print(model_table(entry), flush=True)
    return render(opt.out, check=False, docs=opt.docs)


if __name__ == "__main__":
    sys.exit(main())
