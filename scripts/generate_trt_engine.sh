#!/usr/bin/env bash
# Build a TensorRT engine from an ONNX with trtexec.
#   scripts/generate_trt_engine.sh MODEL.onnx IMGSZ [--batch N | --min N --opt N --max N] [--fp16-only] [--generate-graph]
# INT8 (from the Q/DQ nodes) + FP16 by default; --fp16-only for float models. Writes MODEL.engine beside the ONNX;
# --generate-graph also writes the layer/profile JSON and, when TensorRT Explorer (trex) is installed, an SVG.
set -euo pipefail
usage() { sed -n '2,5p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
ONNX="$1" IMGSZ="$2"; shift 2
[ -f "$ONNX" ] || { echo "generate_trt_engine: error: $ONNX: file not found" >&2; exit 2; }
[[ "$IMGSZ" =~ ^[0-9]+$ ]] || { echo "generate_trt_engine: error: IMGSZ must be a number, got $IMGSZ" >&2; exit 2; }
MIN=1 OPT=1 MAX=1 PREC="--int8 --fp16" GRAPH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --batch) MIN=1; OPT="$2"; MAX="$2"; shift 2 ;;
    --min) MIN="$2"; shift 2 ;;
    --opt) OPT="$2"; shift 2 ;;
    --max) MAX="$2"; shift 2 ;;
    --fp16-only) PREC="--fp16"; shift ;;
    --generate-graph) GRAPH=1; shift ;;
    *) echo "generate_trt_engine: error: unknown option $1" >&2; usage ;;
  esac
done
TRTEXEC="$(command -v trtexec || true)"
[ -n "$TRTEXEC" ] || { [ -x /usr/src/tensorrt/bin/trtexec ] && TRTEXEC=/usr/src/tensorrt/bin/trtexec; }
if [ -z "$TRTEXEC" ]; then
  echo "generate_trt_engine: error: trtexec not found; install TensorRT (./install_dependencies.sh --tensorrt) or use an NVIDIA TensorRT container" >&2
  exit 3
fi
BASE="${ONNX%.onnx}"
ENGINE="$BASE.engine"
shape() { echo "images:${1}x3x${IMGSZ}x${IMGSZ}"; }
EXTRA=()
if [ "$GRAPH" = 1 ]; then
  EXTRA=(--profilingVerbosity=detailed --exportLayerInfo="$BASE.layer.json" --exportProfile="$BASE.profile.json"
         --separateProfileRun)
fi
# shellcheck disable=SC2086
"$TRTEXEC" --onnx="$ONNX" $PREC --minShapes="$(shape "$MIN")" --optShapes="$(shape "$OPT")" \
  --maxShapes="$(shape "$MAX")" --timingCacheFile="$BASE.timing.cache" --saveEngine="$ENGINE.tmp" "${EXTRA[@]}" \
  > "$BASE.build.log" 2>&1 || { echo "generate_trt_engine: error: trtexec failed, see $BASE.build.log" >&2; rm -f "$ENGINE.tmp"; exit 1; }
mv "$ENGINE.tmp" "$ENGINE"
echo "generate_trt_engine: $ENGINE (batch $MIN/$OPT/$MAX, ${PREC})"
if [ "$GRAPH" = 1 ]; then
  if python3 -c "import trex" 2>/dev/null; then
    python3 - "$BASE" <<'PY'
import sys
import trex
from trex import graphing
base = sys.argv[1]
plan = trex.EnginePlan(f"{base}.layer.json", f"{base}.profile.json")
graph = graphing.to_dot(plan, graphing.layer_type_formatter)
graphing.render_dot(graph, base, "svg")
print(f"generate_trt_engine: engine graph {base}.svg")
PY
  else
    echo "generate_trt_engine: trex not installed: layer info in $BASE.layer.json, no SVG (./install_dependencies.sh --trex)"
  fi
fi
