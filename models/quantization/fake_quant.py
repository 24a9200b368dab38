"""Symmetric INT8 fake quantization with PyTorch's native kernels (for a forward that inductor compiles, the same
values as elementwise ops that fuse), the same [-128, 127] range that the exported QuantizeLinear and TensorRT use,
so the model that is trained and evaluated is the model that is deployed.

Library-free: pytorch-quantization's quantizers run on it (models/quantization/backends/pytorch_quantization.py), and
either backend's learned ranges use `fake_quant_learnable`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

_MIN_AMAX = 1e-6  # TensorRT rejects a zero scale; a channel that is all zeros gets this instead


class QuantParams(NamedTuple):
    scale: float | torch.Tensor             # per tensor: a float; per channel: one value per output channel
    inv_scale: float | torch.Tensor         # 1 / scale in float32, as the native kernels compute it
    zero_point: int | torch.Tensor
    bound: int                              # 127 for INT8: values are clamped to [-bound - 1, bound]


def quant_params(amax: torch.Tensor, num_bits: int = 8) -> QuantParams:
    """Scale and zero point for symmetric INT8 from amax, as host values / plain tensors.

    Built outside the autograd and ONNX traces, so the exported scale is a constant, and held for a whole training
    epoch or evaluation (models/quantization/held_state.py), so a step neither recomputes them nor waits on the GPU.
    """
    bound = 2 ** (num_bits - 1) - 1
    scale = amax.detach().float().clamp_min(_MIN_AMAX).cpu().numpy() / bound
    if scale.size == 1:
        scale = scale.reshape(())
        return QuantParams(float(scale), float(np.float32(1) / scale), 0, bound)
    scale = torch.from_numpy(scale.reshape(-1).copy()).to(amax.device)
    return QuantParams(scale, 1.0 / scale, torch.zeros_like(scale, dtype=torch.int32), bound)


def fake_quant_with(x: torch.Tensor, params: QuantParams, fusable: bool = False) -> torch.Tensor:
    """Fake-quantize with precomputed `quant_params`: per tensor, or per channel along dim 0. `fusable`: as
    elementwise ops, for a forward that inductor compiles (they fuse there; run as they are, eagerly or captured
    by the cudagraphs backend, they are several kernels where the native op is one).

    Exported by torch.onnx as QuantizeLinear/DequantizeLinear with int8 zero points.
    """
    scale, inv_scale, zero_point, bound = params
    per_tensor = isinstance(scale, float)
    if fusable:
        shape = () if per_tensor else (-1,) + (1,) * (x.dim() - 1)
        return _elementwise_fake_quant(x, scale if per_tensor else scale.view(shape),
                                       inv_scale if per_tensor else inv_scale.view(shape), bound)
    dtype = x.dtype
    # AMP activations: the CUDA kernel quantizes FP16/BF16 directly (it computes in FP32 inside);
    # casting to FP32 and back would triple the memory traffic of every quantizer.
    cast = dtype != torch.float32 and not (per_tensor and x.is_cuda and dtype in (torch.float16, torch.bfloat16))
    if cast:  # only where the kernel lacks the dtype; never in ONNX export, which traces FP32 (no Cast nodes)
        x = x.float()
    if per_tensor and x.is_cpu and not (x.requires_grad and torch.is_grad_enabled()) \
            and not torch.onnx.is_in_onnx_export():
        # Evaluation on a CPU: the native kernel takes ~2.5x as long as multiplying by the float32 1 / scale,
        # rounding half to even, clamping and scaling in place, which give its values bit for bit (+ 0.0: its zeros
        # are never negative; tests/test_quantize.py). Quantization was ~40 % of a CPU evaluation's time.
        out = x.mul(inv_scale).round_().clamp_(-bound - 1, bound).mul_(scale).add_(0.0)
    elif per_tensor:
        out = torch.fake_quantize_per_tensor_affine(x, scale, zero_point, -bound - 1, bound)
    elif torch.onnx.is_in_onnx_export():  # exports as QuantizeLinear/DequantizeLinear with axis=0
        out = torch.fake_quantize_per_channel_affine(x, scale, zero_point, 0, -bound - 1, bound)
    else:
        # The same values and gradient mask as the per-channel kernel, which reads its zero points back to
        # the host (two GPU syncs per weight and step): the per-tensor kernel at scale 1 rounds and clamps.
        shape = (-1,) + (1,) * (x.dim() - 1)
        out = torch.fake_quantize_per_tensor_affine(x * inv_scale.view(shape), 1.0, 0, -bound - 1, bound)
        out = out * scale.view(shape)
    return out.to(dtype) if cast else out


def _elementwise_fake_quant(x: torch.Tensor, scale, inv_scale, bound: int) -> torch.Tensor:
    """The native kernels' values and straight-through gradient as elementwise ops, for inductor: it has no lowering
    of the native fake-quantize ops and calls them as opaque kernels, which splits the activation before each one
    from its fused kernel and writes each quantized tensor and its mask to memory; these ops fuse with their
    neighbours, forward and backward (gelan-c at 640 px, batch 32, one H200: QAT 298 img/s against 246, the
    backward 36 ms against 273: results/scaling/h200x2/). Unfused they cost more than the native op (the
    cudagraphs backend: 81 img/s against 119 at batch 10), hence only where inductor compiles. Computed in float32
    whatever the input's dtype, as the CUDA kernel computes FP16 inputs. The value is the quantized one plus an
    exact zero that carries the gradient where the input fell inside the range (plain ops: an autograd.Function
    doubled the trace's time; outside it, an infinite input is clamped as the kernel clamps it); its zeros are never
    negative, as the kernel's (tests/test_quantize.py)."""
    xf = x.float()
    steps = torch.round(xf * inv_scale)
    clamped = steps.clamp(-bound - 1, bound)
    return ((clamped * scale).detach() + torch.where(clamped == steps, xf - xf.detach(), 0.0)).to(x.dtype)


def fake_quant_learnable(x: torch.Tensor, amax: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """Per-tensor fake quantization with a gradient for amax (LSQ: the step size learns from the rounding and
    clipping errors it causes, scaled by 1/sqrt(numel * bound) as in the LSQ paper). The forward values equal
    `fake_quant` with the same amax."""
    bound = 2 ** (num_bits - 1) - 1
    scale = (amax.float().clamp_min(_MIN_AMAX) / bound).reshape(1)
    zero_point = torch.zeros(1, device=x.device)
    grad_factor = 1.0 / math.sqrt(x.numel() * bound)
    out = torch._fake_quantize_learnable_per_tensor_affine(x.float(), scale, zero_point, -bound - 1, bound, grad_factor)
    return out.to(x.dtype)


def fake_quant(x: torch.Tensor, amax: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """Symmetric fake quantization, per tensor (amax.numel()==1) or per channel along dim 0."""
    return fake_quant_with(x, quant_params(amax, num_bits))
