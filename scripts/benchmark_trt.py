#!/usr/bin/env python3
"""INT8 (Q/DQ) vs FP16 TensorRT latency/throughput sweep over batch sizes with trtexec.

    python scripts/benchmark_trt.py --int8-onnx qat_best.onnx --fp16-onnx float.onnx --batches 1 4 8 12

The FP16 engine is built from the float model's ONNX (--fp16-onnx; without it the Q/DQ ONNX is used for both,
which only shows trtexec's own numbers for that graph). Each graph gets the flags it needs on the TensorRT found
(utils/trtexec.py: strongly typed on TensorRT 11; --stronglyTyped or --int8/--fp16 on 10.x): export both with
the same --dtype. Writes benchmark.json and benchmark.md in --out.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.trtexec import (benchmark_command, comparison_table, parse_summary, read_graph,  # noqa: E402
                           trtexec_path, trtexec_version)


def run(int8_onnx: Path, fp16_onnx: Path | None, batches: list[int], out: Path, duration: int) -> dict:
    trtexec = trtexec_path()
    version = trtexec_version(trtexec)
    graphs = {"fp16": read_graph(fp16_onnx or int8_onnx), "int8": read_graph(int8_onnx)}
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for engine_kind, graph in graphs.items():
        onnx = graph.path
        for batch in batches:
            engine = out / f"{Path(onnx).stem}-{engine_kind}-b{batch}.engine"
            cmd = benchmark_command(trtexec, version, graph, batch, engine, duration_s=duration)
            print("benchmark_trt:", " ".join(cmd), flush=True)
            log = subprocess.run(cmd, text=True, capture_output=True)
            (out / f"{engine.stem}.log").write_text(log.stdout + log.stderr)
            if log.returncode != 0:
                log_file = out / (engine.stem + ".log")
                raise RuntimeError(f"trtexec failed for {engine_kind} batch {batch}; see {log_file}")
            rows.append({"engine": engine_kind, "batch": batch, "onnx": str(onnx), **parse_summary(log.stdout)})
    table = comparison_table(rows)
    result = {"imgsz": graphs["int8"].height, "tensorrt": ".".join(map(str, version)), "rows": rows, "table": table}
    (out / "benchmark.json").write_text(json.dumps(result, indent=2))
    (out / "benchmark.md").write_text(table + "\n")
    print(table)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--int8-onnx", type=Path, required=True, help="Q/DQ ONNX from export_qat.py --dynamic")
    p.add_argument("--fp16-onnx", type=Path, default=None, help="float ONNX of the same model, --dynamic")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 12])
    p.add_argument("--duration", type=int, default=10, help="seconds of timing per point")
    p.add_argument("--out", type=Path, default=Path("runs/benchmark_trt"))
    opt = p.parse_args(argv)
    for f in (opt.int8_onnx, opt.fp16_onnx):
        if f is not None and not f.is_file():
            print(f"benchmark_trt: error: {f}: file not found", file=sys.stderr)
            return 2
    try:
        run(opt.int8_onnx, opt.fp16_onnx, opt.batches, opt.out, opt.duration)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"benchmark_trt: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
