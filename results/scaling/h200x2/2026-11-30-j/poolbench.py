"""Kernel times (fp16, channels-last, one H200) of gelan-c's resamplings at batch 10, 640 px, forward + backward:
ADown's avg_pool2d(2, 1) native against the mean of four shifted slices; nearest 2x upsampling as AOT autograd
traces it (an indexed read) against fast_step.repeat_pixels and the native kernel."""
import sys
import torch
import torch.nn.functional as F
sys.path.insert(0, "/tmp/yolov9")
from models.finetuning.fast_step import repeat_pixels


def timed(fn, x, n=20):
    x = x.detach().requires_grad_(True)
    for _ in range(3):
        fn(x).backward(torch.ones_like(fn(x)))
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        y = fn(x)
    end.record(); torch.cuda.synchronize(); fwd = start.elapsed_time(end) / n
    g = torch.ones_like(y)
    start.record()
    for _ in range(n):
        y = fn(x); y.backward(g)
    end.record(); torch.cuda.synchronize()
    return fwd, start.elapsed_time(end) / n - fwd


def slices(x):
    return (x[..., :-1, :-1] + x[..., 1:, :-1] + x[..., :-1, 1:] + x[..., 1:, 1:]) * 0.25


def indexed(x):
    h, w = x.shape[-2:]
    ih = torch.arange(2 * h, device=x.device) // 2
    iw = torch.arange(2 * w, device=x.device) // 2
    return torch.ops.aten._unsafe_index(x, [None, None, ih[:, None], iw])


for c, s in ((256, 160), (512, 80), (512, 40), (256, 80), (512, 40)):
    x = torch.randn(10, c, s, s, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    a = timed(lambda t: F.avg_pool2d(t, 2, 1, 0, False, True), x)
    b = timed(slices, x)
    print(f"avg_pool2d {c}x{s}: native fwd {a[0]:.3f} bwd {a[1]:.3f} ms | 4 slices fwd {b[0]:.3f} bwd {b[1]:.3f} ms")
for c, s in ((512, 20), (512, 40), (256, 80)):
    x = torch.randn(10, c, s, s, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    r = [timed(f, x) for f in (indexed, lambda t: repeat_pixels(t, 2, 2),
                               lambda t: F.interpolate(t, scale_factor=2, mode="nearest"))]
    print(f"upsample {c}x{s}: " + " | ".join(f"{k} fwd {v[0]:.3f} bwd {v[1]:.3f} ms"
                                             for k, v in zip(("indexed", "repeat", "native"), r)))
