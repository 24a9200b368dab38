"""Histogram collection and amax selection for activation quantizers.

Drop-in replacement for pytorch-quantization 2.1.3's HistogramCalibrator: same interface
(`collect`, `compute_amax(method, ...)`, `reset`) and the same amax choices, but
- the histogram is a function of the values seen, not of how they were batched: bins are 2^k wide, k the
  smallest for which the largest |x| seen fits in `num_bins` bins, and a value's bin is floor(|x| / width)
  (exact for a power of two). A wider range merges whole bins, so one process, any batch size and any number
  of ranks combined (models/core/distributed.py) hold the same counts, bin for bin (2.1.3 fixes its edges by the
  first batch and can end up one bin off: 2049 vs 2048);
- the exact maximum is kept too, so `max` and every histogram method come from one pass over the data;
- `mse` and `entropy` evaluate every candidate amax at once as a matrix instead of a Python loop
  (2.1.3 needs minutes for a few hundred quantizers), and run on whatever device the histogram is on
  (2.1.3's mse calls `.cuda()` and fails on CPU).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from models.core.distributed import World

AMAX_METHODS = ("max", "mse", "percentile", "entropy")
PER_QUANTIZER = "per-quantizer"  # each quantizer's pick among the candidates below (models/quantization/ranges.py)
# What `auto` measures: every method, and the percentile at the three values TensorRT users commonly take, then at
# 99.5 and 99 for models whose few outlier channels must be clipped harder (the cardamage segmenters: 99.9 collapsed
# yolov9-c-seg's PTQ, 99.5 kept it). Last, so that a tie keeps the earlier choice.
HISTOGRAM_CANDIDATES: dict[str, tuple[str, float | None]] = {
    "max": ("max", None), "mse": ("mse", None), "entropy": ("entropy", None),
    "percentile-99.9": ("percentile", 99.9), "percentile-99.99": ("percentile", 99.99),
    "percentile-99.999": ("percentile", 99.999), "percentile-99.5": ("percentile", 99.5),
    "percentile-99": ("percentile", 99.0)}
# `per-quantizer` is not one of them (README, "PTQ ranges chosen per quantizer"): in the published runs it won on
# select in 4 of 9 seeds, gave auto +0.0008 and +0.0003 val on the flagships (within noise) and -0.0040 as a method
# on gelan-s helmet, at minutes of a CPU run; it stays available by name.
AUTO_CANDIDATES: dict[str, tuple[str, float | None]] = dict(HISTOGRAM_CANDIDATES)

_ROWS_PER_CHUNK = 128  # candidate amax values evaluated together; bounds memory to rows x bins
_CHUNK = 1 << 24       # values binned at a time: bounds the index tensor's memory
_TINY = 2.0 ** -40     # the width of a histogram that has seen only zeros


def calib_method_flags(name: str) -> list[str]:
    """`qat.py quantize` flags that calibrate with one of auto's candidates (or a method qat.py names itself):
    a percentile candidate is the method plus its value, which --calib-method alone does not take."""
    method, percentile = HISTOGRAM_CANDIDATES.get(name, (name, None))
    return ["--calib-method", method] + ([] if percentile is None else ["--percentile", f"{percentile:g}"])


def bin_width(x_max: float, num_bins: int) -> float:
    """The smallest power of two w with x_max / w <= num_bins."""
    target = max(x_max, _TINY) / num_bins
    mantissa, exponent = math.frexp(target)  # target = mantissa * 2**exponent, mantissa in [0.5, 1)
    return math.ldexp(1.0, exponent - 1) if mantissa == 0.5 else math.ldexp(1.0, exponent)


class HistogramCollector:
    """Histogram of |x| over all tensors seen (bins of a power-of-two width, see the module doc) and its maximum."""

    def __init__(self, num_bits: int = 8, unsigned: bool = False, num_bins: int = 2048):
        self._num_bits = num_bits
        self._unsigned = unsigned
        self._num_bins = num_bins
        self._hist: torch.Tensor | None = None
        self._width: float | None = None
        self._max = 0.0

    def reset(self) -> None:
        self._hist = None
        self._width = None
        self._max = 0.0

    @property
    def hist(self) -> torch.Tensor | None:
        return self._hist

    @property
    def max(self) -> float:
        return self._max

    @property
    def bin_edges(self) -> torch.Tensor | None:
        if self._hist is None:
            return None
        n = self._hist.numel()
        return torch.arange(n + 1, dtype=torch.float64, device=self._hist.device) * self._width

    def set_state(self, hist: torch.Tensor, width: float, x_max: float) -> None:
        """Counts of bins of `width` (a power of two) and the maximum, e.g. several collectors' combined."""
        self._hist, self._width, self._max = hist, width, x_max

    def _regrid(self, width: float) -> None:
        """The counts in bins of `width`, a power-of-two multiple of the current width, covering [0, max]."""
        n = int(self._max // width) + 1
        if self._hist is None:
            self._hist = torch.zeros(n, dtype=torch.float64)
        elif width != self._width:
            factor = int(width // self._width)
            index = torch.arange(self._hist.numel(), device=self._hist.device) // factor
            self._hist = self._hist.new_zeros(n).index_add_(0, index, self._hist)
        elif n > self._hist.numel():
            self._hist = torch.cat([self._hist, self._hist.new_zeros(n - self._hist.numel())])
        self._width = width

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        x = x.detach().flatten()
        if not x.numel():
            return
        x_max = float(x.abs().max())
        if self._hist is None or x_max > self._max:
            self._max = max(self._max, x_max)
            self._regrid(bin_width(self._max, self._num_bins))
            if self._hist.device != x.device:
                self._hist = self._hist.to(x.device)
        n, inverse = self._hist.numel(), 1.0 / self._width
        for chunk in x.split(_CHUNK):
            index = (chunk.float().abs() * inverse).floor_().clamp_(max=n - 1).to(torch.int64)
            self._hist += torch.bincount(index, minlength=n).to(torch.float64)

    def compute_amax(self, method: str, *, stride: int = 1, start_bin: int = 128,
                     percentile: float = 99.99) -> torch.Tensor | None:
        if self._hist is None:
            return None
        if method == "max":
            return torch.tensor(self._max, dtype=torch.float32)
        hist, edges = self._hist, self.bin_edges
        if method == "percentile":
            return amax_percentile(hist, edges, percentile)
        if method == "mse":
            return amax_mse(hist, edges, self._num_bits, self._unsigned, stride, start_bin)
        if method == "entropy":
            return amax_entropy(hist, edges, self._num_bits, self._unsigned, stride, start_bin)
        raise ValueError(f"unknown amax method {method!r}; choose one of {AMAX_METHODS}")

    def __repr__(self) -> str:
        n = 0 if self._hist is None else self._hist.numel()
        return f"HistogramCollector(bins={n}, width={self._width}, max={self._max})"


def amax_percentile(hist: torch.Tensor, edges: torch.Tensor, percentile: float) -> torch.Tensor:
    """Smallest bin edge below which `percentile` % of the values lie."""
    if not 0 <= percentile <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    hist = hist.double().cpu()
    cdf = torch.cumsum(hist / hist.sum(), 0)
    idx = int(torch.searchsorted(cdf, torch.tensor([percentile / 100], dtype=torch.float64)))
    return edges[min(idx, edges.numel() - 1)].float().cpu()


def _candidate_rows(n: int, start_bin: int, stride: int, inclusive: bool) -> torch.Tensor:
    stop = n + 1 if inclusive else n
    return torch.arange(min(start_bin, n - 1), stop, stride)


def amax_mse(hist: torch.Tensor, edges: torch.Tensor, num_bits: int = 8, unsigned: bool = False,
             stride: int = 1, start_bin: int = 128) -> torch.Tensor:
    """Bin centre that, used as amax, minimises the histogram-weighted quantization MSE (summed over the occupied
    bins only: empty ones add nothing)."""
    device = hist.device
    centers = ((edges[1:] + edges[:-1]) / 2).double().to(device)
    max_bound = 2.0 ** (num_bits - 1 + int(unsigned)) - 1.0
    candidates = _candidate_rows(centers.numel(), start_bin, stride, inclusive=False).to(device)
    occupied = hist != 0
    counts, values = hist.double()[occupied], centers[occupied]
    best_mse, best_idx = math.inf, int(candidates[0])
    for rows in candidates.split(_ROWS_PER_CHUNK):
        scale = max_bound / centers[rows].unsqueeze(1)
        # ((clamp(round(v * s)) / s - v) ** 2 * count) in place: one rows x bins buffer, not six (3x faster)
        err = (values * scale).round_().clamp_(-max_bound, max_bound).div_(scale).sub_(values).pow_(2).mul_(counts)
        mse = err.sum(1)
        i = int(torch.argmin(mse))  # first minimum, as numpy's argmin
        if float(mse[i]) < best_mse:
            best_mse, best_idx = float(mse[i]), int(rows[i])
    return centers[best_idx].float().cpu()


def amax_entropy(hist: torch.Tensor, edges: torch.Tensor, num_bits: int = 8, unsigned: bool = False,
                 stride: int = 1, start_bin: int = 128) -> torch.Tensor:
    """Bin edge that minimises KL(reference || quantized) of the histogram (TensorRT's entropy calibration).

    For a candidate of i bins, bins [0, i) are merged into `nbins` groups (bin j -> group 128*j // i),
    each non-empty bin takes its group's mean, and the tail beyond i is folded into bin i-1 of the
    reference distribution. The last minimum wins, as in pytorch-quantization.

    The divergence of a candidate is computed from prefix sums and its `nbins` groups instead of bin by bin: the
    reference sums to the total count T and the quantized one to the count below i (Q), so with b' the counts with
    the tail folded in and m_g a group's mean, KL = (sum b' log b' - sum_g S_g log m_g - tail log m_last) / T
    + log(Q / T). The same minimum as the bin-by-bin sum (tests/test_quantize.py), about 20x faster: `auto`
    computes it for every activation quantizer.
    """
    device = hist.device
    bins = hist.double().clone()
    bins[0] = bins[1]
    n = bins.numel()
    nbins = 1 << (num_bits - 1 + int(unsigned))
    zero = bins.new_zeros(1)
    cum_bins = torch.cat([zero, torch.cumsum(bins, 0)])
    cum_nonzero = torch.cat([zero, torch.cumsum((bins != 0).double(), 0)])
    cum_b_log_b = torch.cat([zero, torch.cumsum(torch.special.xlogy(bins, bins), 0)])
    total = cum_bins[-1]
    candidates = _candidate_rows(n, start_bin, stride, inclusive=True)
    i = candidates.to(device)                                               # bins kept, per candidate
    # first bin of each group, ceil(g * i / nbins): nbins is a power of two, and a shift is ~3x an integer division
    bounds = (torch.arange(nbins + 1, device=device) * i[:, None] + (nbins - 1)).bitwise_right_shift_(
        nbins.bit_length() - 1)
    group_sum = cum_bins.take(bounds).diff(dim=1)  # one flat read a prefix sum, not an indexed read a group edge
    group_nonzero = cum_nonzero.take(bounds).diff(dim=1)
    group_mean = group_sum / group_nonzero.clamp_min_(1)  # 0 where a group has no counts: its sum is 0 too
    last, tail = bins[i - 1], total - cum_bins[i]
    last_group = torch.clamp((nbins * (i - 1)) // i, max=nbins - 1)
    p_log_p = cum_b_log_b[i - 1] + torch.special.xlogy(last + tail, last + tail)
    p_log_q = (torch.special.xlogy(group_sum, group_mean).sum(1)
               + torch.special.xlogy(tail, group_mean.gather(1, last_group[:, None]).squeeze(1)))
    divergences = (p_log_p - p_log_q) / total + torch.log(cum_bins[i] / total)
    divergences = torch.where((last == 0) & (tail > 0), math.inf, divergences)  # mass where the quantized has none
    best = divergences.numel() - 1 - int(torch.argmin(divergences.flip(0)))
    return edges[int(candidates[best])].float().cpu()


# The ranks' statistics of one calibration (models/core/distributed.py runs the ranks)
def combine_statistics(collectors: list[HistogramCollector], world: World) -> None:
    """Every rank's histograms and maxima into every rank's collectors: the counts one collector would hold."""
    if not world.distributed:
        return
    gathered = world.all_gather([None if c.hist is None else (c.hist.cpu().numpy(), c._width, c.max)
                                 for c in collectors])
    for k, c in enumerate(collectors):
        states = [states[k] for states in gathered if states[k] is not None]
        if states:
            hist, width, x_max = merge_histograms(states)
            c.set_state(torch.from_numpy(hist).to(c.hist.device if c.hist is not None else "cpu"), width, x_max)


def merge_histograms(states: list[tuple[np.ndarray, float, float]]) -> tuple[np.ndarray, float, float]:
    """(counts, width, max) of several collectors as one: the widest grid (every width is a power of two, so it is
    a whole multiple of the others), bins summed, up to the bin of the largest maximum."""
    width = max(w for _, w, _ in states)
    x_max = max(m for _, _, m in states)
    total = np.zeros(int(x_max // width) + 1)
    for hist, w, _ in states:
        factor = int(width // w)
        np.add.at(total, np.arange(len(hist)) // factor, hist)
    return total, width, x_max
