"""trtexec command lines and the parsing of its performance summary."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

_METRIC = re.compile(r"(?:\[[^\]]*\]\s*)*(?P<name>Throughput|Latency|Enqueue Time|H2D Latency|GPU Compute Time|"
                     r"D2H Latency|Total Host Walltime|Total GPU Compute Time):\s*(?P<body>.+)$")
_STAT = re.compile(r"(min|max|mean|median|percentile\((\d+(?:\.\d+)?)%\))\s*=\s*([-\d.eE+]+)\s*ms")


def parse_summary(text: str) -> dict:
    """The '=== Performance summary ===' of a trtexec log as numbers.

    {'throughput_qps': 1026.71, 'latency_ms': {'min':..., 'mean':..., 'p99':...}, 'gpu_compute_ms': {...}, ...}
    """
    out: dict = {}
    for line in text.splitlines():
        m = _METRIC.search(line.strip())
        if not m:
            continue
        name, body = m.group("name"), m.group("body")
        key = name.lower().replace(" ", "_")
        if name == "Throughput":
            out["throughput_qps"] = float(body.split()[0])
        elif name.startswith("Total"):
            out[key + "_s"] = float(body.split()[0])
        else:
            stats = {}
            for stat, pct, value in _STAT.findall(body):
                stats[f"p{pct.rstrip('0').rstrip('.') if '.' in pct else pct}" if pct else stat] = float(value)
            if stats:
                out[key.replace("_time", "") + "_ms"] = stats
    if "throughput_qps" not in out or "latency_ms" not in out:
        raise ValueError("no trtexec performance summary found (was the engine built and run?)")
    return out


def trtexec_path() -> str:
    path = shutil.which("trtexec") or next((p for p in ("/usr/src/tensorrt/bin/trtexec",) if Path(p).is_file()), None)
    if path is None:
        raise FileNotFoundError("trtexec not found: install TensorRT (./install_dependencies.sh --tensorrt) or use an "
                                "NVIDIA TensorRT/PyTorch container")
    return path


def benchmark_command(onnx: str | Path, imgsz: int, batch: int, int8: bool, engine: str | Path,
                      warmup_ms: int = 500, duration_s: int = 10) -> list[str]:
    """trtexec invocation for one (precision, batch) point of the sweep (timing without host transfers)."""
    shape = f"images:{batch}x3x{imgsz}x{imgsz}"
    return [trtexec_path(), f"--onnx={onnx}", "--fp16", *(["--int8"] if int8 else []), f"--saveEngine={engine}",
            f"--timingCacheFile={engine}.timing.cache", f"--warmUp={warmup_ms}", f"--duration={duration_s}",
            "--useCudaGraph", "--useSpinWait", "--noDataTransfers", f"--minShapes=images:1x3x{imgsz}x{imgsz}",
            f"--optShapes={shape}", f"--maxShapes={shape}"]


def comparison_table(rows: list[dict]) -> str:
    """Markdown: per batch, INT8 vs FP16 latency p99, throughput (qps) and images/s, with % change."""
    by = {(r["precision"], r["batch"]): r for r in rows}
    lines = ["| Batch | FP16 p99 (ms) | INT8 p99 (ms) | p99 change | FP16 qps | INT8 qps | qps change | INT8 img/s |",
             "|---|---|---|---|---|---|---|---|"]
    for batch in sorted({r["batch"] for r in rows}):
        f, i = by.get(("fp16", batch)), by.get(("int8", batch))
        if not (f and i):
            continue
        fl, il = f["latency_ms"]["p99"], i["latency_ms"]["p99"]
        fq, iq = f["throughput_qps"], i["throughput_qps"]
        lines.append(f"| {batch} | {fl:.3f} | {il:.3f} | {100 * (il - fl) / fl:+.1f}% | {fq:.1f} | {iq:.1f} | "
                     f"{100 * (iq - fq) / fq:+.1f}% | {iq * batch:.0f} |")
    return "\n".join(lines)
