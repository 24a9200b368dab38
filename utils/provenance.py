"""Where a result came from: the toolkit's commit, the command line, the machine and the file hashes.

Benchmark entries carry this so that each can be reproduced (and told apart from one made elsewhere).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

OVERLAY_ROOT = Path(__file__).resolve().parents[1]
STAMP_FILE = ".yolov9_qat_commit"  # written by patch_yolov9.sh into the checkout it patches
SOURCE_FILE = ".yolov9_qat_source"  # likewise: the yolov9-qat repository it copied from


def overlay_repo(root: Path = OVERLAY_ROOT) -> Path:
    """The yolov9-qat repository: this file's own, or, in a patched checkout, the one patch_yolov9.sh copied from
    (where results/, README.md and docs/ are)."""
    if (root / "patch_yolov9.sh").is_file():
        return root
    source = root / SOURCE_FILE
    return Path(source.read_text().strip()) if source.is_file() else root


def toolkit_commit(root: Path = OVERLAY_ROOT) -> str:
    """The yolov9-qat commit: $YOLOV9_QAT_COMMIT, else `git rev-parse` of the overlay (+ '-dirty'), else the
    stamp patch_yolov9.sh left in the checkout, else 'unknown'."""
    if os.environ.get("YOLOV9_QAT_COMMIT"):
        return os.environ["YOLOV9_QAT_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    stamp = root / STAMP_FILE
    return stamp.read_text().strip() if stamp.is_file() else "unknown"


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cpu_isa() -> str:
    """The widest x86 vector extension the CPU reports (what oneDNN/MKL kernels dispatch on)."""
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    except OSError:
        flags = []
    for isa in ("avx512_bf16", "avx512f", "avx2", "avx", "sse4_2"):
        if isa in flags:
            return isa
    return platform.machine()


def machine() -> dict:
    """GPU, CPU, and the versions of the numerical stack."""
    import numpy
    import torch
    info = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu": _cpu_model(), "cpu_isa": cpu_isa(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}
    for module in ("onnxruntime", "cv2"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    info["isa_limits"] = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                                      "OMP_NUM_THREADS") if k in os.environ}
    return info


def _cpu_model() -> str:
    try:
        return next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                    platform.processor())
    except OSError:
        return platform.processor()


def command_line(argv: list[str] | None = None) -> str:
    return shlex.join([Path(sys.executable).name, *(sys.argv if argv is None else argv)])
