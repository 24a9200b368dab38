"""The export path of export_qat.py and export_yoloV9.py: loading, the graph (FP32 trace, onnxslim, FP16
conversion), NMS inside the graph, the settings recorded in the ONNX metadata, one file name per artefact, the
lint, and the ONNX Runtime parity check."""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
import torch
import torch.nn as nn

from models.core.task import task_of
from models.quantization.checkpoint import load_for_export
from models.quantization.held_state import held
from models.quantization.quantize import float_convs
from utils.general import LOGGER, colorstr
from utils.io_utils import atomic_write
from utils.onnx_fp16 import FP16_OPSET, to_fp16
from utils.onnx_nms import NMSSettings, add_nms
from utils.onnx_utils import export_onnx
from utils.provenance import sha256, toolkit_commit
from utils.qdq_lint import FLOAT_LAYERS_KEY, LintReport, lint, module_of

PREFIX = colorstr("export: ")
DTYPES = ("fp16", "fp32")  # the type of everything in a graph that is not INT8
SETTINGS_KEY = "yolov9_qat.export"  # ONNX metadata: what the file was exported from and how
# One file name per artefact, beside the weights: W.onnx, W-end2end.onnx, W-end2end-efficientnms.onnx,
# W-deepstream.onnx (+ W-deepstream-labels.txt)
SUFFIXES = {"plain": "", "end2end": "-end2end", "end2end-efficient": "-end2end-efficientnms",
            "deepstream": "-deepstream"}


def float_conv_nodes(graph: onnx.GraphProto, convs: list[str]) -> list[str]:
    """The Conv nodes of an exported graph traced from the modules `convs`."""
    wanted = set(convs)
    return [n.name for n in graph.node if n.op_type == "Conv" and module_of(n.name) in wanted]


@dataclass(frozen=True)
class GraphSpec:
    """The deployable graph's shape and types."""
    imgsz: tuple[int, int] = (640, 640)
    batch_size: int = 1                  # the static batch, or the tracing batch of a dynamic export
    dynamic: bool = False
    simplify: bool = False
    opset: int = 17
    dtype: str = "fp16"
    io_dtype: str = "fp32"

    def __post_init__(self):
        if self.dtype not in DTYPES or self.io_dtype not in DTYPES:
            raise ValueError(f"--dtype and --io-dtype must be one of {DTYPES}")
        if self.io_dtype == "fp16" and self.dtype != "fp16":
            raise ValueError("--io-dtype fp16 needs --dtype fp16")


@dataclass(frozen=True)
class ExportConfig:
    weights: str
    spec: GraphSpec = field(default_factory=GraphSpec)
    end2end: NMSSettings | None = None   # None: the plain graph
    inplace: bool = False
    device: str = "cpu"
    trust_checkpoint: bool = False


def artefact(weights: str | Path, kind: str) -> Path:
    weights = Path(weights)
    return weights.with_name(weights.stem + SUFFIXES[kind] + ".onnx")


def output_kind(end2end: NMSSettings | None) -> str:
    if end2end is None:
        return "plain"
    return "end2end" if end2end.kind == "onnx" else "end2end-efficient"


def class_names(model: nn.Module) -> list[str]:
    names = getattr(model, "names", None)
    if isinstance(names, dict):
        return [names[k] for k in sorted(names)]
    if names:
        return list(names)
    return [f"class{i}" for i in range(int(model.model[-1].nc))]


def count_qdq(model: onnx.ModelProto) -> tuple[int, int]:
    ops = [n.op_type for n in model.graph.node]
    return ops.count("QuantizeLinear"), ops.count("DequantizeLinear")


def export_graph(model: nn.Module, spec: GraphSpec, device: torch.device, wrapper: nn.Module | None = None,
                 output_names=("output0",)) -> onnx.ModelProto:
    """The deployable graph: traced in FP32 (through a temp file: large models exceed protobuf's in-memory limits),
    optionally simplified, then (dtype fp16) with every non-INT8 part in FP16 for strongly typed TensorRT builds
    (utils/onnx_fp16.py)."""
    opset = max(spec.opset, FP16_OPSET) if spec.dtype == "fp16" else spec.opset  # FP16 Q/DQ scales need opset 19
    im = torch.zeros(spec.batch_size, 3, *spec.imgsz, device=device)
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "model.onnx"
        with held(model):  # scales traced as constants, not their computation at every call (models/quantization/held_state.py)
            export_onnx(model if wrapper is None else wrapper, im, f, opset=opset, dynamic=spec.dynamic,
                        output_names=output_names)
        proto = onnx.load(str(f))
    onnx.checker.check_model(proto)
    if spec.simplify:
        proto = simplify(proto)
    return to_fp16(proto, spec.io_dtype) if spec.dtype == "fp16" else proto


def simplify(proto: onnx.ModelProto) -> onnx.ModelProto:
    """onnxslim, refusing any result that lost Q/DQ pairs (TensorRT would then run those layers in FP16)."""
    import onnxslim
    before = count_qdq(proto)
    slim = onnxslim.slim(proto)
    after = count_qdq(slim)
    if after != before:
        LOGGER.warning(f"{PREFIX}onnxslim changed Q/DQ counts {before} -> {after}; keeping the unsimplified graph")
        return proto
    return slim


def recorded_settings(weights: str | Path, kind: str, spec: GraphSpec, end2end: NMSSettings | None) -> dict:
    """What an exported file is: the weights' digest, the artefact, the graph spec and the NMS settings."""
    return {"weights_sha256": sha256(weights), "artefact": kind, **asdict(spec),
            "imgsz": list(spec.imgsz), **({"nms": asdict(end2end)} if end2end else {})}


def read_settings(path: str | Path) -> dict | None:
    """The settings an existing export recorded (None for a file this toolkit did not write)."""
    meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    return json.loads(meta[SETTINGS_KEY]) if SETTINGS_KEY in meta else None


def stamp(proto: onnx.ModelProto, settings: dict) -> onnx.ModelProto:
    proto.metadata_props.extend([onnx.StringStringEntryProto(key=SETTINGS_KEY, value=json.dumps(settings)),
                                 onnx.StringStringEntryProto(key="yolov9_qat.commit", value=toolkit_commit())])
    return proto


def mark_float_layers(proto: onnx.ModelProto, nodes: list[str]) -> onnx.ModelProto:
    """Name the convs kept in float on purpose in the metadata, so the lint and the engine-graph gate count them
    as intended."""
    if nodes:
        proto.metadata_props.append(onnx.StringStringEntryProto(key=FLOAT_LAYERS_KEY, value=json.dumps(nodes)))
    return proto


def export_model(cfg: ExportConfig) -> tuple[nn.Module, onnx.ModelProto, onnx.ModelProto]:
    """(the model, its plain graph, the graph to save: the plain one, or with NMS inside)."""
    device = torch.device(cfg.device)
    model = load_for_export(cfg.weights, device, cfg.inplace, cfg.trust_checkpoint)
    task = task_of(model)
    if cfg.end2end is not None and cfg.end2end.kind == "efficient" and task.has_masks:
        raise ValueError(f"--nms efficient: {cfg.weights} is a segmentation model, and EfficientNMS_TRT does not "
                         "output which anchors it kept, so their masks cannot follow; use --nms onnx (the default)")
    plain = export_graph(model, cfg.spec, device, output_names=task.output_names)
    kept_float = float_conv_nodes(plain.graph, float_convs(model))
    mark_float_layers(plain, kept_float)  # the end-to-end graph copies the plain one's metadata
    final = plain
    if cfg.end2end is not None:
        from models.deployment.runners import TorchRunner
        outputs = TorchRunner(model)(torch.zeros(1, 3, *cfg.spec.imgsz))
        final = add_nms(plain, int(model.model[-1].nc), {k: tuple(v.shape) for k, v in outputs.items()}, cfg.end2end)
    kind = output_kind(cfg.end2end)
    return model, plain, stamp(final, recorded_settings(cfg.weights, kind, cfg.spec, cfg.end2end))


def save_onnx(proto: onnx.ModelProto, path: Path, exist_ok: bool) -> Path:
    """Atomic write; an existing file is only replaced with exist_ok."""
    return atomic_write(path, lambda tmp: onnx.save(proto, tmp), exist_ok)


def report_lint(proto: onnx.ModelProto) -> LintReport:
    report = lint(proto)
    (LOGGER.warning if report.problems else LOGGER.info)(report.summary())
    return report


# --------------------------------------------------------------------------------------------------
# Parity with ONNX Runtime
# --------------------------------------------------------------------------------------------------
# Parity tolerances for detections. ONNX Runtime and PyTorch compute the same Q/DQ arithmetic but sum each
# convolution in another order, so a value sitting on an INT8 rounding boundary can land one step (1/127 of the
# quantizer's range) apart and carry that step downstream. In the head a step of a class conv's input moves a
# logit by |w| x scale and the score by at most a quarter of that; a few such flips move a box edge by a pixel or
# two and a score by a few hundredths (seen on the trained demo model: IoU >= 0.95, scores within 0.064 for the
# FP32 graph and 0.12 for the FP16 graph, whose activations are also rounded to FP16). A wrong scale, a missing
# quantizer or a transposed axis moves them far more.
SCORE_TOL = 0.1
MATCH_IOU = 0.8


def candidates(pred: torch.Tensor, conf_thres: float, nc: int) -> list[torch.Tensor]:
    """Every (anchor, class) pair scoring above `conf_thres`, before NMS: per image (n, 6) x1, y1, x2, y2, score,
    class."""
    from utils.general import xywh2xyxy
    out = []
    for x in pred.transpose(1, 2):  # (anchors, 4 + nc + nm)
        anchor, cls = torch.where(x[:, 4:4 + nc] > conf_thres)
        out.append(torch.cat([xywh2xyxy(x[anchor, :4]), x[anchor, 4 + cls, None], cls[:, None].float()], 1))
    return out


@dataclass
class Matches:
    """Reference detections compared with another runtime's raw predictions (`matched_detections`)."""
    counted: int = 0
    matched: int = 0
    min_iou: float = 1.0          # the worst matched pair's box overlap
    max_score_diff: float = 0.0   # and score difference

    def add(self, other: "Matches") -> None:
        self.counted, self.matched = self.counted + other.counted, self.matched + other.matched
        self.min_iou, self.max_score_diff = min(self.min_iou, other.min_iou), max(self.max_score_diff,
                                                                                  other.max_score_diff)


def matched_detections(ref: list[torch.Tensor], pred: torch.Tensor, conf_thres: float, nc: int) -> Matches:
    """Reference detections after NMS scoring at least conf_thres + SCORE_TOL (nearer the threshold a rounding step
    decides whether a box exists at all) for which the other runtime's raw predictions `pred` hold a candidate of the
    same class, IoU >= MATCH_IOU and score within SCORE_TOL; of each matched detection its closest such candidate
    (best IoU) gives the pair's IoU and score difference. Matching against the candidates before NMS, not the boxes
    after it: near-equal scores make NMS keep either of two boxes."""
    from utils.metrics import box_iou
    out = Matches()
    for r, g in zip(ref, candidates(pred, conf_thres - SCORE_TOL, nc)):
        r = r[r[:, 4] >= conf_thres + SCORE_TOL]
        out.counted += len(r)
        if len(r) and len(g):
            iou = box_iou(r[:, :4], g[:, :4])
            diff = (r[:, 4:5] - g[:, 4].unsqueeze(0)).abs()
            close = (iou >= MATCH_IOU) & (r[:, 5:6] == g[:, 5].unsqueeze(0)) & (diff <= SCORE_TOL)
            hit = close.any(1)
            out.matched += int(hit.sum())
            if hit.any():
                best = torch.where(close, iou, torch.full_like(iou, -1)).argmax(1)[hit]
                rows = torch.nonzero(hit)[:, 0]
                out.min_iou = min(out.min_iou, float(iou[rows, best].min()))
                out.max_score_diff = max(out.max_score_diff, float(diff[rows, best].max()))
    return out


def verify_parity(model: nn.Module, onnx_path: str | Path, images: list[torch.Tensor],
                  conf_thres: float = 0.25, iou_thres: float = 0.45) -> dict:
    """The ONNX run by ONNX Runtime against the PyTorch model on real images: the norm-relative error of every
    output (a segmentation model's prototypes too), and the detections after NMS (`matched_detections`)."""
    from models.deployment.evaluate import NMSConfig, detections
    from models.deployment.runners import OnnxRuntimeRunner, TorchRunner
    torch_runner, ort_runner = TorchRunner(model), OnnxRuntimeRunner(onnx_path)
    nms = NMSConfig(conf_thres, iou_thres)
    nm = int(model.model[-1].nm) if torch_runner.task.has_masks else 0
    nc = int(model.model[-1].nc)
    rel_err = dict.fromkeys(torch_runner.output_names, 0.0)
    max_abs, matches = 0.0, Matches()
    t0 = time.perf_counter()
    for im in images:
        refs, gots = torch_runner(im), ort_runner(im)
        for name, r in refs.items():
            diff = (gots[name].float() - r).abs()
            max_abs = max(max_abs, float(diff.max()))
            rel_err[name] = max(rel_err[name], float(diff.norm() / r.norm().clamp_min(1e-12)))
        first = torch_runner.output_names[0]
        matches.add(matched_detections(detections({first: refs[first]}, nms, nm), gots[first], conf_thres, nc))
    counted = matches.counted
    return {"images": sum(len(im) for im in images), "detections_counted": counted,
            "detections_matched": matches.matched / counted if counted else None,
            "matched_min_iou": round(matches.min_iou, 4) if matches.matched else None,
            "matched_max_score_diff": round(matches.max_score_diff, 4) if matches.matched else None,
            "rel_err": rel_err, "max_abs_err": max_abs, "seconds": round(time.perf_counter() - t0, 2)}
