#!/usr/bin/env bash
# Export a quantized model (dynamic Q/DQ ONNX), build its TensorRT engine and measure mAP on it.
#   scripts/val_trt.sh WEIGHTS DATA IMGSZ [--generate-graph] [--batch-size N]
# WEIGHTS.onnx is reused when it was exported from these weights with these settings (dynamic batch, simplified,
# FP16, IMGSZ: recorded in its metadata) and exported again otherwise. Without TensorRT, says so and evaluates
# the same ONNX with ONNX Runtime instead. Run from the patched checkout.
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,6p' "$0" >&2; exit 2; }
WEIGHTS="$1" DATA="$2" IMGSZ="$3"; shift 3
GRAPH="" BATCH=8
while [ $# -gt 0 ]; do
  case "$1" in
    --generate-graph) GRAPH="--generate-graph"; shift ;;
    --batch-size) BATCH="$2"; shift 2 ;;
    *) echo "val_trt.sh: error: unknown option $1" >&2; exit 2 ;;
  esac
done
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$WEIGHTS" ] || { echo "val_trt.sh: error: $WEIGHTS: file not found" >&2; exit 2; }
ONNX="${WEIGHTS%.pt}.onnx"
python3 "$HERE/export_qat.py" --weights "$WEIGHTS" --include onnx --dynamic --simplify --imgsz "$IMGSZ" --reuse
if command -v trtexec >/dev/null 2>&1 || [ -x /usr/src/tensorrt/bin/trtexec ]; then
  if python3 -c "import tensorrt" 2>/dev/null; then
    "$HERE/scripts/generate_trt_engine.sh" "$ONNX" "$IMGSZ" --min 1 --opt "$BATCH" --max "$BATCH" $GRAPH
    exec python3 "$HERE/val_trt.py" --engine-file "${ONNX%.onnx}.engine" --data "$DATA" --imgsz "$IMGSZ" --batch-size "$BATCH"
  fi
fi
echo "val_trt.sh: TensorRT (trtexec + Python package) is not available here: evaluating $ONNX with ONNX Runtime instead" >&2
exec python3 "$HERE/val_trt.py" --onnx-file "$ONNX" --data "$DATA" --imgsz "$IMGSZ" --batch-size "$BATCH"
