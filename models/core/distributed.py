"""Several processes, one quantization run: `torchrun --nproc_per_node N qat.py quantize ...` (PyTorch DDP; NCCL on
GPUs, gloo on CPUs), as upstream YOLOv9 trains.

- Data: each rank loads only its share of every global batch of one seeded order (utils/batches.py `RankBatches`):
  together the ranks of a step hold one process's batch, each image augmented as one process augments it
  (`SeededItems`: seeded by the image, not by the worker).
- Calibration: each rank collects statistics on its share of the calibration batches; the statistics are then
  combined (histograms summed on one grid, maxima reduced), so every rank holds the same quantizers, equal to those
  of one process calibrating on the union of the same batches, whatever the per-rank batch size: a histogram's
  bins depend on the values seen alone (models/quantization/calibration.py).
- Fine-tuning: the student runs under DistributedDataParallel (gradients averaged over ranks), the teacher is
  replicated, and a step covers the global --batch-size; a re-run or resumed job sees the same data.
- Rank 0 alone evaluates and writes checkpoints and report.json; the others wait for it.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

TIMEOUT_MIN = int(os.environ.get("YOLOV9_QAT_DIST_TIMEOUT_MIN", "30"))  # a dead rank ends the job, not a hang


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1  # the job's processes on this machine

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

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered


def world_from_env() -> World:
    """The process's place in a torchrun job (one process: rank 0 of 1)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")),
                 int(os.environ.get("LOCAL_WORLD_SIZE", str(size))))


def loader_workers(requested: int | None, world: World) -> int:
    """--workers as given, or this process's share of its machine's cores less one (utils.batches.default_workers)."""
    from utils.batches import default_workers
    return default_workers(world.local_size) if requested is None else requested


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
# --------------------------------------------------------------------------------------------------
# Fine-tuning
# --------------------------------------------------------------------------------------------------
def same_on_every_rank(world: World, what: str, value: list) -> None:
    """Raise on every rank where some rank's `value` differs from rank 0's: a rank training another model (other
    quantizers on) would average its gradients into the others' without a sign."""
    values = world.all_gather(value)
    differ = [rank for rank, v in enumerate(values) if v != values[0]]
    if differ:
        raise RuntimeError(f"rank {differ[0]} holds other {what} than rank 0 ({len(values[differ[0]])} against "
                           f"{len(values[0])}): every rank must train the same model")


def data_parallel(student: nn.Module, world: World, device: torch.device) -> nn.Module:
    """The student's forward for training: DistributedDataParallel over the ranks, or the student itself.

    Buffers are broadcast from rank 0 once, when the wrapper is built, not before every forward (DDP's default):
    the student's buffers are its quantizers' ranges, calibrated alike on every rank and fixed while it trains
    (learned ranges are parameters, averaged with the gradients), so a per-step broadcast of hundreds of small
    tensors is pure cost, one only the quantized student paid (its float control has almost no buffers). DDP's
    `broadcast_buffers=False` would skip the one at wrapping too; torch >= 2.14 says it with
    `forward_sync_buffers=False`, earlier versions get the broadcast here.

    The gradients are views into DDP's all-reduce buckets (`gradient_as_bucket_view`): no copy between the two each
    step, the same sums. Two H200s, gelan-c at 640, 32 images a GPU: 873.7 and 872.5 img/s against 864.6 and 864.4
    with the copies (results/scaling/h200x2/2026-11-30-l/)."""
    if not world.distributed:
        return student
    import inspect

    from torch.nn.parallel import DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        options = {"forward_sync_buffers": False}
    else:
        for buffer in student.buffers():
            dist.broadcast(buffer.data, src=0)
        options = {"broadcast_buffers": False}
    return DistributedDataParallel(student, device_ids=[device.index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True, **options)
