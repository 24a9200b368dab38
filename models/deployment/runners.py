"""Runners: a batch of float 0-1 NCHW images in, a dict of named output tensors out, for PyTorch, ONNX Runtime
and TensorRT alike, so that one evaluation loop (models/deployment/evaluate.py) measures all three the same way. A runner may
offer `held()`: the block one evaluation runs it in."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import TensorProto

from models.core.task import Task, task_of, task_of_outputs
from utils.onnx_utils import detect_export_mode

ENGINE_SUFFIXES = (".engine", ".plan", ".trt")


class TorchRunner:
    """A PyTorch model (float or fake-quantized) in FP32, its heads in export mode (decoded predictions, and the
    prototypes of a segmentation head): the arithmetic the exported graph computes."""

    def __init__(self, model: nn.Module, device: torch.device | str | None = None):
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.task: Task = task_of(model)
        self.output_names = list(self.task.output_names)
        self.input_shape: list[int | None] = [None, 3, None, None]
        self.max_batch = None
        self._in_block = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """One evaluation's block: the model in eval and export mode, and the quantizers' scales and fake-quantized
        weights computed (models/quantization/held_state.py), once for all its batches. Setting the modes walks
        every module: 3.4 ms against 31 ms for a batch of 4 images through PTQ gelan-t at 160 px on a CPU, paid again
        for each mixed-precision candidate's pass over a batch."""
        from models.quantization.held_state import held  # pytorch-quantization: only for PyTorch models
        with self._modes(), held(self.model, weights=True):
            outer, self._in_block = self._in_block, True
            try:
                yield
            finally:
                self._in_block = outer

    @contextlib.contextmanager
    def _modes(self) -> Iterator[None]:
        """The model in eval and export mode, put back after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with detect_export_mode(self.model):
                yield
        finally:
            if was_training:  # train(False) would only repeat eval()'s pass over every module
                self.model.train()

    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        images = self.inputs(images)
        return self.run(lambda: self.model(images))

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """`images` as the model runs them: on its device in FP32; on a CPU channels-last, for oneDNN's convolutions
        are NHWC (gelan-s at 416 px on 2 cores: 1.5x faster than NCHW; the sums in another order, so a pass over some
        layers that is to match a whole evaluation takes its images from here too)."""
        images = images.to(self.device).float()
        return images.contiguous(memory_format=torch.channels_last) if self.device.type == "cpu" else images

    @torch.no_grad()
    def run(self, forward: Callable[[], object]) -> dict[str, torch.Tensor]:
        """`forward()` (the model on images, or a pass over some of its layers: models/core/layer_outputs.py) with the
        model in eval and export mode (set here unless `held()` set them for the block), its outputs named."""
        with contextlib.nullcontext() if self._in_block else self._modes():
            out = forward()
        out = out if isinstance(out, (list, tuple)) else (out,)
        # contiguous: the outputs' layout as from NCHW inputs (channels-last ones leave the prototypes channels-last)
        return {n: t.float().cpu().contiguous() for n, t in zip(self.output_names, out)}


ORT_FP16_QUANTIZE_FIXED = (1, 32)  # earlier CPU kernels truncate FP16 QuantizeLinear (onnxruntime PR 32452)


def ort_fp16_qdq_problem(version: str) -> str | None:
    """Why onnxruntime `version` cannot evaluate an FP16 Q/DQ graph, or None where it can."""
    if tuple(int(v) for v in version.split(".")[:2]) >= ORT_FP16_QUANTIZE_FIXED:
        return None
    return (f"onnxruntime {version} evaluates FP16 Q/DQ graphs wrongly (its CPU QuantizeLinear truncates FP16 "
            "instead of rounding); use onnxruntime >= 1.32")


def ort_session(path: str | Path, optimize: bool = False):
    """CPU session. Without `optimize`, ONNX Runtime executes the Q/DQ graph as written (DQ then float ops),
    which is the arithmetic the PyTorch fake-quant model does; with it, ORT fuses into its own int8 kernels.
    An FP16 Q/DQ graph needs onnxruntime >= 1.32: older CPU kernels round FP16 QuantizeLinear toward zero."""
    import onnxruntime as ort
    problem = ort_fp16_qdq_problem(ort.__version__)
    if problem and _has_fp16_quantize(path):
        raise ValueError(f"{path}: an FP16 Q/DQ graph: {problem}, or export with --dtype fp32 to check it here")
    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 3
    # PyTorch's thread count (OMP_NUM_THREADS where set): ONNX Runtime's own default is every core, and its threads
    # spin while waiting, so two evaluations sharing a machine slowed each other by half (two workers, 2 cores)
    so.intra_op_num_threads = torch.get_num_threads()
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _has_fp16_quantize(path: str | Path) -> bool:
    graph = onnx.load(str(path), load_external_data=False).graph
    consts = {t.name: t.data_type for t in graph.initializer}
    consts.update({n.output[0]: a.t.data_type for n in graph.node if n.op_type == "Constant" for a in n.attribute
                   if a.name == "value"})
    return any(n.op_type == "QuantizeLinear" and consts.get(n.input[1]) == TensorProto.FLOAT16 for n in graph.node)


class OnnxRuntimeRunner:
    """The ONNX graph as written (no ORT graph fusions: DQ then float ops, the arithmetic TensorRT is asked for)."""

    def __init__(self, path: str | Path):
        ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
        if "EfficientNMS_TRT" in ops:
            raise ValueError(f"{path}: has an EfficientNMS_TRT node, which only TensorRT runs; evaluate the plain or "
                             "the standard end-to-end export (--nms onnx) with ONNX Runtime")
        self.session = ort_session(path)
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.input_dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
        self.input_shape = [d if isinstance(d, int) else None for d in inp.shape]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.output_shapes = {o.name: list(o.shape) for o in self.session.get_outputs()}
        self.task = task_of_outputs(self.output_names)
        self.max_batch = None
        self.metadata = dict(self.session.get_modelmeta().custom_metadata_map)

    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        outs = self.session.run(None, {self.input_name: images.cpu().numpy().astype(self.input_dtype)})
        return {n: torch.from_numpy(o).float() if o.dtype == np.float16 else torch.from_numpy(o)
                for n, o in zip(self.output_names, outs)}


class TensorRTRunner:
    """A TensorRT 10.x / 11.x engine through the named-tensor API (set_input_shape, set_tensor_address,
    execute_async_v3), with torch CUDA tensors as device buffers. Every set_* call's result is checked: a False
    means TensorRT rejected the shape or the address, and running on would read garbage."""

    def __init__(self, path: str | Path, device: str = "cuda:0"):
        import tensorrt as trt
        self.trt = trt
        self.device = torch.device(device)
        logger = trt.Logger(trt.Logger.WARNING)
        trt.init_libnvinfer_plugins(logger, "")  # EfficientNMS_TRT, for engines built from such graphs
        self.runtime = trt.Runtime(logger)  # kept alive as long as the engine (the context manager is deprecated)
        self.engine = self.runtime.deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise ValueError(f"{path}: TensorRT could not deserialize this engine (built by another TensorRT version "
                             "or for another GPU?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.output_shapes = {n: [d if d >= 0 else None for d in self.engine.get_tensor_shape(n)]
                              for n in self.output_names}
        self.task = task_of_outputs(self.output_names)
        self.input_name = inputs[0]
        shape = list(self.engine.get_tensor_shape(self.input_name))
        self.input_shape = [None if d < 0 else d for d in shape]
        self.max_batch = (self.engine.get_tensor_profile_shape(self.input_name, 0)[2][0]
                          if self.input_shape[0] is None else self.input_shape[0])
        self.stream = torch.cuda.Stream(device=self.device)

    def _torch_dtype(self, name: str) -> torch.dtype:
        t = self.trt.DataType
        return {t.FLOAT: torch.float32, t.HALF: torch.float16, t.INT32: torch.int32, t.INT64: torch.int64,
                t.INT8: torch.int8, t.BOOL: torch.bool}[self.engine.get_tensor_dtype(name)]

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        if not self.context.set_tensor_address(name, tensor.data_ptr()):
            raise RuntimeError(f"TensorRT refused the buffer of tensor {name!r}")

    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        x = images.to(self.device, self._torch_dtype(self.input_name)).contiguous()
        if not self.context.set_input_shape(self.input_name, tuple(x.shape)):
            raise ValueError(f"the engine does not take input shape {tuple(x.shape)} (its profile: "
                             f"{[tuple(s) for s in self.engine.get_tensor_profile_shape(self.input_name, 0)]})")
        self._bind(self.input_name, x)
        outputs = {}
        for name in self.output_names:
            out = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=self._torch_dtype(name),
                              device=self.device)
            self._bind(name, out)
            outputs[name] = out
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        self.stream.synchronize()
        return {k: v.float().cpu() if v.is_floating_point() else v.cpu() for k, v in outputs.items()}


def open_runner(path: str | Path, device: str = "cpu", trust: bool = False, flag: str = "--weights"):
    """The runner for a file: .pt (PyTorch), .onnx (ONNX Runtime) or a TensorRT engine."""
    path = Path(path)
    if not path.is_file():  # before any import: a typo is named as a typo
        raise FileNotFoundError(f"{flag} {path}: file not found")
    if path.suffix in ENGINE_SUFFIXES:
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            raise ValueError("TensorRT is not installed here (./install_dependencies.sh --tensorrt says why); "
                             "evaluate the ONNX with --onnx-file instead (ONNX Runtime)") from None
        return TensorRTRunner(path, _cuda(device) or "cuda:0")
    if path.suffix == ".onnx":
        return OnnxRuntimeRunner(path)
    from models.quantization.checkpoint import load_for_export  # pytorch-quantization: only for PyTorch checkpoints
    device = _cuda(device) if _cuda(device) and torch.cuda.is_available() else "cpu"
    return TorchRunner(load_for_export(path, device, trust=trust), device)


def _cuda(device: str) -> str | None:
    device = str(device)
    if device.isdigit():
        return f"cuda:{device}"
    return device if device.startswith("cuda") else None
