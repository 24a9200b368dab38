"""Datasets and batches for calibration and fine-tuning: the data yaml, the hyperparameters, and seeded streams
of batches from upstream's loaders."""
from __future__ import annotations

import itertools
import os
import random
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import psutil
import torch
import yaml


def default_workers(local_processes: int = 1, cores: int | None = None) -> int:
    """Loader workers for each of `local_processes` training processes on this machine when --workers is not given:
    its share of the cores this process may run on, less one for its own loop (it launches the GPU's work and runs
    the loss's host side). Upstream's fixed 8 left a GPU machine's other cores idle while the step waited for
    augmented batches: an H200 host core loads and augments a cardamage image at 640 px in 32 ms
    (results/scaling/loader-profile-cardamage-640-h200-host.json), so 8 workers give about 250 img/s, where gelan-c's
    QAT step takes 387 on one H200 (results/scaling/h200x2/2026-11-29-b/). Upstream's loader still caps them at its
    cores per GPU and the batch size."""
    if not cores:  # the cores this process may run on (taskset, a container's cpuset); all of them where unknown
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, cores // max(local_processes, 1) - 1)


CACHE_CHOICES = ("auto", "ram", "disk", "off")


def decoded_bytes(shapes_wh: np.ndarray, imgsz: int) -> int:
    """The bytes that every image of sizes `shapes_wh` (width, height) takes decoded and resized as upstream's
    loader keeps it in RAM (`load_image`: the long side to `imgsz`, three uint8 channels)."""
    shapes = np.asarray(shapes_wh, dtype=np.float64).reshape(-1, 2)
    r = imgsz / shapes.max(1)
    return int((np.floor(shapes[:, 0] * r) * np.floor(shapes[:, 1] * r) * 3).sum())


def cache_choice(requested: str | None, gpu: bool, imgsz: int, processes: int, shapes: Callable[[], np.ndarray],
                 available: int | None = None) -> tuple[str | None, str]:
    """What the fine-tuning loader keeps of the training images (upstream's `cache_images`: "ram", "disk" or None),
    and why. `auto` keeps them decoded in RAM on a CUDA device where this machine's `processes` copies of them (the
    images of sizes `shapes()` at `imgsz`) take at most half of the `available` RAM (free now, where not given).
    Decoding and resizing are a third of a loader's CPU time for a cardamage image at 640 px; two H200s sharing 32
    cores were fed 1.86x as many images as one with them kept, 1.55x without, and one GPU lost nothing (384.3
    against 383.5 img/s: results/scaling/h200x2/2026-11-30-c/). On a CPU the step, not the loader, sets the pace."""
    if requested in (None, "off"):
        return None, "decoded at every draw"
    if requested != "auto":
        return requested, f"--cache {requested}"
    if not gpu:
        return None, "decoded at every draw (--cache auto: not a CUDA device)"
    gb, need = 1 << 30, decoded_bytes(shapes(), imgsz)
    available = psutil.virtual_memory().available if available is None else available
    size = f"{need / gb:.1f} GB a process, {processes} on this machine, {available / gb:.1f} GB free"
    if need * processes > available / 2:
        return None, f"decoded at every draw (--cache auto: {size}, more than half of it; --cache ram to insist)"
    return "ram", f"kept decoded in RAM (--cache auto: {size}; --cache off to decode at every draw)"


def load_data(data: str | Path) -> dict:
    """Upstream's dataset dict (paths resolved, images checked), errors naming --data."""
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"--data {data}: file not found")
    from utils.general import check_dataset  # upstream's: it sets OMP_NUM_THREADS at import, so not before use
    try:
        return check_dataset(str(path), autodownload=False)
    except Exception as e:  # upstream raises a bare Exception for missing image folders
        raise ValueError(f"--data {data}: {e}".split("\n")[0]) from None


def load_hyp(hyp: str | Path) -> dict:
    path = Path(hyp)
    if not path.is_file():
        raise FileNotFoundError(f"--hyp {hyp}: file not found")
    return yaml.safe_load(path.read_text())


class SeededItems(torch.utils.data.Dataset):
    """`dataset` with every item's random draws (augmentation, mosaic partners) seeded by its key (stream, pass,
    index): an image comes out the same whichever worker, how many workers, or which of several processes loads it.
    Upstream seeds each worker instead, so its augmentations change with --workers and the number of ranks."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]):
        seed = int(np.random.SeedSequence([v & 0xFFFFFFFF for v in key]).generate_state(1)[0])
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        return self.dataset[key[-1]]

    def __getattr__(self, name: str):  # upstream's attributes (labels, shapes, collate_fn) pass through
        if name == "dataset":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


class RankBatches(torch.utils.data.Sampler):
    """This rank's share of every batch of one seeded order: the order is drawn from `generator` as a shuffling
    loader draws it, cut into global batches of `per_rank * world_size` images, and rank r takes images
    [r * per_rank, (r + 1) * per_rank) of each. The ranks of one step together hold exactly the images of one
    process's step with the global batch, and no rank loads, augments or copies another rank's images. Only whole
    global batches: every rank takes the same number of steps."""

    def __init__(self, n_images: int, per_rank: int, world_size: int, rank: int, generator: torch.Generator):
        if n_images < per_rank * world_size:
            raise ValueError(f"{n_images} training images are fewer than one global batch of {per_rank * world_size}: "
                             "lower --batch-size")
        self.n, self.per_rank, self.size, self.rank, self.generator = n_images, per_rank, world_size, rank, generator

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        step = self.per_rank * self.size
        for start in range(0, self.n - step + 1, step):
            first = start + self.rank * self.per_rank
            yield order[first:first + self.per_rank]

    def __len__(self) -> int:
        return self.n // (self.per_rank * self.size)


def seeded_rank_loader(loader, world_size: int, rank: int):
    """`loader` (upstream's, shuffling, of this rank's batch size) re-made over `SeededItems` (each image augmented
    from the seed, the pass and its index), loading only this rank's share of each global batch (`RankBatches`;
    one process is the job of one rank, drawing its orders the same way): what `seeded_batches` reads."""
    items = SeededItems(loader.dataset)
    sampler = RankBatches(len(items), loader.batch_size, world_size, rank, loader.generator)
    return torch.utils.data.DataLoader(items, batch_sampler=sampler, num_workers=loader.num_workers,
                                       pin_memory=loader.pin_memory, collate_fn=loader.collate_fn,
                                       worker_init_fn=loader.worker_init_fn, generator=loader.generator)


class Batch(NamedTuple):
    images: torch.Tensor            # float 0-1 on the device
    targets: torch.Tensor           # upstream's [image, class, x, y, w, h]
    masks: torch.Tensor | None      # instance masks (segmentation data), else None
    paths: tuple[str, ...]          # the image files


def seeded_batches(loader, device: torch.device, n: int, seed: int) -> Iterator[Batch]:
    """`n` batches in an order and with augmentations that depend on `seed` only (over `SeededItems`, not on the
    workers or processes either): an epoch seeded by (run seed, epoch) is the same whether or not the run was
    interrupted and resumed before it, and a calibration sample is chosen by the run's seed. A pass over the images
    ends before `n` batches: the next pass has a new order and new augmentations."""
    return next(seeded_epochs(loader, device, n, [seed]))


def seeded_epochs(loader, device: torch.device, n: int, seeds: Sequence[int]) -> Iterator[Iterator[Batch]]:
    """For each of `seeds`, the batches `seeded_batches(loader, device, n, seed)` yields, all from one DataLoader:
    its workers start once, not once an epoch, and load the next epoch's first batches while this one ends and is
    evaluated. Each epoch's batches are to be taken whole before the next epoch's."""
    stream = _seeded_passes(loader, [(seed, n) for seed in seeds])
    for seed in seeds:
        yield _epoch(stream, n, seed, device)


def _epoch(stream: Iterator, n: int, seed: int, device: torch.device) -> Iterator[Batch]:
    """The next `n` batches of `stream` on `device`, this process's own draws seeded by `seed` when they start."""
    from utils.general import init_seeds
    init_seeds(seed, deterministic=False)  # draws in this process, outside the items
    for batch in itertools.islice(stream, n):
        masks = batch[4] if len(batch) > 4 else None
        yield Batch(batch[0].to(device, non_blocking=True).float() / 255, batch[1], masks, tuple(batch[2]))


def seeded_indices(loader, n: int, seed: int) -> list[list[int]]:
    """The dataset indices of the `n` batches `seeded_batches(loader, ..., n, seed)` yields, no image loaded: the
    same sampler over an index list, drawing from the same generator as the loader does (a sample whose record
    is lost is drawn again, e.g. for a peer calibrating on the same images)."""
    return list(_seeded_passes(loader, [(seed, n)], _Indices(loader.dataset), collate_fn=list))


class _Indices(SeededItems):
    """The positions of a seeded dataset's items, for drawing orders without loading them."""

    def __getitem__(self, key: tuple[int, int, int]) -> int:
        return key[-1]


class _PassKeys(torch.utils.data.Sampler):
    """The keys of the batches of `batches` for each (seed, n) of `segments`: its first `n` batches over as many
    passes as it takes, every order drawn from its generator seeded once by `seed`, each item keyed (seed, pass,
    index) so that each pass augments anew. One sampler spans the passes and the segments, so one set of workers
    loads them all, without a restart and an empty pipeline at every pass."""

    def __init__(self, batches: torch.utils.data.Sampler, segments: Sequence[tuple[int, int]]):
        self.batches, self.segments = batches, segments

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        for seed, n in self.segments:
            yield from self._segment(seed, n)

    def _segment(self, seed: int, n: int) -> Iterator[list[tuple[int, int, int]]]:
        generator = self.batches.generator
        generator.manual_seed(seed)  # the order of every pass
        made, passes = 0, 0
        while made < n:
            # the draw a DataLoader takes for its workers' seeds when a pass starts one: with it, every pass's order
            # (and a calibration sample an earlier version recorded) is the one drawn when each pass had its loader
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            for batch in self.batches:
                yield [(seed, passes, i) for i in batch]
                made += 1
                if made == n:
                    return
            passes += 1

    def __len__(self) -> int:
        return sum(n for _, n in self.segments)


def _seeded_passes(loader, segments: Sequence[tuple[int, int]], items: SeededItems | None = None,
                   **settings) -> Iterator:
    """The batches of `loader`'s seeded items (or of `items` over them) for each (seed, n) of `segments`, all in
    one DataLoader of `loader`'s settings (or of `settings`)."""
    if not isinstance(loader.dataset, SeededItems):
        raise TypeError("seeded_batches reads a seeded_rank_loader (a plain loader's augmentations would depend on "
                        "its workers)")
    if len(loader) == 0:
        raise ValueError("the loader has no batch: fewer images than one batch")
    settings = settings or dict(num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                                collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn)
    keys = _PassKeys(loader.batch_sampler, segments)
    yield from torch.utils.data.DataLoader(loader.dataset if items is None else items, batch_sampler=keys,
                                           generator=loader.generator, **settings)
