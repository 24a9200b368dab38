#!/usr/bin/env bash
# Copy the yolov9-qat overlay over a YOLOv9 checkout: ./patch_yolov9.sh /path/to/yolov9
# Idempotent; lists what it copied. A file of the checkout that this patch did not put there and that would be
# overwritten is kept as FILE.orig first. A file an earlier patch put there that the overlay no longer has (a
# module moved) is removed, and the FILE.orig it replaced put back; nothing else is ever deleted.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${1:-}"
if [ -z "$DIR" ] || [ "$DIR" = "-h" ] || [ "$DIR" = "--help" ]; then
  echo "usage: $0 /path/to/yolov9" >&2
  exit 2
fi
for f in models/yolo.py models/common.py val.py train.py utils/general.py; do
  if [ ! -f "$DIR/$f" ]; then
    echo "patch_yolov9: error: $DIR is not a YOLOv9 checkout ($f missing); get one with scripts/get_yolov9.sh $DIR" >&2
    exit 1
  fi
done

DIR="$(cd "$DIR" && pwd)"  # absolute before the cd below: a relative DIR means relative to the caller
MANIFEST="$DIR/.yolov9_qat_files"
touch "$MANIFEST"
cd "$HERE"
overlay_files() {
  ls -1 *.py models/*.py models/*/*.py models/*/*/*.py utils/*.py scripts/*.sh scripts/*.py 2>/dev/null \
    | grep -v '^scripts/get_yolov9.sh$\|^scripts/demo.sh$'
}
copied=0
unchanged=0
while IFS= read -r rel; do
  dst="$DIR/$rel"
  if [ -f "$dst" ] && cmp -s "$rel" "$dst"; then
    unchanged=$((unchanged + 1))
    continue
  fi
  if [ -f "$dst" ] && ! grep -qxF "$rel" "$MANIFEST" && [ ! -e "$dst.orig" ]; then
    cp -p "$dst" "$dst.orig"
    echo "  kept    $rel.orig (your file, replaced by the overlay)"
  fi
  mkdir -p "$(dirname "$dst")"
  cp "$rel" "$dst.tmp.$$" && mv "$dst.tmp.$$" "$dst"
  grep -qxF "$rel" "$MANIFEST" || echo "$rel" >> "$MANIFEST"
  echo "  copied  $rel"
  copied=$((copied + 1))
done < <(overlay_files)
removed=0
while IFS= read -r rel; do
  [ -n "$rel" ] && [ ! -f "$rel" ] || continue
  if [ -f "$DIR/$rel.orig" ]; then mv "$DIR/$rel.orig" "$DIR/$rel"; elif [ -f "$DIR/$rel" ]; then rm "$DIR/$rel"; fi
  echo "  removed $rel (no longer in the overlay)"
  removed=$((removed + 1))
done < <(grep -vxF -f <(overlay_files) "$MANIFEST" || true)
if [ "$removed" != 0 ]; then
  overlay_files | grep -xF -f - "$MANIFEST" > "$MANIFEST.tmp.$$" || true
  mv "$MANIFEST.tmp.$$" "$MANIFEST"
fi
# Which overlay commit this checkout carries (results record it; utils/provenance.py reads it)
commit="${YOLOV9_QAT_COMMIT:-$(git -C "$HERE" rev-parse HEAD 2>/dev/null || echo unknown)}"
if [ -z "${YOLOV9_QAT_COMMIT:-}" ] && [ -n "$(git -C "$HERE" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  commit="$commit-dirty"
fi
echo "$commit" > "$DIR/.yolov9_qat_commit"
echo "$HERE" > "$DIR/.yolov9_qat_source"
echo "patch_yolov9: $copied file(s) copied, $unchanged already up to date, $removed removed, into $DIR"
# upstream's own scripts on this stack (torch >= 2.6, Pillow >= 10, offline): see utils/upstream_compat.py
"${PYTHON:-python3}" "$HERE/utils/upstream_compat.py" "$DIR"
