"""TensorRT-readiness lint for Q/DQ ONNX graphs.

    python -m utils.qdq_lint model.onnx [--strict] [--json]

Reports what makes TensorRT insert reformat layers or fall back to FP16/FP32:
- joins (Concat, MaxPool, Resize, Split/Slice, residual Add) whose quantized tensors carry different scales;
- Conv/ConvTranspose whose input or weight is not quantized;
- QuantizeLinear nodes with no DequantizeLinear after them;
- precision boundaries: conv outputs that reach a conv of the other precision (INT8 <-> float), where TensorRT
  converts; convs kept in float on purpose (mixed precision, --skip-layers) are named in the ONNX metadata
  (FLOAT_LAYERS_KEY) and reported as intended, not as unquantized;
- types as a strongly typed build (TensorRT 11) takes them: inconsistent types (strict ONNX shape inference),
  and in an FP16 graph any node still computing in FP32 (it would run in FP32).
Exit status is 1 with --strict when anything is found, 2 for an unreadable file.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from utils.onnx_fp16 import float_types, fp32_compute_nodes
from utils.onnx_utils import constant_values, producers, unshared_joins

_CONV_OPS = ("Conv", "ConvTranspose")
# Convs left in float on purpose (models.quantization.quantize.QuantRecipe.never_quantize): DFL's fixed box decoder.
ALLOWED_FLOAT_CONVS = (r"/dfl/",)
FLOAT_LAYERS_KEY = "yolov9_qat.float_layers"  # ONNX metadata: JSON list of the Conv nodes kept in float on purpose


@dataclass
class LintReport:
    dtype: str = "fp32"                # type of the non-INT8 compute: fp16 or fp32
    scale_dtypes: list = field(default_factory=list)
    fp32_compute: list = field(default_factory=list)   # in an fp16 graph: nodes still computing in FP32
    typing_error: str = ""             # ONNX shape inference (strict, with types) failed
    quantize_nodes: int = 0
    dequantize_nodes: int = 0
    convs: int = 0
    quantized_convs: int = 0
    unshared_joins: list = field(default_factory=list)
    unquantized_convs: list = field(default_factory=list)
    float_by_design: list = field(default_factory=list)
    intended_float: list = field(default_factory=list)   # convs kept in float on purpose (FLOAT_LAYERS_KEY)
    boundaries: list = field(default_factory=list)        # convs whose output reaches a conv of the other precision
    dangling_quantize: list = field(default_factory=list)

    @property
    def is_quantized(self) -> bool:
        return self.quantize_nodes > 0

    @property
    def problems(self) -> int:
        return (len(self.unshared_joins) + len(self.unquantized_convs) + len(self.dangling_quantize)
                + len(self.fp32_compute) + bool(self.typing_error))

    def summary(self) -> str:
        typing = (f"; {self.dtype} graph" + (f", FP32 compute nodes: {len(self.fp32_compute)}"
                                                  if self.dtype == "fp16" else "")
                  + (f"; TYPING ERROR: {self.typing_error}" if self.typing_error else ""))
        if not self.is_quantized:
            return f"qdq_lint: no Q/DQ nodes ({self.convs} convs): a float model{typing}" + "".join(
                f"\n  FP32 {c['op']}: {c['node']}" for c in self.fp32_compute)
        lines = [f"qdq_lint: {self.quantize_nodes} Q / {self.dequantize_nodes} DQ nodes, "
                 f"{self.quantized_convs}/{self.convs} convs quantized ({len(self.float_by_design)} float by design, "
                 f"{len(self.intended_float)} kept in float); INT8/float boundaries: {len(self.boundaries)}; "
                 f"unshared-scale joins: {len(self.unshared_joins)}, unquantized convs: {len(self.unquantized_convs)}, "
                 f"Q without DQ: {len(self.dangling_quantize)}; scales {'/'.join(self.scale_dtypes)}{typing}"]
        for j in self.unshared_joins:
            lines.append(f"  join with {len(j['scales'])} scales: {', '.join(j['quantize_nodes'][:4])}")
        if self.intended_float:
            lines.append("  kept in float (mixed precision): " + ", ".join(self.intended_float))
        for c in self.unquantized_convs:
            lines.append(f"  unquantized {c['op']}: {c['node']} ({', '.join(c['missing'])})")
        for q in self.dangling_quantize:
            lines.append(f"  Q without DQ: {q}")
        for c in self.fp32_compute:
            lines.append(f"  FP32 {c['op']}: {c['node']}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**asdict(self), "problems": self.problems}


def module_of(node_name: str) -> str:
    """The PyTorch module a node was traced from, by torch.onnx's scope names: '/model.22/cv3.2/cv3.2.2/Conv' ->
    'model.22.cv3.2.2' (a container's child repeats the container's name as its prefix)."""
    parts, previous = [], None
    for scope in node_name.strip("/").split("/")[:-1]:
        parts.append(scope[len(previous) + 1:] if previous and scope.startswith(previous + ".") else scope)
        previous = scope
    return ".".join(parts)


def float_layers(model: onnx.ModelProto) -> tuple[str, ...]:
    """The Conv nodes the exporter kept in float on purpose (its metadata; none for other files)."""
    meta = {p.key: p.value for p in model.metadata_props}
    return tuple(json.loads(meta.get(FLOAT_LAYERS_KEY, "[]")))


def conv_precisions(graph: onnx.GraphProto, consts: dict) -> dict[str, str]:
    """Each Conv node's compute precision: "int8" where its input and weight come from DequantizeLinear."""
    prod = producers(graph)

    def dequantized(name):
        return name not in consts and name in prod and prod[name].op_type == "DequantizeLinear"
    return {n.name: "int8" if dequantized(n.input[0]) and dequantized(n.input[1]) else "float"
            for n in graph.node if n.op_type in _CONV_OPS}


def precision_boundaries(graph: onnx.GraphProto, precision: dict[str, str]) -> list[str]:
    """The convs whose output reaches (through any non-conv ops, Q/DQ included) a conv of the other precision:
    one INT8 <-> float conversion each in the engine."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    crossing = []
    for node in graph.node:
        if node.name not in precision:
            continue
        reached, stack, seen = set(), list(node.output), set()
        while stack:
            for c in consumers.get(stack.pop(), []):
                if c.name in precision:
                    reached.add(precision[c.name])
                elif c.name not in seen:
                    seen.add(c.name)
                    stack.extend(c.output)
        if reached - {precision[node.name]}:
            crossing.append(node.name)
    return crossing


def lint(model: onnx.ModelProto, share_add_inputs: bool = True,
         allowed_float: tuple[str, ...] = ALLOWED_FLOAT_CONVS, kept_float: tuple[str, ...] | None = None) -> LintReport:
    """`kept_float`: Conv node names kept in float on purpose (default: the file's own FLOAT_LAYERS_KEY)."""
    graph = model.graph
    kept_float = set(float_layers(model) if kept_float is None else kept_float)
    consts = constant_values(graph)
    prod = producers(graph)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)

    report = LintReport(
        quantize_nodes=sum(n.op_type == "QuantizeLinear" for n in graph.node),
        dequantize_nodes=sum(n.op_type == "DequantizeLinear" for n in graph.node))
    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            if not any(c.op_type == "DequantizeLinear" for c in consumers.get(node.output[0], [])):
                report.dangling_quantize.append(node.name or node.output[0])
        if node.op_type in _CONV_OPS:
            report.convs += 1
            missing = [role for role, name in (("input", node.input[0]), ("weight", node.input[1]))
                       if name in consts or prod.get(name) is None or prod[name].op_type != "DequantizeLinear"]
            if missing and any(re.search(p, node.name) for p in allowed_float):
                report.float_by_design.append(node.name)
            elif len(missing) == 2 and node.name in kept_float:
                report.intended_float.append(node.name)
            elif missing:
                report.unquantized_convs.append({"node": node.name, "op": node.op_type, "missing": missing})
            else:
                report.quantized_convs += 1
    if report.is_quantized:
        report.unshared_joins = unshared_joins(graph, share_add_inputs)
        # the DFL decoder is float in every build (after the last INT8 convs): only boundaries a choice adds count
        precision = {k: v for k, v in conv_precisions(graph, consts).items() if k not in report.float_by_design}
        report.boundaries = precision_boundaries(graph, precision)
    else:  # nothing to say about a float model
        report.unquantized_convs, report.float_by_design, report.intended_float = [], [], []
    _check_typing(model, report, consts)
    return report


def _check_typing(model: onnx.ModelProto, report: LintReport, consts: dict) -> None:
    """Types as TensorRT's strongly typed build will take them: consistent (strict shape inference), Q/DQ scale
    types, and in an FP16 graph every float compute node in FP16."""
    scale_types = {consts[n.input[1]].dtype.name for n in model.graph.node
                   if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[1] in consts}
    report.scale_dtypes = sorted(scale_types)
    try:
        types = set(float_types(model).values())
    except Exception as e:  # onnx raises InferenceError / ValidationError subclasses without a common base
        report.typing_error = str(e).splitlines()[0][:300]
        return
    report.dtype = "fp16" if onnx.TensorProto.FLOAT16 in types or "float16" in scale_types else "fp32"
    if report.dtype == "fp16":
        report.fp32_compute = fp32_compute_nodes(model)


def lint_file(path: str | Path, share_add_inputs: bool = True) -> LintReport:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        model = onnx.load(str(path))
    except Exception as e:  # protobuf errors have no common base class
        raise ValueError(f"{path}: not a readable ONNX model ({e})")
    return lint(model, share_add_inputs)


def parse_opt(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("onnx", help="ONNX model to check")
    p.add_argument("--strict", action="store_true", help="exit 1 when anything is found")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-share-add", action="store_true", help="do not require one scale for residual Add inputs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    opt = parse_opt(argv)
    try:
        report = lint_file(opt.onnx, not opt.no_share_add)
    except (FileNotFoundError, ValueError) as e:
        print(f"qdq_lint: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if opt.json else report.summary())
    return 1 if opt.strict and report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
