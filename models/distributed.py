"""Several processes, one quantization run: `torchrun --nproc_per_node N qat.py quantize ...` (PyTorch DDP; NCCL on
GPUs, gloo on CPUs), as upstream YOLOv9 trains.

- Calibration: each rank collects statistics on its share of the calibration batches; the statistics are then
  combined (histograms summed on one grid, maxima reduced), so every rank holds the same quantizers, equal to those
  of one process calibrating on the union of the same batches. All ranks first see the sample's first batch, which
  fixes the histograms' bin width as it does for one process; only rank 0 counts it.
- Fine-tuning: the student runs under DistributedDataParallel (gradients averaged over ranks), the teacher is
  replicated, and each step the ranks take consecutive batches of one seeded order, so a step covers the global
  --batch-size and a re-run or resumed job sees the same data.
- Rank 0 alone evaluates and writes checkpoints and report.json; the others wait for it.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from models.calibrate import HistogramCollector

TIMEOUT_MIN = int(os.environ.get("YOLOV9_QAT_DIST_TIMEOUT_MIN", "30"))  # a dead rank ends the job, not a hang


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def world_from_env() -> World:
    """The process's place in a torchrun job (one process: rank 0 of 1)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))


def init(world: World, device: torch.device) -> None:
    """Join the process group: NCCL for CUDA devices, gloo for CPUs, with a timeout so that a rank that died ends
    the job with an error rather than leaving the others waiting."""
    if world.distributed and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=TIMEOUT_MIN))


@contextlib.contextmanager
def shutdown_after(world: World):
    """Leave the process group when the run ends, however it ends."""
    try:
        yield
    finally:
        if world.distributed and dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------
def sharded(batches: Iterable[torch.Tensor], calibrators: list, world: World) -> Iterator[torch.Tensor]:
    """This rank's share of `batches` (every world.size-th, from its rank), after the first batch, which every rank
    sees so that histograms get one bin width; on ranks other than 0 its counts are cleared before going on."""
    for i, images in enumerate(batches):
        if i == 0:
            yield images
            if not world.main:
                for c in calibrators:
                    if isinstance(c, HistogramCollector) and c.hist is not None:
                        c.hist.zero_()
        elif i % world.size == world.rank:
            yield images


def combine_statistics(calibrators: list, world: World) -> None:
    """Every rank's statistics into every rank: histograms summed (on a common grid), maxima reduced."""
    if not world.distributed:
        return
    mine = [_state(c) for c in calibrators]
    gathered: list = [None] * world.size
    dist.all_gather_object(gathered, mine)
    for k, c in enumerate(calibrators):
        _merge(c, [states[k] for states in gathered])


def _state(c):
    if isinstance(c, HistogramCollector):
        return None if c.hist is None else ("hist", c._width, c.hist.cpu().numpy())
    amax = c.compute_amax()
    return None if amax is None else ("max", amax.cpu().numpy())


def _merge(c, states: list) -> None:
    states = [s for s in states if s is not None]
    if not states:
        return
    if states[0][0] == "max":
        amax = np.asarray(np.maximum.reduce([np.asarray(s[1]) for s in states]))
        c._calib_amax = torch.from_numpy(amax).to(c._calib_amax.device if c._calib_amax is not None else "cpu")
        return
    width = max(s[1] for s in states)  # every width is the first batch's times an integer (collector merges)
    grids = [_regrid(hist, w, width) for _, w, hist in states]
    total = np.zeros(max(len(g) for g in grids))
    for g in grids:
        total[:len(g)] += g
    device = c.hist.device if c.hist is not None else "cpu"
    c._hist, c._width = torch.from_numpy(total).to(device), width


def _regrid(hist: np.ndarray, width: float, target: float) -> np.ndarray:
    """`hist` (bins of `width`) summed into bins of `target`, an integer multiple of it."""
    factor = int(round(target / width))
    if factor <= 1:
        return hist
    padded = np.zeros(math.ceil(len(hist) / factor) * factor)
    padded[:len(hist)] = hist
    return padded.reshape(-1, factor).sum(1)


# --------------------------------------------------------------------------------------------------
# Fine-tuning
# --------------------------------------------------------------------------------------------------
def data_parallel(student: nn.Module, world: World, device: torch.device) -> nn.Module:
    """The student's forward for training: DistributedDataParallel over the ranks, or the student itself."""
    if not world.distributed:
        return student
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(student, device_ids=[device.index] if device.type == "cuda" else None)


def rank_batches(batches: Iterable, world: World) -> Iterator:
    """This rank's batches of a seeded stream that holds world.size consecutive batches per step."""
    for i, batch in enumerate(batches):
        if i % world.size == world.rank:
            yield batch
