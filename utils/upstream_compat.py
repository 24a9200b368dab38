"""Keep upstream YOLOv9's own scripts working on this toolkit's pinned stack (torch >= 2.6, Pillow >= 10, offline).

    python utils/upstream_compat.py /path/to/yolov9          # patch_yolov9.sh runs this
    python utils/upstream_compat.py /path/to/yolov9 --undo   # restore upstream's files as they were

The genuine repository (commit 5b1ea9a) breaks in four places on this stack; each edit below is the smallest
change that fixes one, applied only where upstream's text is found (the PyPI rebuild already carries its own fixes,
so only the font is edited there), and never twice:
- `torch.load(...)` without `weights_only`: PyTorch 2.6 changed the default to True, and upstream's checkpoints
  are whole pickled models, so train.py --weights, --resume, val.py, detect.py and export.py fail. Each such call
  gets `weights_only=False`, which is what those scripts did before PyTorch 2.6: they unpickle fully, so load only
  checkpoints you trust. (This toolkit's own tools read checkpoints through an allow-list:
  models/quantization/checkpoint.py.)
- `check_font` downloads Arial.ttf on first use (every first run tries the network) and stops train.py/val.py
  when offline: Arial.ttf is now answered by a font installed already (matplotlib's DejaVu Sans, copied under
  the name upstream looks for; it only draws plot labels), and a failed download of another font warns, plots
  then using PIL's default font. The PyPI rebuild fetches the font too: it gets the first part of this edit.
- Pillow 10 removed `FreeTypeFont.getsize`, used to size plot labels: `getbbox` gives the same width and height.
- NumPy deprecated `np.trapz` in 2.0 and later releases drop it, so every mAP (val.py, and evaluation in this
  toolkit, which reuses upstream's `ap_per_class`) fails there: `np.trapezoid` where it exists.
Each edited file is first copied to FILE.yolov9_qat.orig; `--undo` puts those copies back (in a git clone,
`git checkout -- FILE` does the same).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

RECORD = ".yolov9_qat_upstream_edits"
BACKUP_SUFFIX = ".yolov9_qat.orig"
OVERLAY_MANIFEST = ".yolov9_qat_files"  # patch_yolov9.sh: files that are ours, never edited here


@dataclass(frozen=True)
class TextEdit:
    path: str
    old: str
    new: str
    why: str


TEXT_EDITS = (
    TextEdit("utils/general.py",
             "        url = f'https://ultralytics.com/assets/{font.name}'\n",
             "        installed = Path(__import__('matplotlib').get_data_path()) / 'fonts' / 'ttf' / 'DejaVuSans.ttf'\n"
             "        if font.name == 'Arial.ttf' and installed.is_file():  # yolov9-qat: no download, offline too\n"
             "            file.write_bytes(installed.read_bytes())\n"
             "            return\n"
             "        url = f'https://ultralytics.com/assets/{font.name}'\n",
             "offline: Arial.ttf answered by a font installed already (matplotlib's DejaVu Sans), not downloaded"),
    TextEdit("utils/general.py",
             "        torch.hub.download_url_to_file(url, str(file), progress=progress)\n",
             "        try:  # yolov9-qat: offline, plots use PIL's default font\n"
             "            torch.hub.download_url_to_file(url, str(file), progress=progress)\n"
             "        except Exception as e:\n"
             "            LOGGER.warning(f'Could not download {font.name} ({e}); plots use the default font')\n",
             "offline: a failed font download warns instead of stopping"),
    TextEdit("utils/plots.py", "        except URLError:  # not online\n",
             "        except (URLError, OSError):  # not online (yolov9-qat: or the font could not be downloaded)\n",
             "offline: PIL's default font when the font file is missing"),
    TextEdit("utils/plots.py", "                w, h = self.font.getsize(label)",
             "                _, _, w, h = self.font.getbbox(label)", "Pillow >= 10: getbbox, not the removed getsize"),
    TextEdit("utils/plots.py", "            w, h = self.font.getsize(text)",
             "            _, _, w, h = self.font.getbbox(text)", "Pillow >= 10: getbbox, not the removed getsize"),
    TextEdit("utils/metrics.py", "        ap = np.trapz(np.interp(x, mrec, mpre), x)  # integrate\n",
             "        integrate = np.trapezoid if hasattr(np, 'trapezoid') else np.trapz  # yolov9-qat: no trapz\n"
             "        ap = integrate(np.interp(x, mrec, mpre), x)  # integrate\n",
             "NumPy >= 2: np.trapezoid (np.trapz is deprecated and removed in later releases)"),
)
TORCH_LOAD_WHY = "torch >= 2.6: weights_only=False, as before 2.6 (upstream checkpoints are pickled models)"


def add_weights_only(text: str) -> str:
    """Every `torch.load(...)` call without a weights_only argument gets `weights_only=False`."""
    out, pos = [], 0
    for m in re.finditer(r"\btorch\.load\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        args = text[m.end():i - 1]
        if depth or "weights_only" in args:
            continue
        out += [text[pos:i - 1], ", weights_only=False"]
        pos = i - 1
    return "".join(out) + text[pos:]


def planned_edits(root: Path) -> dict[str, tuple[str, list[str]]]:
    """{relative path: (new text, reasons)} for every upstream file that needs a change."""
    ours = set((root / OVERLAY_MANIFEST).read_text().split()) if (root / OVERLAY_MANIFEST).is_file() else set()
    texts: dict[str, str] = {}
    reasons: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel in ours:
            continue
        text = path.read_text()
        new = add_weights_only(text)
        if new != text:
            texts[rel], reasons[rel] = new, [TORCH_LOAD_WHY]
    for edit in TEXT_EDITS:
        path = root / edit.path
        if edit.path in ours or not path.is_file():
            continue
        text = texts.get(edit.path, path.read_text())
        at_line_start = re.compile(r"(?m)^" + re.escape(edit.old))  # "old" with its indentation, a whole line start
        if at_line_start.search(text) and edit.new not in text:  # and never twice
            texts[edit.path] = at_line_start.sub(lambda _: edit.new, text)
            reasons.setdefault(edit.path, []).append(edit.why)
    return {rel: (texts[rel], reasons[rel]) for rel in texts}


def apply(root: Path) -> dict[str, list[str]]:
    """Apply the edits (a backup of each file first, unless one exists); returns what was changed, and records it."""
    record_file = root / RECORD
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    for rel, (text, reasons) in planned_edits(root).items():
        path = root / rel
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        if not backup.exists():
            shutil.copy2(path, backup)
        path.write_text(text)
        record[rel] = sorted(set(record.get(rel, [])) | set(reasons))
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return record


def undo(root: Path) -> list[str]:
    record_file = root / RECORD
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    restored = []
    for rel in record:
        path = root / rel
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        if backup.is_file():
            shutil.move(backup, path)
            restored.append(rel)
    record_file.unlink(missing_ok=True)
    return restored


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkout", type=Path)
    p.add_argument("--undo", action="store_true", help="restore upstream's files from their backups")
    opt = p.parse_args(argv)
    if not (opt.checkout / "models" / "yolo.py").is_file():
        print(f"upstream_compat: error: {opt.checkout} is not a YOLOv9 checkout", file=sys.stderr)
        return 2
    if opt.undo:
        restored = undo(opt.checkout)
        print(f"upstream_compat: restored {len(restored)} upstream file(s)" + (": " + ", ".join(restored)
                                                                              if restored else ""))
        return 0
    record = apply(opt.checkout)
    print(f"upstream_compat: {len(record)} upstream file(s) carry the compatibility edits"
          + (f" (listed in {RECORD}; undo: python utils/upstream_compat.py DIR --undo)" if record else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
