"""Every choice made on the select split (utils/datasplit.py owns the split itself): one mechanism for `qat.py
quantize`, `qat.py sensitive` and the accuracy benchmark.

The calibration method, the tensors kept in float (models/mixed_precision.py), the best QAT epoch and the delivered
model (the best of the PTQ model and every QAT epoch) are chosen on the select images; the val images are only
measured. `choose` is the rule for every choice: the highest score, the first candidate on a tie (candidates are
listed cheapest first, so a tie keeps the simpler one).
"""
from __future__ import annotations

from typing import Callable


def choose(scores: dict[str, float | None]) -> str:
    """The candidate with the highest score; the first one listed on a tie. Unmeasured (None) candidates lose."""
    measured = {k: v for k, v in scores.items() if v is not None}
    if not measured:
        raise ValueError("no candidate was measured")
    return max(measured, key=lambda k: (measured[k], -list(scores).index(k)))


def choose_calibration(apply: Callable[[str], None], measure: Callable[[str], dict | None],
                       score: Callable[[dict], float], candidates: list[str], broadcast: Callable = lambda x: x
                       ) -> tuple[str, dict[str, dict | None]]:
    """Each candidate's ranges applied in turn and measured (`measure` returns None on ranks that do not
    evaluate; `broadcast` gives every rank the evaluating rank's results); the best applied. Returns its name and
    every candidate's metrics."""
    results = {}
    for name in candidates:
        apply(name)
        results[name] = measure(name)
    results = broadcast(results)
    best = choose({k: None if v is None else score(v) for k, v in results.items()})
    apply(best)
    return best, results
