#!/usr/bin/env bash
# The main job on a fresh machine, offline: install, build an upstream YOLOv9 checkout, patch it, generate the
# demo dataset, quantize the embedded trained model (PTQ calibration, then QAT), export the Q/DQ ONNX, check it
# against PyTorch and measure its mAP with ONNX Runtime. About 6 minutes on 2 CPU cores, installation included when
# the packages are already there (a fresh machine's first install adds 1.5-3 minutes).
#   bash scripts/demo.sh [--skip-install]
# The embedded model, assets/gelan-t-demo.pt, is gelan-t trained with upstream train.py on exactly this dataset
# (60 epochs at 320 px on an H100; the generator writes the same images on every machine, see
# make_demo_dataset.py). TRAIN=1 trains a gelan-t here first (upstream's progress shown) and quantizes that one.
# Knobs (environment): WORKDIR (./yolov9), DEVICE (cpu / 0), TRAIN (0), EPOCHS (10), QAT_EPOCHS (2),
#   QAT_ITERS (10), WORKERS (2), RECORD (0; 1: also write results/demo/demo.json, which README's table renders)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKDIR="$(mkdir -p "${WORKDIR:-$HERE/yolov9}" && cd "${WORKDIR:-$HERE/yolov9}" && pwd)"
IMGSZ=320 TRAIN="${TRAIN:-0}" EPOCHS="${EPOCHS:-10}" QAT_EPOCHS="${QAT_EPOCHS:-2}" QAT_ITERS="${QAT_ITERS:-10}"
WORKERS="${WORKERS:-2}"
DATA_FINGERPRINT="ed832d16951df0f0537073dfd11e7d57"  # train split the embedded model was trained on
step() { printf '\n\033[1;34m== %s\033[0m\n' "$*"; }
start=$(date +%s)

INSTALL="install skipped"
if [ "${1:-}" != "--skip-install" ]; then
  INSTALL=$(python3 -c "import torch, pytorch_quantization, onnxruntime" 2>/dev/null \
    && echo "the packages installed already" || echo "a fresh install")
  step "install the pinned Python stack"
  "$HERE/install_dependencies.sh"
fi
DEVICE="${DEVICE:-$(python3 -c 'import torch; print(0 if torch.cuda.is_available() else "cpu")')}"
step "upstream YOLOv9 checkout in $WORKDIR"
"$HERE/scripts/get_yolov9.sh" "$WORKDIR"
step "apply the yolov9-qat overlay"
"$HERE/patch_yolov9.sh" "$WORKDIR"
cd "$WORKDIR"
DATA="$WORKDIR/datasets/demo/data.yaml"
step "demo dataset (generated offline: 400 train / 100 val images, 12 classes)"
if ! grep -q "train: $DATA_FINGERPRINT" "$DATA" 2>/dev/null; then
  python3 scripts/make_demo_dataset.py --out datasets/demo --train 400 --val 100 --imgsz "$IMGSZ" --exist-ok
fi
grep -q "train: $DATA_FINGERPRINT" "$DATA" || {
  echo "demo: error: $DATA is not the dataset the embedded model was trained on (fingerprint)" >&2; exit 1; }

MODEL="$WORKDIR/runs/demo/gelan-t-demo.pt"
mkdir -p runs/demo
if [ "$TRAIN" = 1 ]; then
  step "train gelan-t for $EPOCHS epochs at $IMGSZ px on $DEVICE (upstream train.py)"
  python3 train.py --data "$DATA" --cfg models/detect/gelan-t.yaml --weights '' --hyp data/hyps/hyp.scratch-high.yaml \
    --img "$IMGSZ" --batch 16 --epochs "$EPOCHS" --device "$DEVICE" --workers "$WORKERS" --seed 0 \
    --project runs/demo --name train --exist-ok
  SOURCE="$WORKDIR/runs/demo/train/weights/best_striped.pt"
else
  SOURCE="$HERE/assets/gelan-t-demo.pt"
fi
cp "$SOURCE" "$MODEL"

step "quantize $(basename "$MODEL"): PTQ calibration + $QAT_EPOCHS QAT epochs x $QAT_ITERS iterations on $DEVICE"
python3 qat.py quantize --weights "$MODEL" --data "$DATA" --imgsz "$IMGSZ" --batch-size 16 --device "$DEVICE" \
  --workers "$WORKERS" --epochs "$QAT_EPOCHS" --iters "$QAT_ITERS" --calib-batches 10 \
  --project "$WORKDIR/runs/demo" --name qat --exist-ok
QAT="$WORKDIR/runs/demo/qat/weights/best_gelan-t-demo.pt"  # the delivered model: the best of PTQ and QAT on select
step "export the Q/DQ ONNX for TensorRT, check it against PyTorch and measure it with ONNX Runtime"
python3 export_qat.py --weights "$QAT" --include onnx --dynamic --simplify --imgsz "$IMGSZ" --batch-size 4 --verify \
  --data "$DATA" --exist-ok --json "$WORKDIR/runs/demo/export.json"
python3 val_trt.py --onnx-file "${QAT%.pt}.onnx" --data "$DATA" --imgsz "$IMGSZ" --batch-size 4 --workers "$WORKERS" \
  --project "$WORKDIR/runs/demo" --name ort --exist-ok

step "results"
RECORD="${RECORD:-0}" INSTALL="$INSTALL" python3 - "$SOURCE" "$DATA" "$WORKDIR/runs/demo" "$(( $(date +%s) - start ))" "$HERE" <<'PY'
import datetime, json, os, sys
from pathlib import Path
model, data, runs, seconds, repo = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
report = json.loads((runs / "qat/report.json").read_text())
export = json.loads((runs / "export.json").read_text())
ort = json.loads((runs / "ort/val_trt.json").read_text())
rows = report["table"].splitlines()
rows.append(f"| Q/DQ ONNX (ONNX Runtime) | {ort['ap']:.4f} | {ort['ap50']:.4f} | {ort['precision']:.4f} | "
            f"{ort['recall']:.4f} |")
print(f"model: {model}\ndata:  {data} (100 val images)\n")
print("\n".join(rows))
q, p, cal = report["quantizers"], export["parity"], report["calibration"]
print(f"\nquantizers: {q['distinct']} ({q['weight']} weight, {q['activation']} activation); calibration "
      f"{cal['chosen']} (auto, on {report['select']['images']} held-out training images), "
      f"{cal['seconds']['collect']}s + {cal['seconds']['ranges_and_evaluations']}s; "
      f"ONNX Runtime vs PyTorch on {p['images']} images: detections matched {p['detections_matched']:.0%}, "
      f"lint problems {export['lint']['problems']}")
final = report["final"]
print(f"\nINT8 model: {final['file']} ({final['stage']}{' epoch ' + str(final['epoch']) if final['epoch'] else ''})"
      f"\nONNX:       {export['onnx']}\nreport:     {runs / 'qat/report.json'}")
print(f"demo: {seconds // 60} min {seconds % 60} s")
if os.environ["RECORD"] == "1":
    sys.path.insert(0, str(repo))
    from utils.io_utils import write_json
    from utils.provenance import machine, toolkit_commit
    m, c = machine(), report["config"]
    where = f"{m['gpu'] or 'CPU'} ({m['cpu']}, {m['cpu_count']} cores)"
    path = write_json(repo / "results" / "demo" / "demo.json", {
        "table": "\n".join(rows), "where": where, "date": datetime.date.today().isoformat(),
        "commit": toolkit_commit(repo), "minutes": round(seconds / 60, 1), "install": os.environ["INSTALL"],
        "machine": m, "report": report,
        "export_parity": p, "onnxruntime": {k: ort[k] for k in ("ap", "ap50", "precision", "recall")},
        "data": f"the generated demo set, 100 val images at {c['imgsz']} px; {c['quant']['calib_batches']} calibration "
                f"batches and {c['epochs']} x {c['iters']} QAT iterations of {c['batch_size']} images"})
    print(f"demo: recorded {path}")
PY
