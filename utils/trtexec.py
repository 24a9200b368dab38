"""trtexec: which flags a graph needs on the TensorRT found, command lines, and its performance summary.

    python -m utils.trtexec flags MODEL.onnx [--version 10.3] [--allow-fp32]   # prints the precision flags

TensorRT 11 builds every network strongly typed and has no --int8/--fp16/--best/--calib: the graph's own
types decide (an FP16 Q/DQ graph from `export_qat.py --dtype fp16`). TensorRT 10.x builds that graph with
--stronglyTyped, or an FP32 Q/DQ graph weakly typed with --int8 --fp16 (JetPack 6 ships 10.3).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

_BANNER = re.compile(r"TensorRT\.trtexec \[TensorRT v(\d+)\]")

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


def parse_version(text: str) -> tuple[int, int, int]:
    """TensorRT version from trtexec's banner: [TensorRT v100300] is 10.3.0, [TensorRT v8601] is 8.6.1."""
    m = _BANNER.search(text)
    if not m:
        raise ValueError("no '[TensorRT vNNNN]' banner in trtexec's output")
    v = int(m.group(1))
    return (v // 10000, v // 100 % 100, v % 100) if v >= 10000 else (v // 1000, v // 100 % 10, v % 100)


def trtexec_version(trtexec: str) -> tuple[int, int, int]:
    r = subprocess.run([trtexec, "--help"], capture_output=True, text=True, timeout=60)
    return parse_version(r.stdout + r.stderr)


def graph_kind(onnx_path: str | Path) -> tuple[str, bool]:
    """(fp16 | fp32, quantized): the graph's float type (export --dtype) and whether it has Q/DQ nodes."""
    import onnx
    from onnx import TensorProto
    g = onnx.load(str(onnx_path), load_external_data=False).graph
    fp16 = any(t.data_type == TensorProto.FLOAT16 for t in g.initializer) or any(
        a.t.data_type == TensorProto.FLOAT16 for n in g.node if n.op_type == "Constant" for a in n.attribute) or any(
        a.i == TensorProto.FLOAT16 for n in g.node if n.op_type == "Cast" for a in n.attribute if a.name == "to")
    return ("fp16" if fp16 else "fp32"), any(n.op_type == "QuantizeLinear" for n in g.node)


def precision_flags(version: tuple[int, ...], dtype: str, quantized: bool, allow_fp32: bool = False) -> list[str]:
    """The trtexec precision flags that build a graph whose float type is `dtype` (Q/DQ or float) at its intended speed on `version`."""
    shown = ".".join(map(str, version))
    if version[0] < 10:
        raise ValueError(f"TensorRT {shown} found; these graphs need TensorRT >= 10 (10.3 on JetPack 6)")
    if version[0] >= 11:  # strongly typed always: the graph's types are the precisions
        if dtype == "fp32" and not allow_fp32:
            raise ValueError(f"TensorRT {shown} builds an FP32 graph in FP32 (strongly typed, no --fp16): slower "
                             "than the FP16 baseline; export with --dtype fp16 (or pass --allow-fp32)")
        return []
    if dtype == "fp16":
        return ["--stronglyTyped"]
    # weak typing; --int8 only with Q/DQ nodes (without them TensorRT 10 would INT8 with placeholder ranges)
    return ["--int8", "--fp16"] if quantized else ["--fp16"]


def benchmark_command(onnx: str | Path, imgsz: int, batch: int, flags: list[str], engine: str | Path,
                      warmup_ms: int = 500, duration_s: int = 10) -> list[str]:
    """trtexec invocation for one (graph, batch) point of the sweep (timing without host transfers)."""
    shape = f"images:{batch}x3x{imgsz}x{imgsz}"
    return [trtexec_path(), f"--onnx={onnx}", *flags, f"--saveEngine={engine}",
            f"--timingCacheFile={engine}.timing.cache", f"--warmUp={warmup_ms}", f"--duration={duration_s}",
            "--useCudaGraph", "--useSpinWait", "--noDataTransfers", f"--minShapes=images:1x3x{imgsz}x{imgsz}",
            f"--optShapes={shape}", f"--maxShapes={shape}"]


def comparison_table(rows: list[dict]) -> str:
    """Markdown: per batch, INT8 vs FP16 latency p99, throughput (qps) and images/s, with % change."""
    by = {(r["engine"], r["batch"]): r for r in rows}
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m utils.trtexec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("flags", help="print the trtexec precision flags for an ONNX on the TensorRT found")
    f.add_argument("onnx")
    f.add_argument("--version", default=None, help="TensorRT version (default: read from trtexec's banner)")
    f.add_argument("--allow-fp32", action="store_true", help="accept an FP32 graph on TensorRT 11 (runs FP32)")
    opt = p.parse_args(argv)
    try:
        if not Path(opt.onnx).is_file():
            raise FileNotFoundError(f"{opt.onnx}: file not found")
        version = tuple(int(v) for v in opt.version.split(".")) if opt.version else trtexec_version(trtexec_path())
        flags = precision_flags(version, *graph_kind(opt.onnx), opt.allow_fp32)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        print(f"trtexec: error: {e}", file=sys.stderr)
        return 2
    print(" ".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
