#!/usr/bin/env bash
# Produce a working upstream YOLOv9 checkout in DIR (default: ./yolov9), idempotently.
#   1. git clone of WongKinYiu/yolov9 when GitHub answers;
#   2. otherwise rebuilt offline from the PyPI wheel yolo9==1.0.18, which ships the same code with
#      every import prefixed `yolo9.`: the prefix is stripped and the upstream layout kept.
set -euo pipefail

DIR="${1:-yolov9}"
REPO_URL="${YOLOV9_REPO_URL:-https://github.com/WongKinYiu/yolov9.git}"
WHEEL_SPEC="yolo9==1.0.18"
PYTHON="${PYTHON:-python3}"

is_checkout() {
  [ -f "$1/models/yolo.py" ] && [ -f "$1/models/common.py" ] && [ -f "$1/val.py" ] \
    && [ -f "$1/train.py" ] && [ -f "$1/utils/general.py" ]
}

if is_checkout "$DIR"; then
  echo "get_yolov9: $DIR is already a YOLOv9 checkout ($(cat "$DIR/.yolov9_source" 2>/dev/null || echo 'origin unknown')); nothing to do."
  exit 0
fi
if [ -e "$DIR" ] && [ -n "$(ls -A "$DIR" 2>/dev/null)" ]; then
  echo "get_yolov9: error: $DIR exists, is not empty and is not a YOLOv9 checkout; choose another DIR." >&2
  exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if timeout 20 git ls-remote --heads "$REPO_URL" >/dev/null 2>&1 \
    && timeout 300 git clone --depth 1 -q "$REPO_URL" "$tmp/yolov9"; then
  route="git clone of $REPO_URL ($(git -C "$tmp/yolov9" rev-parse --short HEAD))"
else
  echo "get_yolov9: $REPO_URL is not reachable; rebuilding upstream from the PyPI wheel $WHEEL_SPEC"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$tmp/wheel" "$WHEEL_SPEC"
  "$PYTHON" -m zipfile -e "$tmp"/wheel/yolo9-*.whl "$tmp/unpacked"
  mv "$tmp/unpacked/yolo9" "$tmp/yolov9"
  # The wheel's package __init__ is a wrapper class of its own, not part of upstream.
  rm -f "$tmp/yolov9/__init__.py"
  find "$tmp/yolov9" -name '*.py' -print0 | xargs -0 sed -i -E \
    -e 's/\bfrom yolo9\./from /g' -e 's/\bimport yolo9\./import /g' -e 's/\byolo9\.(models|utils)\./\1./g'
  # Undo the wheel's departures from upstream that break the checkout: two function-local imports
  # hoisted to module level (a circular `import models.yolo`) and the NMS output indexing.
  "$PYTHON" - "$tmp/yolov9" <<'PY'
import re, sys
from pathlib import Path

root = Path(sys.argv[1])

def scope_import(path, line, anchor):
    """Move the top-level import `line` to just inside the block that starts at regex `anchor`."""
    text = path.read_text()
    if line + "\n" not in text:
        return
    text = text.replace(line + "\n", "", 1)
    m = re.search(anchor, text, flags=re.M)
    if m is None:
        sys.exit(f"get_yolov9: error: cannot find {anchor!r} in {path}")
    indent = re.match(r"\s*", m.group(0)).group(0)
    text = text[:m.start()] + f"{indent}{line.strip()}  # scoped to avoid circular import\n" + text[m.start():]
    path.write_text(text)

scope_import(root / "models/common.py", "from export import export_formats", r"^\s*sf = list\(export_formats\(\)")
scope_import(root / "models/experimental.py", "from models.yolo import Detect, Model", r"^    ckpt = None|^    model = Ensemble\(\)")

# The wheel's NMS indexes [0][0] into the model output, which breaks every single-head model
# (val.py, train.py validation); upstream takes the inference output [0].
general = root / "utils/general.py"
text = general.read_text()
wrong = "prediction = prediction[0][0]  # select only inference output"
if wrong in text:
    general.write_text(text.replace(wrong, "prediction = prediction[0]  # select only inference output"))
PY
  if grep -rqE '\byolo9\.' --include='*.py' "$tmp/yolov9"; then
    echo "get_yolov9: error: some 'yolo9.' imports were left unstripped:" >&2
    grep -rnE '\byolo9\.' --include='*.py' "$tmp/yolov9" >&2
    exit 1
  fi
  route="rebuilt from PyPI wheel $WHEEL_SPEC"
fi

echo "$route" > "$tmp/yolov9/.yolov9_source"
mkdir -p "$(dirname "$DIR")"
rmdir "$DIR" 2>/dev/null || true
mv "$tmp/yolov9" "$DIR"
is_checkout "$DIR" || { echo "get_yolov9: error: $DIR is missing upstream files after the build" >&2; exit 1; }
echo "get_yolov9: $DIR ready: $route"
