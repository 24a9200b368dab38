"""Numbers over seeds, the noise rule, and Markdown blocks rendered from results JSON.

A difference is only called a difference where it exceeds the noise: "A > B" where mean(A) - mean(B) is larger
than the larger of the two seed-to-seed standard deviations, else "within noise". A side that varies with the
seed needs at least two seeds for that: with one, there is no noise estimate and no verdict. A fixed value (the
float model's mAP, which no seed changes) is exact with one. Tables in README.md and
docs/RESULTS.md live between `<!-- results:NAME -->` and `<!-- /results:NAME -->` markers and are rewritten
from the JSON, never by hand.
"""
from __future__ import annotations

import difflib
import re
import statistics
from pathlib import Path


def spread(values: list[float], fixed: bool = False) -> dict:
    """Mean, sample standard deviation (0 for a single value) and the values themselves; `fixed`: a value no seed
    changes (one is exact)."""
    values = [float(v) for v in values]
    return {"mean": round(statistics.fmean(values), 5), "std": round(statistics.stdev(values), 5) if len(values) > 1
            else 0.0, "n": len(values), "values": [round(v, 5) for v in values], **({"fixed": True} if fixed else {})}


def selection_score(metrics: dict) -> float:
    """What picks among stages, candidates and epochs: box mAP50-95, plus mask mAP50-95 where masks were measured."""
    return metrics["ap"] + metrics.get("mask_ap", 0.0)


def difference(a: dict, b: dict) -> dict:
    """a - b of two spreads: the difference of the means, the larger std (the noise it is judged against) and the
    verdict; no verdict where a side that varies with the seed has fewer than two values."""
    delta = a["mean"] - b["mean"]
    noise = max(a["std"], b["std"])
    if any(side["n"] < 2 and not side.get("fixed") for side in (a, b)):
        return {"delta": round(delta, 5), "noise": None, "verdict": "no noise estimate: one value"}
    verdict = "within noise" if abs(delta) <= noise else ("higher" if delta > 0 else "lower")
    return {"delta": round(delta, 5), "noise": round(noise, 5), "verdict": verdict}


def fmt(s: dict | None, digits: int = 4) -> str:
    """'0.5745 ± 0.0012 (3)', or '-'."""
    if not s:
        return "-"
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f} (1)"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} ({s['n']})"


def fmt_difference(d: dict) -> str:
    sign = f"{d['delta']:+.4f}"
    return f"{sign} ({d['verdict']})" if d["noise"] is None else f"{sign} ({d['verdict']}, noise {d['noise']:.4f})"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- results:{name} -->", f"<!-- /results:{name} -->"


def replace_block(text: str, name: str, content: str) -> str:
    """`text` with the block `name` replaced by `content`; the markers must be there."""
    start, end = _markers(name)
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} block to render into")
    return pattern.sub(lambda _: f"{start}\n{content.rstrip()}\n{end}", text, count=1)


def blocks_in(text: str) -> list[str]:
    return re.findall(r"<!-- results:([\w.-]+) -->", text)


def render_files(files: dict[Path, dict[str, str]], check: bool) -> list[str]:
    """Write each file's blocks ({path: {block name: content}}), or with `check` only compare. Returns the unified
    diffs of the files that differ (empty: all up to date). Every file is rendered before any is written, so a
    missing block leaves all of them as they were."""
    changed, diffs = {}, []
    for path, blocks in files.items():
        old = path.read_text() if path.is_file() else ""
        new = old
        for name, content in blocks.items():
            try:
                new = replace_block(new, name, content) if old else _standalone(new, name, content)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
        if new != old:
            changed[path] = new
            diffs.append("".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(path),
                                                      f"{path} (rendered)")))
    if not check:
        for path, new in changed.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(new)
    return diffs


def _standalone(text: str, name: str, content: str) -> str:
    """A new file made of the block alone."""
    start, end = _markers(name)
    return (text + "\n" if text else "") + f"{start}\n{content.rstrip()}\n{end}\n"
