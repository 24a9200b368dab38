#!/usr/bin/env bash
# Build a TensorRT engine from an ONNX with trtexec, with the flags the graph needs on the TensorRT found.
#   scripts/generate_trt_engine.sh MODEL.onnx IMGSZ [--batch N | --min N --opt N --max N] [--allow-fp32] [--generate-graph]
# TensorRT 11: strongly typed, no precision flags (the FP16 Q/DQ graph of export_qat.py --dtype fp16).
# TensorRT 10.x: --stronglyTyped for that graph, or --int8 --fp16 for an FP32 graph (--dtype fp32).
# Batch shapes only for a graph exported with --dynamic. Writes MODEL.engine beside the ONNX; --generate-graph
# also writes the layer/profile JSON and the engine-graph report and SVG (python -m utils.engine_graph).
# Works from any folder (paths are resolved first); the logic is python -m utils.trtexec build.
set -euo pipefail
usage() { sed -n '2,8p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
ONNX="$1" IMGSZ="$2"; shift 2
[ -f "$ONNX" ] || { echo "generate_trt_engine: error: $ONNX: file not found" >&2; exit 2; }
[[ "$IMGSZ" =~ ^[0-9]+$ ]] || { echo "generate_trt_engine: error: IMGSZ must be a number, got $IMGSZ" >&2; exit 2; }
ONNX="$(cd "$(dirname "$ONNX")" && pwd)/$(basename "$ONNX")"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --batch) ARGS+=(--min 1 --opt "$2" --max "$2"); shift 2 ;;
    --min|--opt|--max) ARGS+=("$1" "$2"); shift 2 ;;
    --allow-fp32) ARGS+=(--allow-fp32); shift ;;
    --generate-graph) ARGS+=(--graph); shift ;;
    *) echo "generate_trt_engine: error: unknown option $1" >&2; usage ;;
  esac
done
python3 - "$ONNX" "$IMGSZ" <<'PY' || exit 2
import sys, onnx
dims = onnx.load(sys.argv[1], load_external_data=False).graph.input[0].type.tensor_type.shape.dim
if [d.dim_value for d in dims[2:]] != [int(sys.argv[2])] * 2:
    sys.exit(f"generate_trt_engine: error: {sys.argv[1]} takes {dims[2].dim_value}x{dims[3].dim_value} images, not IMGSZ {sys.argv[2]}")
PY
cd "$HERE" && exec python3 -m utils.trtexec build "$ONNX" "${ARGS[@]}"
