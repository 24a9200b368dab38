#!/usr/bin/env bash
# Build a TensorRT engine from an ONNX with trtexec, with the flags the graph needs on the TensorRT found.
#   scripts/generate_trt_engine.sh MODEL.onnx IMGSZ [--batch N | --min N --opt N --max N] [--allow-fp32] [--generate-graph]
# TensorRT 11: strongly typed, no precision flags (the FP16 Q/DQ graph of export_qat.py --dtype fp16).
# TensorRT 10.x: --stronglyTyped for that graph, or --int8 --fp16 for an FP32 graph (--dtype fp32).
# Writes MODEL.engine beside the ONNX; --generate-graph also writes the layer/profile JSON and the engine-graph
# report and SVG (python -m utils.engine_graph).
set -euo pipefail
usage() { sed -n '2,7p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
ONNX="$1" IMGSZ="$2"; shift 2
[ -f "$ONNX" ] || { echo "generate_trt_engine: error: $ONNX: file not found" >&2; exit 2; }
[[ "$IMGSZ" =~ ^[0-9]+$ ]] || { echo "generate_trt_engine: error: IMGSZ must be a number, got $IMGSZ" >&2; exit 2; }
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MIN=1 OPT=1 MAX=1 GRAPH=0 ALLOW=()
while [ $# -gt 0 ]; do
  case "$1" in
    --batch) MIN=1; OPT="$2"; MAX="$2"; shift 2 ;;
    --min) MIN="$2"; shift 2 ;;
    --opt) OPT="$2"; shift 2 ;;
    --max) MAX="$2"; shift 2 ;;
    --allow-fp32) ALLOW=(--allow-fp32); shift ;;
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
# reads trtexec's version banner and the graph's types; a graph that cannot build as intended is refused here
FLAGS="$(PATH="$(dirname "$TRTEXEC"):$PATH" python3 "$HERE/utils/trtexec.py" flags "$ONNX" "${ALLOW[@]}")" || exit 2
BASE="${ONNX%.onnx}"
ENGINE="$BASE.engine"
shape() { echo "images:${1}x3x${IMGSZ}x${IMGSZ}"; }
EXTRA=()
if [ "$GRAPH" = 1 ]; then
  EXTRA=(--profilingVerbosity=detailed --exportLayerInfo="$BASE.layer.json" --exportProfile="$BASE.profile.json"
         --separateProfileRun)
fi
echo "generate_trt_engine: trtexec --onnx=$ONNX ${FLAGS:-(strongly typed, no precision flags)} ..."
# shellcheck disable=SC2086
"$TRTEXEC" --onnx="$ONNX" $FLAGS --minShapes="$(shape "$MIN")" --optShapes="$(shape "$OPT")" \
  --maxShapes="$(shape "$MAX")" --timingCacheFile="$BASE.timing.cache" --saveEngine="$ENGINE.tmp" "${EXTRA[@]}" \
  > "$BASE.build.log" 2>&1 || { echo "generate_trt_engine: error: trtexec failed, see $BASE.build.log" >&2; rm -f "$ENGINE.tmp"; exit 1; }
mv "$ENGINE.tmp" "$ENGINE"
echo "generate_trt_engine: $ENGINE (batch $MIN/$OPT/$MAX)"
if [ "$GRAPH" = 1 ]; then
  (cd "$HERE" && python3 -m utils.engine_graph "$BASE.layer.json" --profile "$BASE.profile.json" --svg "$BASE.svg" \
    --json "$BASE.graph-report.json")
fi
