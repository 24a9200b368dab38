"""What TensorRT built: layers, precisions and reformat layers of an engine, from trtexec's JSON (no trex).

    python -m utils.engine_graph MODEL.layer.json [--profile MODEL.profile.json] [--strict] [--svg OUT.svg]
                                 [--baseline OTHER.layer.json]

Reads `trtexec --exportLayerInfo` (with --profilingVerbosity=detailed) and optionally `--exportProfile`, from
TensorRT 10 ("Format/Datatype" per tensor) or 11 (separate "Format" and "DataType"). TensorRT Explorer, which did
this, left the TensorRT repository in 11.1. Reports the layers by type and by the precision they compute in (read
off their input tensors and weights: an INT8 convolution that writes FP16 for its consumer is an INT8 layer), the
time share per precision with a profile, and every Reformat layer: what it converts (quantize float -> INT8,
dequantize INT8 -> float, requantize, or a layout copy), its origin (QDQ: a Q/DQ node TensorRT could not fuse
into a neighbour; REFORMAT: a layout change) and whether it sits at the network's input/output or inside it.

--strict follows NVIDIA's QAT placement guidance (quantize every input of an INT8 layer, residual inputs
included, so that INT8 tensors flow from layer to layer) and exits 1 on either sign that it was not followed:
- a float layer left between INT8 layers: a Reformat inside the network that dequantizes an INT8 tensor so that
  a layer can compute in float;
- a requantization: a Reformat that quantizes a tensor an INT8 layer wrote in float (the INT8 result took a
  round trip through float), or converts INT8 to INT8 at another scale.
Quantizing the output of a layer that computes in float (e.g. before a classifier, after FP16 pooling) and layout
copies between float layers are allowed. Layers kept in float on purpose (mixed precision, --skip-layers: the
exporter names them in the ONNX metadata; `--onnx MODEL.onnx` reads them) are intended: a Reformat that feeds one
is counted and named under "kept in float on purpose", not as a problem. --baseline OTHER.layer.json exits 1 when this engine has reformats of a
kind the other has fewer of (NVIDIA's check of a QAT engine against the PTQ engine of the same model). --svg draws
the engine graph with Graphviz (`dot`), coloured by precision; without `dot` the .dot file is written instead.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import google.protobuf.message
import onnx

from utils.qdq_lint import float_layers

PRECISION_COLOURS = {"INT8": "#76b900", "FP16": "#4f9fd8", "FP32": "#e8a33d", "FP8": "#9b59b6"}


def tensor_precision(tensor: dict) -> str:
    """INT8 / FP16 / FP32 / INT32 / BOOL / ... from a tensor's Format/Datatype text (TensorRT 10 or 11)."""
    text = " ".join(str(tensor.get(k, "")) for k in ("Format/Datatype", "DataType", "Datatype", "Format")).lower()
    for needle, name in (("int8", "INT8"), ("fp8", "FP8"), ("fp16", "FP16"), ("half", "FP16"), ("bf16", "BF16"),
                         ("fp32", "FP32"), ("float", "FP32"), ("int32", "INT32"), ("int64", "INT64"),
                         ("bool", "BOOL")):
        if needle in text:
            return name
    return "?"


def layer_precision(layer: dict) -> str:
    """The precision a layer computes in, read off what it reads: its first input tensor and, for weighted layers,
    its weights. (Its output type says what the next layer wanted: an INT8 convolution writes FP16 for a float
    consumer, and TensorRT Explorer, too, classified layers by their inputs.)"""
    ins = [tensor_precision(t) for t in layer.get("Inputs", [])]
    if not ins:
        outs = [tensor_precision(t) for t in layer.get("Outputs", [])]
        return outs[0] if outs else "?"
    weights = layer.get("Weights")
    if isinstance(weights, dict) and ins[0] == "INT8" and tensor_precision({"DataType": weights.get("Type", "")}) \
            not in ("INT8", "?"):
        return tensor_precision({"DataType": weights.get("Type", "")})  # float weights: float kernel
    return ins[0]


@dataclass
class EngineReport:
    layers: int = 0
    by_type: dict = field(default_factory=dict)
    by_precision: dict = field(default_factory=dict)
    reformats: list = field(default_factory=list)
    internal_reformats: int = 0
    violations: list = field(default_factory=list)
    intended: list = field(default_factory=list)   # dequantizations feeding a layer kept in float on purpose
    time_ms_by_precision: dict = field(default_factory=dict)
    time_share_by_precision: dict = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"engine_graph: {self.layers} layers; by precision (of their inputs): "
                 + ", ".join(f"{k} {v}" for k, v in sorted(self.by_precision.items()))
                 + f"; Reformat layers: {len(self.reformats)} ({self.internal_reformats} inside the network)"]
        lines.append("  layer types: " + ", ".join(f"{k} {v}" for k, v in sorted(self.by_type.items())))
        for r in self.reformats:
            lines.append(f"  Reformat {r['name']} [{r['kind']}, {r['origin']}, {r['where']}]: {r['from']} -> {r['to']}")
        if self.time_share_by_precision:
            lines.append("  time share: " + ", ".join(f"{k} {v:.1%}" for k, v in
                                                      sorted(self.time_share_by_precision.items())))
        lines.append(f"  against the QAT placement guidance: {len(self.violations)} "
                     + ("problem(s)" if self.violations else "problems (INT8 tensors flow from layer to layer)"))
        lines += [f"    {v['name']}: {v['reason']}" for v in self.violations]
        if self.intended:
            lines.append(f"  kept in float on purpose: {len(self.intended)} reformat(s) into "
                         + ", ".join(sorted({v["layer"] for v in self.intended})))
        return "\n".join(lines)


def load_layers(path: str | Path) -> tuple[list[dict], set[str]]:
    """Layers and the names of the network's I/O tensors (TensorRT 10 "Bindings" or 11 "I/O Tensors")."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    layers = data.get("Layers") if isinstance(data, dict) else None
    if not layers or not all(isinstance(layer, dict) for layer in layers):
        raise ValueError(f"{path}: no detailed layer list; build with trtexec --profilingVerbosity=detailed "
                         "--exportLayerInfo")
    io = data.get("Bindings") or [t.get("Name") for t in data.get("I/O Tensors", [])]
    return layers, set(io)


def load_profile(path: str | Path) -> dict[str, float]:
    """Total time (ms) per layer name from trtexec --exportProfile (the first entry is the run count)."""
    entries = json.loads(Path(path).read_text())
    return {e["name"]: float(e.get("timeMs", 0.0)) for e in entries if isinstance(e, dict) and "name" in e}


def reformat_kind(src: str, dst: str, producer_precision: str | None) -> str:
    """quantize (float -> INT8), dequantize (INT8 -> float), requantize (INT8 -> INT8, or float written by an
    INT8 layer -> INT8), or layout (same precision)."""
    if src == "INT8" and dst == "INT8":
        return "requantize"
    if dst == "INT8":
        return "requantize" if producer_precision == "INT8" else "quantize"
    if src == "INT8":
        return "dequantize"
    return "layout"


def kept_float_layer(layer_names: list[str], kept_float: tuple[str, ...]) -> str | None:
    """The first engine layer whose name holds one of the ONNX nodes kept in float (TensorRT names a fused layer
    after the nodes it fused, joined by ' + ')."""
    return next((name for name in layer_names for node in kept_float if node in name), None)


def analyse(layers: list[dict], io: set[str], profile: dict[str, float] | None = None,
            kept_float: tuple[str, ...] = ()) -> EngineReport:
    report = EngineReport(layers=len(layers), by_type=dict(Counter(layer.get("LayerType", "?") for layer in layers)),
                          by_precision=dict(Counter(layer_precision(layer) for layer in layers)))
    producer = {t.get("Name"): layer for layer in layers for t in layer.get("Outputs", [])}
    readers: dict[str, list[str]] = {}
    for layer in layers:
        for t in layer.get("Inputs", []):
            readers.setdefault(t.get("Name"), []).append(layer.get("Name", "?"))
    for layer in layers:
        if layer.get("LayerType") != "Reformat":
            continue
        ins = [t.get("Name") for t in layer.get("Inputs", [])]
        outs = [t.get("Name") for t in layer.get("Outputs", [])]
        where = "network input" if set(ins) & io else "network output" if set(outs) & io else "inside"
        src = tensor_precision(layer["Inputs"][0]) if layer.get("Inputs") else "?"
        dst = tensor_precision(layer["Outputs"][0]) if layer.get("Outputs") else "?"
        feeder = producer.get(ins[0]) if ins else None
        kind = reformat_kind(src, dst, None if feeder is None else layer_precision(feeder))
        report.reformats.append({"name": layer.get("Name", "?"), "origin": layer.get("Origin", "?"), "where": where,
                                 "kind": kind, "from": src, "to": dst})
        intended = kept_float_layer([r for o in outs for r in readers.get(o, [])], kept_float)
        if where == "inside" and kind == "dequantize" and intended:
            report.intended.append({"name": layer.get("Name", "?"), "layer": intended})
        elif where == "inside" and kind == "dequantize":
            report.violations.append({"name": layer.get("Name", "?"), "reason": "INT8 dequantized for a layer that "
                                      "computes in float between INT8 layers"})
        elif where == "inside" and kind == "requantize":
            report.violations.append({"name": layer.get("Name", "?"), "reason": "requantization: an INT8 layer's "
                                      f"output went {src} -> {dst} (an unfused Q/DQ pair)"})
    report.internal_reformats = sum(r["where"] == "inside" for r in report.reformats)
    if profile:
        times = Counter()
        for layer in layers:
            times[layer_precision(layer)] += profile.get(layer.get("Name"), 0.0)
        total = sum(times.values()) or 1.0
        report.time_ms_by_precision = {k: round(v, 4) for k, v in times.items()}
        report.time_share_by_precision = {k: round(v / total, 4) for k, v in times.items()}
    return report


def extra_reformats(report: EngineReport, baseline: EngineReport) -> list[str]:
    """Reformat kinds (kind, from, to, where) this engine has more of than the baseline engine."""
    def counts(r):
        return Counter((x["kind"], x["from"], x["to"], x["where"]) for x in r.reformats)
    ours, theirs = counts(report), counts(baseline)
    return [f"{n - theirs.get(k, 0)} more {k[0]} {k[1]}->{k[2]} ({k[3]})" for k, n in sorted(ours.items())
            if n > theirs.get(k, 0)]


def to_dot(layers: list[dict], io: set[str]) -> str:
    """Graphviz DOT of the engine: one box per layer (type, precision), edges along the tensors."""
    def quote(s):
        return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'
    producers = {t.get("Name"): i for i, layer in enumerate(layers) for t in layer.get("Outputs", [])}
    lines = ["digraph engine {", "  rankdir=TB; node [shape=box, style=filled, fontname=Helvetica, fontsize=10];"]
    for name in sorted(io):
        lines.append(f"  {quote('io:' + name)} [label={quote(name)}, shape=ellipse, fillcolor=white];")
    for i, layer in enumerate(layers):
        precision = layer_precision(layer)
        label = f"{layer.get('LayerType', '?')} ({precision})\\n{str(layer.get('Name', ''))[:60]}"
        colour = "#d0021b" if layer.get("LayerType") == "Reformat" else PRECISION_COLOURS.get(precision, "#cccccc")
        lines.append(f"  L{i} [label={quote(label)}, fillcolor={quote(colour)}];")
        for t in layer.get("Inputs", []):
            src = producers.get(t.get("Name"))
            if src is not None:
                lines.append(f"  L{src} -> L{i};")
            elif t.get("Name") in io:
                lines.append(f"  {quote('io:' + t.get('Name'))} -> L{i};")
        for t in layer.get("Outputs", []):
            if t.get("Name") in io:
                lines.append(f"  L{i} -> {quote('io:' + t.get('Name'))};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_svg(dot_text: str, svg: Path) -> Path:
    """SVG via Graphviz's `dot`; without it, the .dot beside where the SVG would be."""
    from utils.io_utils import atomic_write
    dot = shutil.which("dot")
    if dot is None:
        path = atomic_write(svg.with_suffix(".dot"), lambda tmp: Path(tmp).write_text(dot_text))
        print(f"engine_graph: Graphviz 'dot' not found (apt install graphviz): wrote {path} instead of {svg}")
        return path
    r = subprocess.run([dot, "-Tsvg"], input=dot_text, capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise ValueError(f"dot failed: {r.stderr.strip()[:300]}")
    return atomic_write(svg, lambda tmp: Path(tmp).write_text(r.stdout))


def parse_opt(argv=None):
    p = argparse.ArgumentParser(prog="python -m utils.engine_graph", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layers", help="trtexec --exportLayerInfo JSON (built with --profilingVerbosity=detailed)")
    p.add_argument("--profile", default=None, help="trtexec --exportProfile JSON: time share per precision")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 on a float layer left between INT8 layers or a requantization (see above)")
    p.add_argument("--baseline", default=None, help="another engine's layer JSON: exit 1 where this one has more "
                                                    "reformats of a kind")
    p.add_argument("--onnx", default=None,
                   help="the ONNX the engine was built from: its layers kept in float on purpose are intended")
    p.add_argument("--svg", type=Path, default=None, help="draw the engine graph (Graphviz)")
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    opt = parse_opt(argv)
    try:
        layers, io = load_layers(opt.layers)
        profile = load_profile(opt.profile) if opt.profile else None
        kept = float_layers(onnx.load(opt.onnx, load_external_data=False)) if opt.onnx else ()
        report = analyse(layers, io, profile, kept)
        extra = extra_reformats(report, analyse(*load_layers(opt.baseline))) if opt.baseline else []
        if opt.svg:
            write_svg(to_dot(layers, io), opt.svg)
    except (OSError, ValueError, KeyError, json.JSONDecodeError, google.protobuf.message.DecodeError) as e:
        print(f"engine_graph: error: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    if opt.baseline:
        print(f"  against {opt.baseline}: " + ("; ".join(extra) if extra else "no reformat the baseline has not"))
    if opt.json:
        from utils.io_utils import atomic_write
        atomic_write(opt.json, lambda tmp: Path(tmp).write_text(json.dumps(asdict(report), indent=2)))
    return 1 if (opt.strict and report.violations) or extra else 0


if __name__ == "__main__":
    sys.exit(main())
