"""models/ split by stage (models/*/__init__.py say what each holds): each package imports only the packages below
it, and utils/ imports none of models/. Read from the source (every import, function-level ones included), so a
dependency added against the order fails here before it becomes a cycle."""
from __future__ import annotations

import ast

from conftest import REPO

UPSTREAM = {"models.common", "models.yolo", "models.experimental"}
# each stage, and the packages of this overlay it may import (itself included)
ALLOWED = {"core": {"core"}, "quantization": {"core", "quantization"},
           "finetuning": {"core", "quantization", "finetuning"},
           "deployment": {"core", "quantization", "deployment"}}


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _imported_modules(path) -> set[str]:
    return {n for n in _imports(path) if n == "models" or n.startswith("models.")}


def _offending(path, allowed: set[str]) -> list[str]:
    return sorted(m for m in _imported_modules(path)
                  if m not in UPSTREAM and m.split(".")[1] not in allowed)


def test_each_stage_imports_only_the_stages_below_it():
    files = {stage: sorted((REPO / "models" / stage).glob("*.py")) for stage in ALLOWED}
    assert all(len(f) >= 3 for f in files.values()), files  # the packages exist where this test looks
    found = {f"{stage}/{p.name}": _offending(p, allowed) for stage, allowed in ALLOWED.items()
             for p in files[stage]}
    assert {k: v for k, v in found.items() if v} == {}
    flat = [p.name for p in (REPO / "models").glob("*.py")]
    # the composition above the stages, nothing else
    assert sorted(flat) == ["analysis.py", "mixed_precision.py", "pipeline.py"]


def test_utils_imports_nothing_of_models():
    found = {p.name: sorted(_imported_modules(p)) for p in (REPO / "utils").glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


def test_only_each_backend_imports_its_quantization_library():
    """The seam between the backends: everything else (the stages above, and quantize.py, rules, calibration,
    ranges, checkpoints inside models/quantization) asks models.quantization.backends, never pytorch-quantization or
    modelopt.torch directly; each backend module imports its own library only. (The ONNX peer runs modelopt.onnx as
    a separate command.)"""
    libraries = {"pytorch_quantization": "pytorch_quantization.py", "modelopt": "model_optimizer.py"}
    ours = [p for p in REPO.glob("*.py")] + [p for d in ("models", "utils", "scripts") for p in (REPO / d).rglob("*.py")]
    found = {str(p.relative_to(REPO)): sorted({n.split(".")[0] for n in _imports(p)} & set(libraries)) for p in ours}
    assert len(found) > 40
    assert {k: v for k, v in found.items() if v} == {f"models/quantization/backends/{f}": [lib]
                                                     for lib, f in libraries.items()}


def test_the_check_sees_an_import_against_the_order(tmp_path):
    """The reader above on a module that imports upward inside a function (what a quick fix would add)."""
    bad = tmp_path / "calibration.py"
    bad.write_text("import torch\n\ndef f():\n    from models.finetuning.finetune import FineTuner\n"
                   "    from models.common import Conv\n    return FineTuner, Conv\n")
    assert _offending(bad, ALLOWED["quantization"]) == ["models.finetuning.finetune"]
