#!/usr/bin/env bash
# Install the pinned Python stack of yolov9-qat into the active Python (use a venv if you like).
#   ./install_dependencies.sh [--no-torch] [--tensorrt] [--modelopt] [--trex]
#     --no-torch   keep the torch/torchvision already installed (e.g. an NVIDIA PyTorch container)
#     --tensorrt   also try the TensorRT Python package (pip); says clearly when it cannot be had
#     --modelopt   also NVIDIA Model Optimizer's ONNX quantizer, the peer in scripts/benchmark_accuracy.py --modelopt
#     --trex       (the reference's flag) nothing to install: utils.engine_graph replaces TensorRT Explorer
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY="${PYTHON:-python3}"
TORCH_PINS="torch==2.14.1 torchvision==0.29.1"
with_torch=1 with_trt=0 with_modelopt=0
for arg in "$@"; do
  case "$arg" in
    --no-torch) with_torch=0 ;;
    --tensorrt) with_trt=1 ;;
    --modelopt) with_modelopt=1 ;;
    --trex) echo "install_dependencies: --trex: TensorRT Explorer left the TensorRT repository in 11.1; python -m utils.engine_graph replaces it (no install; Graphviz draws the SVG); installing the rest" ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "install_dependencies: error: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

# pip's own lines, but only those that say what it is doing now (one per package it fetches, then the install):
# a fresh machine's install takes minutes and should not look hung; nothing when every package is already there.
pip_install() {
  "$PY" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
    | grep --line-buffered -E "^(Collecting|Installing collected|Successfully installed|ERROR)" \
    | sed -u "s/^/  pip: /" || true
}

# Whether every `name==version` given is installed at that version: pip's resolver takes ~30 s to say so, and
# torch's setuptools>=77 requirement would undo the setuptools pin below on every run.
pinned() {
  "$PY" - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
from pip._vendor.packaging.version import Version  # what pip compares versions with (0.1.1-N is 0.1.1.postN)
def ok(pin):
    name, _, want = pin.partition("==")
    try:
        return Version(Version(version(name)).public) == Version(want)  # 2.14.1+cu130 is the pinned 2.14.1
    except PackageNotFoundError:
        return False
sys.exit(0 if all(ok(p) for p in sys.argv[1:]) else 1)
PY
}
PINS=$(grep -E '^[A-Za-z0-9_.-]+==' requirements.txt | tr '\n' ' ')

echo "install_dependencies: Python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
if pinned $PINS $([ "$with_torch" = 1 ] && echo $TORCH_PINS) pytorch-quantization==2.1.3 setuptools==69.5.1; then
  echo "install_dependencies: every pinned package is already installed"
else
  if [ "$with_torch" = 1 ]; then
    echo "install_dependencies: installing $TORCH_PINS and $(grep -c '==' requirements.txt) pinned packages" \
         "(onnx, onnxruntime, opencv, ...): about 1.5-3 min on a fresh machine"
    pip_install -r requirements.txt $TORCH_PINS
  else
    echo "install_dependencies: installing $(grep -c '==' requirements.txt) pinned packages (about a minute on a fresh machine)"
    pip_install -r requirements.txt
  fi
  # pytorch-quantization 2.1.3 is pure Python; its only unusual requirement (sphinx-glpi-theme) is for its docs.
  pip_install --no-deps pytorch-quantization==2.1.3
  # Upstream YOLOv9 imports pkg_resources, which setuptools >= 70 dropped; torch's setuptools>=77 pin only
  # matters for compiling extensions, which this workflow never does.
  pip_install --no-deps setuptools==69.5.1
fi

"$PY" - <<'PY'
import importlib
mods = ["torch", "torchvision", "pytorch_quantization", "onnx", "onnxruntime", "onnxslim", "cv2", "pycocotools",
        "pkg_resources", "IPython", "thop", "yaml", "tqdm", "pandas", "seaborn", "matplotlib", "tensorboard",
        "xdist"]
missing = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        missing.append(f"{m} ({type(e).__name__}: {e})")
if missing:
    raise SystemExit("install_dependencies: error: cannot import " + ", ".join(missing))
import torch, onnxruntime, pytorch_quantization
print(f"install_dependencies: ok: torch {torch.__version__} (CUDA {'yes' if torch.cuda.is_available() else 'no'}), "
      f"pytorch-quantization {pytorch_quantization.__version__}, onnxruntime {onnxruntime.__version__}")
PY

if [ "$with_trt" = 1 ]; then
  if pip_install "tensorrt>=10,<12" && "$PY" -c "import tensorrt" 2>/dev/null; then
    echo "install_dependencies: TensorRT $("$PY" -c 'import tensorrt; print(tensorrt.__version__)') installed"
  else
    echo "install_dependencies: TensorRT could NOT be installed here (the PyPI package downloads its libraries from" \
         "NVIDIA's servers). Use an NVIDIA container (nvcr.io/nvidia/tensorrt or nvidia/pytorch) or JetPack;" \
         "meanwhile val_trt.py --backend onnxruntime evaluates the same ONNX." >&2
  fi
  command -v trtexec >/dev/null 2>&1 || echo "install_dependencies: note: trtexec is not on PATH (it ships with TensorRT: /usr/src/tensorrt/bin)" >&2
fi
if [ "$with_modelopt" = 1 ]; then
  # Its [onnx] extra pins onnx/onnxruntime(-gpu) versions other than this stack's; the ONNX quantizer runs with
  # these modules on top of the pinned onnx and onnxruntime (checked by tests/test_scripts.py). Its torch
  # quantization needs the second list; its metadata asks for setuptools >= 80, which only its extension builds
  # use: the import works beside the setuptools 69 upstream needs. huggingface_hub 1.x would need httpx2 as well.
  pip_install --no-deps nvidia-modelopt==0.47.0 onnx-graphsurgeon==0.6.1 cppimport mako lief polygraphy \
    onnxconverter-common pydantic pydantic-core annotated-types typing-inspection nvidia-ml-py onnxscript onnx-ir \
    ml_dtypes
  pip_install --no-deps omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 rich==15.0.0 markdown-it-py==4.3.0 \
    mdurl==0.1.2 pulp==3.3.2 regex safetensors==0.8.0 huggingface_hub==0.36.2 ninja==1.13.2
  # torch's import warnings (no CUDA runtime, ...) only where the import fails
  check="import modelopt, modelopt.onnx.quantization, modelopt.torch.quantization; print(modelopt.__version__)"
  if out=$("$PY" -c "$check" 2>&1); then
    echo "install_dependencies: NVIDIA Model Optimizer $(echo "$out" | tail -1) installed"
  else
    echo "$out" | tail -5 >&2
    echo "install_dependencies: error: Model Optimizer's ONNX or torch quantization does not import" >&2
    exit 1
  fi
fi
