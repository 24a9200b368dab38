"""The quantize core on real upstream GELAN models: insertion, TensorRT sharing rules, calibration, checkpoints."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import build_model, tiny_gelan
from pytorch_quantization.nn.modules.tensor_quantizer import TensorQuantizer
from torch.utils._python_dispatch import TorchDispatchMode

from models.quantization.backends import Quantizer, get_backend
from models.quantization.calibration import PER_QUANTIZER, HistogramCollector, amax_entropy, amax_mse, amax_percentile
from models.quantization.checkpoint import load_quantized_model, save_checkpoint
from models.quantization.fake_quant import fake_quant
from models.quantization.held_state import held
from models.quantization.quantize import (CALIB_METHODS, HISTOGRAM_CANDIDATES, QuantRecipe, calibrate,
                                          collect_statistics, is_quantized, named_quantizers,
                                          quantization_disabled, quantize_model, quantizer_counts, skip_patterns)
from models.quantization.rules import derive_shared_groups
from utils.onnx_utils import unshared_joins
from utils.onnx_utils import activation_quantize_nodes, model_to_onnx


def _quantized(cfg, recipe=QuantRecipe()):
    model = build_model(cfg)
    model.fuse()
    return quantize_model(model, recipe)


@pytest.fixture(scope="module")
def gelan_t():
    return _quantized("gelan-t")


@pytest.fixture(scope="module")
def tiny_gelan_model():
    """gelan-c's blocks (ADown) beside gelan-t's (AConv, ELAN1) at a few channels: upstream's widths and depths add
    no block type."""
    return _quantized(tiny_gelan(12))


def _images(n=2, size=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(2, 3, size, size, generator=g) for _ in range(n)]


def test_every_compute_module_is_quantized(tiny_gelan_model):
    from pytorch_quantization import nn as quant_nn
    model = tiny_gelan_model
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    plain = [n for n, m in convs if not isinstance(m, quant_nn.QuantConv2d)]
    assert plain and all(".dfl." in n for n in plain), f"unquantized convs outside DFL: {plain}"
    pools = [m for m in model.modules() if isinstance(m, torch.nn.MaxPool2d)]
    assert pools and all(isinstance(m, quant_nn.QuantMaxPool2d) for m in pools)
    kinds = {type(m).__name__ for m in model.model}
    assert {"QuantConcat", "QuantUpsample"} <= kinds
    assert {"QuantADown", "QuantAConv", "ELAN1"} <= kinds  # gelan-c's downsampling beside gelan-t's blocks
    bottlenecks = [m for m in model.modules() if type(m).__name__ == "QuantRepNBottleneck"]
    assert bottlenecks
    counts = quantizer_counts(model)
    n_qconv = sum(isinstance(m, quant_nn.QuantConv2d) for m in model.modules())
    assert counts["weight"] == n_qconv
    assert counts["placements"] > counts["distinct"] > counts["weight"]  # sharing made some quantizers one
    print(counts)


def test_known_joins_share_one_quantizer(tiny_gelan_model, gelan_t):
    for model in (tiny_gelan_model, gelan_t):
        for i, layer in enumerate(model.model):
            name = type(layer).__name__
            if name == "QuantConcat":  # concat inputs share with the conv reading the concat
                assert layer._input_quantizer is model.model[i + 1].cv1.conv._input_quantizer
            if name == "QuantADown":  # split halves share; max pool input and output share
                assert layer.cv1.conv._input_quantizer is layer._maxpool_quantizer is layer.cv2.conv._input_quantizer
            if name == "SPPELAN":  # the pools and the concat they feed
                assert layer.cv2.m._input_quantizer is layer.cv3.m._input_quantizer is layer.cv4.m._input_quantizer \
                    is layer.cv5.conv._input_quantizer
        for m in model.modules():
            if type(m).__name__ == "QuantRepNBottleneck":  # residual reads the same tensor as cv1
                assert m._add_quantizer0 is m.cv1.conv._input_quantizer is m._add_quantizer1


def _groups_read_off_the_export(model, share_add_inputs: bool) -> list[list[int]]:
    """The groups as the lint sees them in the exported graph: each per-tensor quantizer given a distinct marker
    amax, the model exported to ONNX, each QuantizeLinear traced back to its quantizer by its scale and grouped by
    the INT8 tensor class it reads (utils.onnx_utils.quantized_classes). Quantizers by their index among
    model.modules()'s per-tensor quantizers."""
    from utils.onnx_utils import constant_values, quantized_classes, scale_of
    quantizers = [m for m in model.modules() if isinstance(m, Quantizer) and m.axis is None and not m._disabled]
    weights = [m for m in model.modules() if isinstance(m, Quantizer) and m.axis is not None]
    marker = 1.0 / 1024  # distinct markers survive float32 scale = amax / 127 exactly enough
    for q in weights:
        q.disable()
    for k, q in enumerate(quantizers):
        q.set_amax(torch.tensor(1.0 + k * marker))
    with held(model):
        graph = model_to_onnx(model, 64).graph
    for q in weights:
        q.enable()
    consts, groups = constant_values(graph), []
    for nodes in quantized_classes(graph, share_add_inputs).values():
        members = {round((float(scale_of(n, consts).reshape(-1)[0]) * 127 - 1.0) / marker) for n in nodes}
        if len(members) > 1:
            groups.append(sorted(members))
    return sorted(groups)


SHORTCUT = {  # upstream's Shortcut adds two conv outputs that other convs quantize: not INT8 inputs, no join
    "nc": 12, "depth_multiple": 1.0, "width_multiple": 1.0, "anchors": 3,
    "backbone": [[-1, 1, "Conv", [8, 3, 2]], [-1, 1, "Conv", [8, 1, 1]], [0, 1, "Conv", [8, 1, 1]],
                 [[1, 2], 1, "Shortcut", []], [1, 1, "Conv", [8, 3, 2]], [2, 1, "Conv", [8, 3, 2]],
                 [3, 1, "Conv", [8, 3, 2]]],
    "head": [[[4, 5, 6], 1, "DDetect", ["nc"]]]}


@pytest.mark.parametrize("cfg, share_add_inputs, backend", [
    ("gelan-t", True, "pytorch-quantization"), ("tiny-gelan", True, "pytorch-quantization"),
    ("tiny-gelan", False, "pytorch-quantization"), ("tiny-gelan-seg", True, "pytorch-quantization"),
    ("shortcut", True, "pytorch-quantization"), ("tiny-gelan", True, "modelopt")])
def test_sharing_groups_are_those_the_export_shows(cfg, share_add_inputs, backend):
    """models/quantization/rules.py records the joins in one eager forward; the lint reads them off the exported
    ONNX graph. Both give the same groups on every block type (tiny GELANs: ADown, AConv, ELAN1's and RepNCSPELAN4's
    splits, SPPELAN's pools, RepNCSPELAN4's adds, Upsample, Concat; the segmentation head's prototypes), at gelan-t's
    size, with and without the residual adds, with either backend's quantizers."""
    if backend == "modelopt":
        pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed "
                            "(./install_dependencies.sh --modelopt, as CI does)")
    yaml = {"gelan-t": "gelan-t", "shortcut": SHORTCUT}.get(cfg) or tiny_gelan(12, segment=cfg.endswith("seg"))
    model = build_model(yaml)
    model.fuse()
    quantize_model(model, QuantRecipe(share_rules=False, backend=backend)).eval()
    index = {id(q): k for k, q in enumerate(m for m in model.modules()
                                            if isinstance(m, Quantizer) and m.axis is None)}
    groups = derive_shared_groups(model, 64, share_add_inputs)
    recorded = sorted(sorted(index[id(q)] for q in group) for group in groups)
    assert recorded == _groups_read_off_the_export(model, share_add_inputs)
    assert len(recorded) >= (1 if cfg == "shortcut" else 4)


def test_joins_follow_calls_that_name_their_inputs():
    """The recording reads a call's tensors wherever the call puts them: positional or named (torch.cat(tensors=),
    F.interpolate(input=)); an index that exports as Gather joins nothing."""
    from models.quantization.rules import _Joins
    joins = _Joins(share_add_inputs=True)
    a, b = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    with joins:
        both = torch.cat(tensors=[a, b], dim=1)
        up = torch.nn.functional.interpolate(input=both, scale_factor=2.0, mode="nearest")
        sliced, picked = up[:, :1], up[0]
    find = joins.classes.find
    assert find(id(a)) == find(id(b)) == find(id(both)) == find(id(up)) == find(id(sliced)) != find(id(picked))


def test_exported_graph_has_no_unshared_join(tiny_gelan_model):
    model = tiny_gelan_model
    calibrate(model, QuantRecipe(calib_method="max"), _images(1))
    graph = model_to_onnx(model, 64).graph
    assert unshared_joins(graph) == []
    counts = quantizer_counts(model)
    n_q = sum(n.op_type == "QuantizeLinear" for n in graph.node)
    n_act = len(activation_quantize_nodes(graph))
    assert n_q - n_act == counts["weight"]  # one per-channel Q per conv weight
    assert n_act >= counts["activation"]    # every activation quantizer appears (shared ones once per tensor)


def test_without_sharing_the_lint_finds_joins():
    model = build_model(tiny_gelan(12))
    model.fuse()
    quantize_model(model, QuantRecipe(share_rules=False))
    calibrate(model, QuantRecipe(calib_method="max"), _images(1))
    assert unshared_joins(model_to_onnx(model, 64).graph)  # its concats, pools and splits: 6


FIXED_METHODS = [m for m in CALIB_METHODS if m not in ("auto", PER_QUANTIZER)]


def test_per_quantizer_calibration_ranges_every_activation_quantizer(tiny_gelan_weights):
    """`per-quantizer` through calibrate(): every activation quantizer gets a finite positive range, one of the
    one-rule candidates' (its search costs a pass per quantizer and candidate: the smallest GELAN with every block;
    tests/test_quantize_ranges.py checks its choices on the trained model)."""
    from models.quantization.checkpoint import load_float_model
    model = quantize_model(load_float_model(tiny_gelan_weights))
    stats = calibrate(model, QuantRecipe(calib_method=PER_QUANTIZER), _images(2))
    acts = dict(named_quantizers(model, activations_only=True))
    amax = torch.stack([q.amax.float() for q in acts.values()])
    assert torch.isfinite(amax).all() and (amax > 0).all()
    assert len(stats.per_quantizer) == len(acts) > 10
    assert set(stats.per_quantizer.values()) <= set(HISTOGRAM_CANDIDATES)


@pytest.mark.parametrize("method", FIXED_METHODS)
def test_calibration_methods(method, gelan_t):
    calibrate(gelan_t, QuantRecipe(calib_method=method, percentile=99.9), _images(2))
    acts = [q for _, q in named_quantizers(gelan_t, activations_only=True)]
    amax = torch.stack([q.amax.float() for q in acts])
    assert torch.isfinite(amax).all() and (amax > 0).all()
    weights = [q for _, q in named_quantizers(gelan_t) if q.axis is not None]
    assert all(q.amax.numel() > 1 for q in weights)
    gelan_t.__dict__.setdefault("_amax_by_method", {})[method] = amax


def test_max_is_the_widest_range(gelan_t):
    got = gelan_t.__dict__.get("_amax_by_method", {})
    if set(got) != set(FIXED_METHODS):
        pytest.skip("needs the four calibration runs above")
    for method in ("mse", "percentile", "entropy"):
        assert (got[method] <= got["max"] * 1.001).all()
        assert (got[method] < got["max"] * 0.999).any()


def _reference_hist(seed, scale):
    from pytorch_quantization.calib import histogram as H
    x = torch.from_numpy(np.random.default_rng(seed).standard_t(3, 60000).astype(np.float32)) * scale
    ref = H.HistogramCalibrator(8, None, False)
    for chunk in x.split(20000):
        ref.collect(chunk * (1 + chunk.abs().max() * 0))
    return ref._calib_hist.int().numpy(), ref._calib_bin_edges.numpy()


@pytest.mark.parametrize("seed", [0, 1])
def test_amax_algorithms_match_pytorch_quantization(seed, monkeypatch):
    from pytorch_quantization.calib import histogram as H
    hist, edges = _reference_hist(seed, 1 + seed)
    th, te = torch.from_numpy(hist).double(), torch.from_numpy(edges).double()
    assert float(amax_entropy(th, te)) == pytest.approx(float(H._compute_amax_entropy(hist.copy(), edges, 8, False)))
    assert float(amax_percentile(th, te, 99.99)) == pytest.approx(float(H._compute_amax_percentile(hist, edges, 99.99)))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # run the CUDA-only reference on CPU
    assert float(amax_mse(th, te)) == pytest.approx(float(H._compute_amax_mse(hist.copy(), edges, 8, False)), rel=1e-6)


def test_entropy_matches_pytorch_quantization_on_a_sparse_histogram():
    """Empty bins inside and a lone count in an empty tail: the cases where a bin of the reference has mass and the
    quantized distribution none (infinite divergence), which the prefix-sum form of amax_entropy handles apart."""
    from pytorch_quantization.calib import histogram as H
    rng = np.random.default_rng(3)
    hist = (rng.random(1500) < 0.3) * rng.integers(0, 1000, 1500)
    hist[1200:], hist[1300] = 0, 5
    edges = np.linspace(0, 2, 1501)
    ours = amax_entropy(torch.from_numpy(hist).double(), torch.from_numpy(edges))
    assert float(ours) == pytest.approx(float(H._compute_amax_entropy(hist.copy(), edges, 8, False)))


def test_histogram_growth_keeps_one_bin_width():
    c = HistogramCollector()
    c.collect(torch.full((10,), 1e-9))      # near-zero first batch: the 2.1.3 failure mode
    for scale in (1.0, 3.7, 3.7001, 250.0):
        c.collect(torch.randn(5000) * scale)
    edges = c.bin_edges
    assert 1024 < c.hist.numel() <= 2049 and c.hist.numel() + 1 == edges.numel()
    assert torch.allclose(edges[1:] - edges[:-1], edges[1] - edges[0])
    assert int(c.hist.sum()) == 10 + 4 * 5000
    assert float(edges[-1]) > c.max >= 250.0 * 3  # the largest sample is inside


def test_histogram_does_not_depend_on_how_values_are_batched():
    """The same values in batches of other sizes and in another order: the same bins and counts, bin for bin, so
    one process and any number of ranks (each with its own per-rank batch) hold the same statistics."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(3000, generator=g) * s for s in (0.01, 1.0, 0.5, 30.0, 2.0)])
    one = HistogramCollector()
    one.collect(x)
    for sizes in ((7, 2993, 12000), (1, 1, 14998)):
        other = HistogramCollector()
        for chunk in torch.flip(x, (0,)).split(list(sizes)):
            other.collect(chunk)
        assert other._width == one._width and other.max == one.max
        assert torch.equal(other.hist, one.hist)


def test_every_candidate_range_comes_from_one_pass(tiny_gelan_model):
    """`auto`'s candidates, computed from one pass of statistics, equal the ranges of a calibration with each
    method alone on the same images; each candidate is the method its name says (spelled out here, not read from
    the table the code uses, so a candidate that computed another method or percentile would fail)."""
    named = {"max": ("max", None), "mse": ("mse", None), "entropy": ("entropy", None),
             "percentile-99.9": ("percentile", 99.9), "percentile-99.99": ("percentile", 99.99),
             "percentile-99.999": ("percentile", 99.999), "percentile-99.5": ("percentile", 99.5),
             "percentile-99": ("percentile", 99.0)}
    model = copy.deepcopy(tiny_gelan_model)
    images = _images(2)
    stats = collect_statistics(model, QuantRecipe(calib_method="auto"), images)
    assert list(stats.candidates) == [*named]
    for name, (method, percentile) in named.items():
        single = copy.deepcopy(tiny_gelan_model)
        calibrate(single, QuantRecipe(calib_method=method, percentile=percentile or 99.999), images)
        ranges = torch.stack([a.float().reshape(()) for a in stats.ranges(name)])
        want = torch.stack([q.amax.float().reshape(()) for _, q in named_quantizers(single, activations_only=True)
                            if not q._disabled])
        assert torch.equal(ranges, want), name
    stats.apply("max")
    assert all(float(q.amax) == c.max for q, c in zip(stats.quantizers, stats.collectors))
    # `per-quantizer` (by name only): each quantizer at one of those ranges, the one its record names (the first
    # layers quantized, the rest float: its search costs a pass per quantizer and candidate)
    recipe = QuantRecipe(calib_method="per-quantizer", skip=(r"^model\.([4-9]|\d\d)\.",))
    model = _quantized(tiny_gelan(12), recipe)
    stats = collect_statistics(model, recipe, images)
    assert list(stats.candidates) == ["per-quantizer"]
    chosen = stats.ranges("per-quantizer")
    assert len(chosen) > 3 and sorted(stats.per_quantizer) == sorted(
        n for n, q in named_quantizers(model, activations_only=True) if not q._disabled)
    for k, name in enumerate(stats.names):
        assert torch.equal(chosen[k], stats.ranges(stats.per_quantizer[name])[k]), name


def test_fake_quant_matches_int8_rounding():
    x = torch.linspace(-3, 3, 1001)
    amax = torch.tensor(2.0)
    y = fake_quant(x, amax)
    scale = 2.0 / 127
    ref = torch.clamp(torch.round(x / scale), -128, 127) * scale
    assert torch.allclose(y, ref)
    w = torch.randn(4, 3, 3, 3)
    wa = w.abs().amax(dim=(1, 2, 3), keepdim=True)
    yq = fake_quant(w, wa)
    assert ((yq - w).abs() <= (wa / 127 / 2 + 1e-7)).all()


def _boundary_values(amax: float, n: int) -> torch.Tensor:
    """Values at and one float either side of every rounding boundary of `amax`'s INT8 grid, past the clamp, and
    `n` random ones."""
    scale = float(np.float32(amax) / np.float32(127))
    edges = (torch.arange(-140, 140, dtype=torch.float32) + 0.5) * scale
    return torch.cat([torch.randn(n, generator=torch.Generator().manual_seed(0)) * amax, edges,
                      torch.nextafter(edges, torch.tensor(1e9)), torch.nextafter(edges, torch.tensor(-1e9)),
                      torch.tensor([0.0, amax, -amax, 1e30, -1e30])])


@pytest.mark.parametrize("amax", [2.0, 1.0, 6.35, 0.0042, 123.4])
def test_evaluation_on_a_cpu_quantizes_as_the_native_kernel_bit_for_bit(amax):
    """Without a gradient on a CPU, fake_quant multiplies by the float32 1 / scale, rounds half to even, clamps and
    scales (the native kernel is ~2.5x slower there): the same values, bit for bit, as the kernel that training,
    the GPU and the ONNX export use, on values at and one float either side of every rounding boundary, at the
    clamp, and a million random ones: dividing by the scale instead, or leaving negative zeros, fails here."""
    scale = float(np.float32(amax) / np.float32(127))
    x = _boundary_values(amax, 1_000_000)
    want = torch.fake_quantize_per_tensor_affine(x, scale, 0, -128, 127)
    with torch.no_grad():
        got = fake_quant(x, torch.tensor(amax))
    assert torch.equal(got, want) and torch.equal(got.view(torch.int32), want.view(torch.int32))
    trained = x.clone().requires_grad_()  # with a gradient: the native kernel and its straight-through mask
    assert torch.equal(fake_quant(trained, torch.tensor(amax)).detach(), want)


def test_compiled_graphs_quantize_with_elementwise_ops_as_the_native_kernels():
    """For a forward that inductor compiles (`fusable`), fake_quant is elementwise arithmetic, which inductor fuses
    with the ops around it (it has no lowering of the native kernels: each was an opaque call that wrote the tensor
    and its mask to memory): the graphs handed to the compiler hold no native fake-quantize op, and give the native
    kernels' values and straight-through gradients, bit for bit in float32 (the same float32 operations), per
    tensor and per channel; FP16 inputs as the CUDA kernel quantizes them (in float32 inside). Otherwise (eager,
    or the cudagraphs backend, which runs a graph's ops unfused) the graph holds the native op: one kernel."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from models.quantization.fake_quant import fake_quant_with, quant_params
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)
    amax = 6.35
    x = _boundary_values(amax, 100_000)
    w = x[:99_000].reshape(11, 9000) * torch.linspace(0.2, 2.0, 11)[:, None]
    w_amax = torch.linspace(0.2, 2.0, 11)[:, None] * amax

    def traced(fusable: bool, params, value: torch.Tensor) -> tuple[set[str], torch.Tensor, torch.Tensor]:
        """The ops of the forward and backward graphs, the output and the input's gradient."""
        torch._dynamo.reset()
        graphs.clear()
        fn = torch.compile(lambda t: fake_quant_with(t, params, fusable),
                           backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
        value = value.clone().requires_grad_()
        out = fn(value)
        out.backward(torch.ones_like(out))
        assert len(graphs) == 2  # the forward and the backward graph
        return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}, out, value.grad
    for value, params in ((x, quant_params(torch.tensor(amax))), (w, quant_params(w_amax))):
        native, _, _ = traced(False, params, value)
        assert any("fake_quantize" in op for op in native), native
        ops, got, got_grad = traced(True, params, value)
        assert "aten.round.default" in ops and not any("fake_quantize" in op for op in ops), ops
        want_in = value.clone().requires_grad_()
        scale, zero_point = params.scale, params.zero_point
        want = torch.fake_quantize_per_tensor_affine(want_in, scale, 0, -128, 127) if isinstance(scale, float) else \
            torch.fake_quantize_per_channel_affine(want_in, scale, zero_point, 0, -128, 127)
        want.backward(torch.ones_like(want))
        assert torch.equal(got.detach(), want.detach()) and torch.equal(got_grad, want_in.grad)
        assert torch.equal(got.detach().view(torch.int32), want.detach().view(torch.int32))  # no negative zero
        assert 0 < int((want_in.grad == 0).sum()) < value.numel()  # some values clip: the mask is exercised
        half = torch.compile(lambda t, p=params: fake_quant_with(t, p, fusable=True), backend="aot_eager")(value.half())
        assert half.dtype == torch.float16 and torch.equal(half, fake_quant_with(value.half().float(), params).half())


def _quantizer(amax):
    q = get_backend("pytorch-quantization").activation_quantizer(8)
    q.set_amax(torch.tensor(amax))
    return q


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_quantizer_runs_one_kernel_per_call_and_follows_amax_changes():
    q = _quantizer(2.0)
    x = torch.linspace(-3, 3, 101)
    assert torch.equal(q(x), fake_quant(x, torch.tensor(2.0)))
    trained = x.clone().requires_grad_()
    with held(q), _AtenOps() as seen:  # as a training epoch runs it
        q(trained)
    assert seen.ops == ["aten.fake_quantize_per_tensor_affine_cachemask.default"], seen.ops
    with held(q), torch.no_grad(), _AtenOps() as seen:  # as an evaluation on a CPU runs it: one pass, no host read
        q(x)
    assert seen.ops == ["aten.mul.Tensor", "aten.round_.default", "aten.clamp_.default", "aten.mul_.Tensor",
                        "aten.add_.Tensor"], seen.ops
    q.set_amax(torch.tensor(1.0))  # calibration replaces amax
    assert torch.equal(q(x), fake_quant(x, torch.tensor(1.0)))
    with torch.no_grad():
        q._amax.mul_(3)  # an in-place change is seen too
    assert torch.equal(q(x), fake_quant(x, torch.tensor(3.0)))
    q.load_state_dict({"_amax": torch.tensor(0.5)})
    assert torch.equal(q(x), fake_quant(x, torch.tensor(0.5)))
    assert torch.equal(copy.deepcopy(q)(x), q(x))


def test_weight_quantizer_matches_the_per_channel_kernel_without_host_syncs():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(16, 8, 3, 3, generator=g) * torch.rand(16, 1, 1, 1, generator=g) * 4).requires_grad_()
    amax = w.detach().abs().amax(dim=(1, 2, 3), keepdim=True) * 0.7  # some values clip
    q = get_backend("pytorch-quantization").weight_quantizer(8)
    q.set_amax(amax)
    q(w)
    with held(q), _AtenOps() as seen:  # as a training epoch runs it
        out = q(w)
        out.backward(torch.ones_like(out))
    # the per-channel kernel reads its zero points back to the host: two GPU syncs per weight and step
    assert not any("per_channel" in op or "_local_scalar_dense" in op for op in seen.ops), seen.ops
    scale = amax.flatten() / 127
    ref = torch.fake_quantize_per_channel_affine(w.detach(), scale, torch.zeros(16, dtype=torch.int32), 0, -128, 127)
    assert torch.equal(out.detach(), ref)
    k = torch.round(w.detach() * (1.0 / (amax / 127)))
    inside = (k >= -128) & (k <= 127)
    assert torch.equal(w.grad != 0, inside)  # straight-through inside the range, zero where clipped
    assert 0 < int((~inside).sum()) < w.numel()


def test_skip_layers_by_index_and_regex():
    assert skip_patterns(["22", r"model\.3\."]) == (r"^model\.22(\.|$)", r"model\.3\.")
    with pytest.raises(ValueError, match="skip-layers"):
        skip_patterns(["(unclosed"])
    model = _quantized("gelan-t", QuantRecipe(skip=skip_patterns(["2"])))
    assert not any(n.startswith("model.2.") and isinstance(m, TensorQuantizer)
                   for n, m in model.named_modules(remove_duplicate=False))
    from pytorch_quantization import nn as quant_nn
    assert not any(isinstance(m, quant_nn.QuantConv2d) for m in model.model[2].modules())
    assert any(isinstance(m, quant_nn.QuantConv2d) for m in model.model[3].modules())


def test_disabling_a_layer_changes_the_output(gelan_t):
    calibrate(gelan_t, QuantRecipe(calib_method="max"), _images(1))
    x = _images(1, seed=5)[0]
    with torch.no_grad():
        base = gelan_t(x)[0]
        with quantization_disabled(q for n, q in named_quantizers(gelan_t) if n.startswith("model.0.")):
            changed = gelan_t(x)[0]
        again = gelan_t(x)[0]
    assert not torch.equal(base, changed)
    assert torch.equal(base, again)



@pytest.mark.parametrize("trust", [False, True], ids=["allow-list", "trusted"])
def test_a_checkpoint_of_the_flat_models_layout_still_loads(trust):
    """tests/data/tiny-gelan-int8-flat-layout.pt was written by save_checkpoint at commit 2d55ecc, before models/ was
    split by stage (its pickle names models.quantize.* and models.calibrate.*; tiny_gelan(12) fused, quantized,
    max-calibrated on two seeded random batches), beside each quantizer's amax. Read now, through the allow-list
    or fully unpickled: the same quantizers, of the classes where they live now, with the same amax bit for bit."""
    import models.quantization.backends.pytorch_quantization as pytorch_quantization_backend
    import models.quantization.quantize as quantize_module
    from conftest import REPO
    legacy = REPO / "tests/data/tiny-gelan-int8-flat-layout.pt"
    assert {n.rsplit(".", 1)[0] for n in torch.serialization.get_unsafe_globals_in_checkpoint(legacy)} >= {
        "models.quantize", "models.calibrate"}  # the file still names the old modules: this is the case tested
    model = load_quantized_model(legacy, "cpu", trust=trust)
    kept = np.load(REPO / "tests/data/tiny-gelan-int8-flat-layout-amax.npz")
    amax = {n: q.amax.detach().numpy() for n, q in named_quantizers(model) if getattr(q, "amax", None) is not None}
    assert amax.keys() == set(kept.files) and len(amax) == 81
    assert all(np.array_equal(amax[n], kept[n]) for n in kept.files)
    moved = [type(m) for m in model.modules() if type(m).__name__.startswith(("Quant", "Int8"))
             and type(m).__module__.startswith("models.")]
    assert moved and all(c is getattr(quantize_module, c.__name__, None) or
                         c is getattr(pytorch_quantization_backend, c.__name__, None) for c in moved)
    assert any(c.__name__ == "Int8Quantizer" for c in moved)  # moved twice: models.quantize -> quantize -> backend
    with torch.no_grad():
        assert torch.isfinite(model(torch.rand(1, 3, 64, 64))[0]).all()

class _ConstructedModel:
    """Pickles as a call of upstream's DetectionModel with a config of its own, as a crafted file can: upstream's
    parse_model evaluates the config's strings, here one that touches `marker` and names a real block."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from models.yolo import DetectionModel
        touch = f"__import__('pathlib').Path({str(self.marker)!r}).touch() or Conv"
        return DetectionModel, ({"nc": 1, "depth_multiple": 1.0, "width_multiple": 1.0, "anchors": 3,
                                 "backbone": [[-1, 1, touch, [8, 3, 2]]], "head": [[-1, 1, "nn.Identity", []]]},)


@pytest.mark.parametrize("trust", [False, True], ids=["allow-list", "trusted"])
def test_a_checkpoint_never_runs_an_allowed_classs_constructor(tmp_path, trust):
    """Every class of the allow-list is also something torch's restricted unpickler calls when a file asks it to,
    which runs the class's constructor with the file's arguments: arbitrary code through upstream's model
    constructors. Refused before anything is unpickled, in one message naming the class and the way out; with
    --trust-checkpoint the file is unpickled fully, as documented (and runs)."""
    from models.quantization.checkpoint import read_checkpoint
    marker, path = tmp_path / "ran", tmp_path / "crafted.pt"
    torch.save({"model": _ConstructedModel(marker)}, path)
    if not trust:
        with pytest.raises(ValueError) as e:
            read_checkpoint(path)
        assert "calls models.yolo.DetectionModel" in str(e.value) and "--trust-checkpoint" in str(e.value)
        assert not marker.exists()
    else:
        assert type(read_checkpoint(path, trust=True)["model"]).__name__ == "DetectionModel" and marker.exists()


def _archive(path, pickled: bytes):
    """A torch.save archive (torch's own records) whose pickle is `pickled`: bytes a crafted file can hold."""
    import zipfile
    torch.save({}, path)
    with zipfile.ZipFile(path) as z:
        records = {n: z.read(n) for n in z.namelist()}
    records[next(n for n in records if n.endswith("/data.pkl"))] = pickled
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            z.writestr(name, data)
    return path


def _g(module: str, name: str) -> bytes:  # GLOBAL
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _s(text: str) -> bytes:  # BINUNICODE
    return b"X" + len(text).to_bytes(4, "little") + text.encode()


def _in_model(obj: bytes) -> bytes:
    """A protocol-2 pickle of {"model": obj}: PROTO, EMPTY_DICT, the key and `obj`, SETITEM, STOP."""
    return b"\x80\x02}" + _s("model") + obj + b"s."


_IDENTITY = _g("torch.nn.modules.linear", "Identity") + b")\x81"  # NEWOBJ: an Identity, no constructor run
_MODULE_STATE = b"}(" + b"".join(_s(k) + b"}" for k in ("_modules", "_parameters", "_buffers")) + b"ub"  # BUILD
_CRAFTED = {  # what each pickle does when fully unpickled (a C unpickler finding only allowed globals does the same)
    # MaxCalibrator.collect = "x" in the whole process: BUILD's (state, slotstate) set on a class, which has no
    # __setstate__ of its own
    "state-on-a-class": (_g("pytorch_quantization.calib.max", "MaxCalibrator") + b"N}" + _s("collect") + _s("x") +
                         b"s\x86b", "BUILD on an object the file did not make"),
    # a call of what a call returned: getattr(Identity(), "forward")("x"): any module's forward, any arguments
    "call-of-a-result": (_g("builtins", "getattr") + _IDENTITY + _s("forward") + b"\x86R" + _s("x") + b"\x85R",
                         "REDUCE of an object that is no global"),
    # ModuleList.append run by APPEND on the file's module
    "append-to-a-module": (_g("torch.nn.modules.container", "ModuleList") + b")\x81" + _MODULE_STATE + _IDENTITY +
                           b"a", "APPEND to an object that is no list"),
    # ModuleDict.__setitem__ run by SETITEM
    "items-on-a-module": (_g("torch.nn.modules.container", "ModuleDict") + b")\x81" + _MODULE_STATE + _s("x") +
                          _IDENTITY + b"s", "SETITEM on an object that is no dict"),
    # INST: a class called with the file's arguments (no opcode of torch's restricted unpickler)
    "inst": (b"(" + _s("x") + b"itorch.nn.modules.linear\nIdentity\n", "opcode INST"),
    # Identity.forward.x = "y" in the whole process: BUILD on the method getattr returned sets its function's dict
    "state-on-a-method": (_g("builtins", "getattr") + _IDENTITY + _s("forward") + b"\x86R}" + _s("x") + _s("y") +
                          b"sb", "sets state or items on what builtins.getattr returns"),
}


@pytest.mark.parametrize("case", _CRAFTED)
def test_a_crafted_pickle_is_refused_before_anything_is_unpickled(case, tmp_path):
    """The allow-list unpickles with Python's C unpickler (torch's restricted one, in Python, is about 4x slower),
    which runs what torch's refuses: state set on a class, calls of what a call returned, appends and item assignments
    on any object, state set on what a function returned. The scan of the pickle refuses each of those first, as
    torch's unpickler would, in the one-line message, and the class or function a file tries to change stays as it
    was. Each pickle is valid: fully unpickled (--trust-checkpoint) it loads, and the class or function changes."""
    from pytorch_quantization.calib.max import MaxCalibrator

    from models.quantization.checkpoint import read_checkpoint
    collect, forward = MaxCalibrator.collect, torch.nn.Identity.forward
    obj, refusal = _CRAFTED[case]
    path = _archive(tmp_path / f"{case}.pt", _in_model(obj))
    try:
        with pytest.raises(ValueError) as e:
            read_checkpoint(path)
        assert refusal in str(e.value) and ("is not allowed in a YOLO checkpoint" in str(e.value) or
                                            "--trust-checkpoint" in str(e.value))
        assert MaxCalibrator.collect is collect and not vars(forward)
        try:
            read_checkpoint(path, trust=True)
        except ValueError as e:  # what the pickle made is no YOLO model: loaded all the same
            assert "no YOLO model inside" in str(e)
        assert (MaxCalibrator.collect == "x") == (case == "state-on-a-class")
        assert (vars(forward) == {"x": "y"}) == (case == "state-on-a-method")
    finally:
        MaxCalibrator.collect = collect
        vars(forward).clear()


def test_the_allow_list_loads_what_full_unpickling_loads(tmp_path, monkeypatch):
    """The C unpickler behind the allow-list makes the same objects as full unpickling: an upstream checkpoint (the
    demo's, methods stored on modules included) and a quantized one with calibrators and shared quantizers (and
    numpy's values, as upstream's training checkpoints hold `best_fitness`), compared tensor by tensor and attribute
    by attribute. Where TORCH_FORCE_WEIGHTS_ONLY_LOAD makes torch refuse any unpickler but its own, its own loads
    them through the same allow-list, the same objects again."""
    from conftest import REPO
    from models.quantization.checkpoint import read_checkpoint
    quantized = _quantized("gelan-t")
    calibrate(quantized, QuantRecipe(calib_method="percentile", percentile=99.99), _images(1))
    saved = save_checkpoint(quantized, tmp_path / "q.pt", best_fitness=np.array([0.5]), fitness=np.float64(0.25))
    for path in (REPO / "assets" / "gelan-t-demo.pt", saved):
        allowed, full = read_checkpoint(path), torch.load(path, map_location="cpu", weights_only=False)
        assert _same_objects(allowed, full, set()) == "", path
        with monkeypatch.context() as m:
            m.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
            assert _same_objects(read_checkpoint(path), full, set()) == "", path


def _same_objects(a, b, seen: set, where: str = "") -> str:
    """Where two unpickled object graphs differ ("" where they do not): types, tensors, containers, attributes."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} against {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad and torch.equal(a, b)
        return "" if same else f"{where}: tensor"
    if isinstance(a, np.ndarray):
        return "" if a.dtype == b.dtype and np.array_equal(a, b) else f"{where}: array"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)} against {list(b)}"
        return next((d for k in a if (d := _same_objects(a[k], b[k], seen, f"{where}.{k}"))), "")
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} against {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _same_objects(x, y, seen, f"{where}[{i}]"))), "")
    if callable(a) and not isinstance(a, torch.nn.Module):  # a method stored on a module: the same function
        return "" if getattr(a, "__func__", a) is getattr(b, "__func__", b) else f"{where}: {a} against {b}"
    if hasattr(a, "__dict__") and id(a) not in seen:
        seen.add(id(a))
        return _same_objects(vars(a), vars(b), seen, where)
    return "" if hasattr(a, "__dict__") or a == b or a != a and b != b else f"{where}: {a!r} against {b!r}"


def test_checkpoint_roundtrip_on_cpu(gelan_t, tmp_path):
    calibrate(gelan_t, QuantRecipe(calib_method="percentile", percentile=99.99), _images(1))
    x = _images(1, seed=7)[0]
    with torch.no_grad():
        ref = gelan_t(x)[0]
    path = save_checkpoint(gelan_t, tmp_path / "q.pt")
    assert not list(tmp_path.glob("*.tmp"))
    loaded = load_quantized_model(path, "cpu")
    assert is_quantized(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(x)[0], ref)
    # state_dict into a freshly quantized model: pytorch-quantization's loader would call .cuda() here
    fresh = _quantized("gelan-t")
    fresh.load_state_dict(gelan_t.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x)[0], ref)


def test_a_checkpoint_holds_the_model_evaluated_in_fp32_whatever_state_it_was_saved_in(tiny_gelan_model, tmp_path):
    """save_checkpoint pickles a model that is FP32 on the CPU without a learned amax itself, in eval mode and without
    its hooks for the time of the save, and a copy made so of any other; either way the file holds eval mode, no
    hooks, FP32 and frozen amax, the saved model is left as it was (its modes and hooks back), and the loaded one
    computes what the model computes in FP32."""
    from models.quantization.checkpoint import read_checkpoint
    from models.quantization.quantize import learnable_amax_parameters
    model = copy.deepcopy(tiny_gelan_model)
    calibrate(model, QuantRecipe(calib_method="max"), _images(1))
    x = _images(1, seed=3)[0]
    changes = {"as evaluated": lambda m: None, "training": lambda m: m.train(),
               "a hook": lambda m: m.model[0].register_forward_hook(lambda *args: None),
               "an FP16 bias": lambda m: setattr(m.model[0].conv.bias, "data", m.model[0].conv.bias.data.half()),
               "a learned amax": learnable_amax_parameters}
    for name, change in changes.items():
        saved = copy.deepcopy(model).eval()
        change(saved)
        state = [(m.training, len(m._forward_hooks)) for m in saved.modules()]
        loaded = read_checkpoint(save_checkpoint(saved, tmp_path / "m.pt"))["model"]
        assert [(m.training, len(m._forward_hooks)) for m in saved.modules()] == state, name
        assert not any(m.training or m._forward_hooks for m in loaded.modules()), name
        assert all(t.dtype == torch.float32 for t in loaded.state_dict().values() if t.is_floating_point()), name
        assert not any(isinstance(q._amax, torch.nn.Parameter) for _, q in named_quantizers(loaded)), name
        with torch.no_grad():
            assert torch.equal(loaded(x)[0], copy.deepcopy(saved).float().eval()(x)[0]), name


def test_fuse_makes_the_model_upstreams_fuse_makes():
    """checkpoint.fuse, which every float checkpoint's load runs: the model upstream's BaseModel.fuse() makes (the
    same modules, parameters and buffers bit for bit, the same modules running forward_fuse, the same outputs),
    without the summary fuse() prints after it."""
    from models.quantization.checkpoint import fuse
    ours, upstreams = build_model(tiny_gelan(3)), build_model(tiny_gelan(3))
    assert fuse(ours) is ours and upstreams.fuse() is upstreams

    def fused(model) -> list[str]:
        return [n for n, m in model.named_modules()
                if "forward" in vars(m) and vars(m)["forward"].__func__ is type(m).forward_fuse]

    assert [(n, type(m)) for n, m in ours.named_modules()] == [(n, type(m)) for n, m in upstreams.named_modules()]
    a, b = ours.state_dict(), upstreams.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert fused(ours) == fused(upstreams) and "model.7.cv2.0.m.0.cv1" in fused(ours)  # a RepConvN
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(ours(x)[0], upstreams(x)[0])
