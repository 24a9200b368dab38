"""trtexec: the command line a graph needs on the TensorRT found, and its performance summary.

    python -m utils.trtexec flags MODEL.onnx [--version 10.3] [--allow-fp32]    # the precision flags
    python -m utils.trtexec build MODEL.onnx [--min 1 --opt 8 --max 8] [--graph]  # build MODEL.engine

TensorRT 11 builds every network strongly typed and has no --int8/--fp16/--best/--calib: the graph's own
types decide (an FP16 Q/DQ graph from `export_qat.py --dtype fp16`). TensorRT 10.x builds that graph with
--stronglyTyped, or an FP32 Q/DQ graph weakly typed with --int8 --fp16 (JetPack 6 ships 10.3). Shapes are passed
for graphs with a dynamic batch only (trtexec refuses explicit shapes for a static model). On 11.x the flags it
no longer honours are left out: --useCudaGraph, --useSpinWait and --noDataTransfers are no-ops there and
--separateProfileRun is marked for removal.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Graph:
    """What trtexec's command line depends on in an ONNX."""
    path: Path                      # absolute: the command works from any folder
    dtype: str                      # fp16 | fp32: the type of what is not INT8
    quantized: bool
    input_name: str
    batch: int | None               # the static batch, None for a dynamic one
    height: int
    width: int

    def shape(self, batch: int) -> str:
        return f"{self.input_name}:{batch}x3x{self.height}x{self.width}"


def read_graph(onnx_path: str | Path) -> Graph:
    import onnx
    from onnx import TensorProto
    path = Path(onnx_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{onnx_path}: file not found")
    g = onnx.load(str(path), load_external_data=False).graph
    fp16 = any(t.data_type == TensorProto.FLOAT16 for t in g.initializer) or any(
        a.t.data_type == TensorProto.FLOAT16 for n in g.node if n.op_type == "Constant" for a in n.attribute) or any(
        a.i == TensorProto.FLOAT16 for n in g.node if n.op_type == "Cast" for a in n.attribute if a.name == "to")
    dims = g.input[0].type.tensor_type.shape.dim
    batch = dims[0].dim_value if dims[0].dim_value > 0 and not dims[0].dim_param else None
    return Graph(path, "fp16" if fp16 else "fp32", any(n.op_type == "QuantizeLinear" for n in g.node), g.input[0].name,
                 batch, dims[2].dim_value, dims[3].dim_value)


def graph_kind(onnx_path: str | Path) -> tuple[str, bool]:
    """(fp16 | fp32, quantized): the graph's float type (export --dtype) and whether it has Q/DQ nodes."""
    g = read_graph(onnx_path)
    return g.dtype, g.quantized


def precision_flags(version: tuple[int, ...], dtype: str, quantized: bool, allow_fp32: bool = False) -> list[str]:
    """The trtexec precision flags that build a graph whose float type is `dtype` (Q/DQ or float) at its intended
    speed on `version`."""
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


@dataclass(frozen=True)
class BatchRange:
    min: int = 1
    opt: int = 1
    max: int = 1

    def __post_init__(self):
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"batch range must satisfy 1 <= --min <= --opt <= --max, got {self.min}/{self.opt}/"
                             f"{self.max}")


def shape_flags(graph: Graph, batches: BatchRange | None) -> list[str]:
    """--min/--opt/--maxShapes for a dynamic batch; nothing for a static one (trtexec: "Static model does not take
    explicit shapes"), where asking for another batch is refused."""
    if graph.batch is not None:
        if batches is not None and (batches.min, batches.opt, batches.max) != (graph.batch,) * 3:
            raise ValueError(f"{graph.path.name} has a static batch of {graph.batch}; a batch range applies to a "
                             "graph exported with --dynamic")
        return []
    b = batches or BatchRange()
    return [f"--minShapes={graph.shape(b.min)}", f"--optShapes={graph.shape(b.opt)}",
            f"--maxShapes={graph.shape(b.max)}"]


def build_command(trtexec: str, version: tuple[int, ...], graph: Graph, batches: BatchRange | None,
                  allow_fp32: bool = False, profile: bool = False) -> list[str]:
    """The trtexec invocation that builds `graph` into GRAPH.engine (and with `profile`, writes the layer and
    profile JSON that utils.engine_graph reads)."""
    base = graph.path.with_suffix("")
    cmd = [trtexec, f"--onnx={graph.path}", *precision_flags(version, graph.dtype, graph.quantized, allow_fp32),
           *shape_flags(graph, batches), f"--timingCacheFile={base}.timing.cache", f"--saveEngine={base}.engine"]
    if profile:
        cmd += ["--profilingVerbosity=detailed", f"--exportLayerInfo={base}.layer.json",
                f"--exportProfile={base}.profile.json"]
        if version[0] < 11:  # marked for removal in 11.x: profiling there runs apart from timing already
            cmd.append("--separateProfileRun")
    return cmd


def benchmark_command(trtexec: str, version: tuple[int, ...], graph: Graph, batch: int, engine: str | Path,
                      warmup_ms: int = 500, duration_s: int = 10) -> list[str]:
    """trtexec invocation for one (graph, batch) point of a latency sweep, without host transfers."""
    timing = ["--useCudaGraph", "--useSpinWait", "--noDataTransfers"] if version[0] < 11 else []  # no-ops on 11.x
    shapes = shape_flags(graph, BatchRange(1, batch, batch) if graph.batch is None else None)
    return [trtexec, f"--onnx={graph.path}", *precision_flags(version, graph.dtype, graph.quantized),
            f"--saveEngine={engine}", f"--timingCacheFile={engine}.timing.cache", f"--warmUp={warmup_ms}",
            f"--duration={duration_s}", *timing, *shapes]


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


def build(graph: Graph, batches: BatchRange | None, allow_fp32: bool, profile: bool) -> Path:
    """Build GRAPH.engine with the flags of the TensorRT found (atomically: a failed build leaves no engine);
    with `profile` also GRAPH.layer.json/.profile.json and the engine-graph report and SVG."""
    trtexec = trtexec_path()
    cmd = build_command(trtexec, trtexec_version(trtexec), graph, batches, allow_fp32, profile)
    base = graph.path.with_suffix("")
    engine = Path(f"{base}.engine")
    tmp = Path(f"{base}.engine.tmp")
    cmd = [a.replace(f"--saveEngine={engine}", f"--saveEngine={tmp}") for a in cmd]
    print("trtexec: " + " ".join(cmd[1:]), flush=True)
    with open(f"{base}.build.log", "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"trtexec failed (exit {r.returncode}), see {base}.build.log")
    tmp.replace(engine)
    print(f"trtexec: {engine}")
    if profile:
        from utils import engine_graph
        engine_graph.main([f"{base}.layer.json", "--profile", f"{base}.profile.json", "--svg", f"{base}.svg",
                           "--json", f"{base}.graph-report.json", "--onnx", str(graph.path)])
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m utils.trtexec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("flags", help="print the trtexec precision flags for an ONNX on the TensorRT found")
    f.add_argument("onnx")
    f.add_argument("--version", default=None, help="TensorRT version (default: read from trtexec's banner)")
    f.add_argument("--allow-fp32", action="store_true", help="accept an FP32 graph on TensorRT 11 (runs FP32)")
    b = sub.add_parser("build", help="build MODEL.engine beside MODEL.onnx with trtexec")
    b.add_argument("onnx")
    b.add_argument("--min", type=int, default=None, help="smallest batch (dynamic graphs)")
    b.add_argument("--opt", type=int, default=None, help="batch TensorRT tunes for (dynamic graphs)")
    b.add_argument("--max", type=int, default=None, help="largest batch (dynamic graphs)")
    b.add_argument("--allow-fp32", action="store_true", help="accept an FP32 graph on TensorRT 11 (runs FP32)")
    b.add_argument("--graph", action="store_true", help="also the layer/profile JSON and the engine-graph report")
    opt = p.parse_args(argv)
    try:
        graph = read_graph(opt.onnx)
        if opt.cmd == "flags":
            version = tuple(int(v) for v in opt.version.split(".")) if opt.version else trtexec_version(trtexec_path())
            print(" ".join(precision_flags(version, graph.dtype, graph.quantized, opt.allow_fp32)))
            return 0
        given = [v for v in (opt.min, opt.opt, opt.max) if v is not None]
        batches = None if not given else BatchRange(opt.min or 1, opt.opt or opt.max or opt.min or 1,
                                                    opt.max or opt.opt or opt.min or 1)
        build(graph, batches, opt.allow_fp32, opt.graph)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        print(f"trtexec: error: {e}", file=sys.stderr)
        return 3 if isinstance(e, FileNotFoundError) and "trtexec not found" in str(e) else 2
    except RuntimeError as e:
        print(f"trtexec: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
