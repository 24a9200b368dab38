"""qat.py under torchrun on the CPU: 2 processes, gloo. Calibration statistics combined across ranks equal one
process's on the union of the same batches; a QAT run writes one report, from rank 0; resume checks the world."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CHECKOUT, IMGSZ, call_cli, free_port, preloaded_torchrun, run_preloaded

from models.quantization.calibration import HistogramCollector
from models.quantization.checkpoint import load_quantized_model
from models.quantization.quantize import named_quantizers

COMMON = ["--imgsz", IMGSZ, "--device", "cpu", "--workers", 0, "--seed", 3]


def _two_ranks(out: str) -> None:
    """This rank's part of each check below that needs two processes, in one process group (torchrun's: this file
    is its script, see the end): a rank spends seconds importing before it does anything, so the three share one
    pair of processes."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        _combine(rank, _chunks(), out)
        _search(rank, out)
        _step(rank, out)
    finally:
        dist.destroy_process_group()


def _chunks() -> list[torch.Tensor]:
    """The batches the histogram check combines: each a range of its own, one far wider than the others."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4000, generator=g) * s for s in (1.0, 0.5, 3.0, 1.2, 20.0)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list, object]:
    """The chunks the histogram check combines, and the folder each rank saved its results of _two_ranks in."""
    out = tmp_path_factory.mktemp("ranks")
    torchrun, env = _torchrun_env()
    r = subprocess.run([*torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), __file__, str(out)],
                       cwd=CHECKOUT, text=True, capture_output=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return _chunks(), out


def _combine(rank: int, chunks: list, out: str) -> None:
    from models.core.distributed import World
    from models.quantization.calibration import combine_statistics
    collector = HistogramCollector()
    for x in chunks[rank::2]:
        collector.collect(x)
    combine_statistics([collector], World(rank, 2, rank))
    np.savez(f"{out}/rank{rank}.npz", width=collector._width, hist=collector.hist.numpy(), max=collector.max)


def test_histograms_combined_across_ranks_equal_one_process(two_ranks):
    """Rank 0 takes batches 0, 2, 4, rank 1 batches 1, 3, each seeing other values first than one process does;
    the combined histograms equal one collector's over batches 0-4, bin for bin, including a batch whose range
    outgrows the others (bins merged) and ranks whose largest values differ."""
    chunks, out = two_ranks
    single = HistogramCollector()
    for x in chunks:
        single.collect(x)
    for rank in (0, 1):
        saved = np.load(out / f"rank{rank}.npz")
        assert float(saved["width"]) == single._width and float(saved["max"]) == single.max
        assert np.array_equal(saved["hist"], single.hist.numpy())
        combined = HistogramCollector()
        combined.set_state(torch.from_numpy(saved["hist"]), float(saved["width"]), float(saved["max"]))
        for method in ("max", "mse", "entropy", "percentile"):  # every range is a function of those counts
            assert float(combined.compute_amax(method)) == float(single.compute_amax(method)), method
    assert single.hist.sum() == 5 * 4000


def test_each_rank_loads_only_its_share_and_a_step_is_one_process_step(demo_data, monkeypatch, tmp_path):
    """Two ranks with 2 images each against one process with the global batch of 4, all seeded alike, with
    upstream's augmentation: each rank's loader produces only its own 2 images a step (no rank loads another's), and
    the two shares of every step are exactly the images of the one-process step, in order and pixel for pixel, though
    one process loads in 2 workers and the ranks in none (each item's augmentation is seeded by its index); a new pass
    over the images gets a new order and new augmentations, loaded by the same workers, as the next epoch is."""
    from models.core.task import DETECT
    from utils.batches import (SeededItems, load_data, load_hyp, seeded_batches, seeded_epochs, seeded_indices,
                               seeded_rank_loader)
    data, hyp = load_data(demo_data), load_hyp(CHECKOUT / "data" / "hyps" / "hyp.scratch-high.yaml")

    def loader(batch_size, workers):
        made, _ = DETECT.dataloader(data["train"], IMGSZ, batch_size, 32, augment=True, hyp=hyp, workers=workers,
                                    shuffle=True, close_mosaic=True)
        return made

    steps = 8  # 24 images: two passes of 6 steps of 4
    made = seeded_rank_loader(loader(4, 2), 1, 0)
    made.worker_init_fn = lambda worker: (tmp_path / f"worker-{os.getpid()}").touch()  # items seed themselves
    one = list(seeded_batches(made, torch.device("cpu"), steps, seed=7))
    assert len(list(tmp_path.glob("worker-*"))) == 2  # one set of workers loads both passes, no restart between
    # a run's epochs from one loader: each epoch's batches are its own seed's, and the workers start once
    eight = list(seeded_batches(made, torch.device("cpu"), 3, seed=8))
    for f in tmp_path.glob("worker-*"):
        f.unlink()
    run = [list(epoch) for epoch in seeded_epochs(made, torch.device("cpu"), 3, [7, 8])]
    assert len(list(tmp_path.glob("worker-*"))) == 2
    for epoch, alone in zip(run, (one[:3], eight)):
        assert [b.paths for b in epoch] == [b.paths for b in alone]
        assert all(torch.equal(b.images, a.images) for b, a in zip(epoch, alone))
    ranks = [list(seeded_batches(seeded_rank_loader(loader(2, 0), 2, r), torch.device("cpu"), steps, seed=7))
             for r in (0, 1)]
    assert [sum(len(b.paths) for b in shares) for shares in ranks] == [2 * steps, 2 * steps]  # each its share only
    assert [r0.paths + r1.paths for r0, r1 in zip(*ranks)] == [b.paths for b in one]
    assert not set(ranks[0][0].paths) & set(ranks[1][0].paths)
    # the same sample drawn again from the sampler alone, no image loaded (a calibration sample whose record is lost)
    made = seeded_rank_loader(loader(4, 2), 1, 0)
    files = made.dataset.im_files
    assert [tuple(files[i] for i in b) for b in seeded_indices(made, steps, seed=7)] == [b.paths for b in one]
    for r0, r1, b in zip(*ranks, one):
        assert torch.equal(torch.cat([r0.images, r1.images]), b.images)
    again = {p: im for b in one[6:] for p, im in zip(b.paths, b.images)}  # the second pass
    first = {p: im for b in one[:6] for p, im in zip(b.paths, b.images)}
    assert [b.paths for b in one[6:]] != [b.paths for b in one[:2]]
    assert not all(torch.equal(first[p], im) for p, im in again.items())
    with pytest.raises(TypeError, match="seeded_rank_loader"):  # a plain loader's augmentations follow its workers
        next(seeded_batches(loader(4, 0), torch.device("cpu"), 1, seed=7))
    # what each rank reads, not only what its batches hold: the items its loader fetches (mosaic partners aside)
    loaded = {0: [], 1: []}
    fetch = SeededItems.__getitem__
    for r in loaded:
        monkeypatch.setattr(SeededItems, "__getitem__",
                            lambda self, key, _r=r: loaded[_r].append(key[-1]) or fetch(self, key))
        share = list(seeded_batches(seeded_rank_loader(loader(2, 0), 2, r), torch.device("cpu"), steps, seed=7))
        files = loader(2, 0).dataset.im_files
        assert [files[i] for i in loaded[r]] == [p for b in share for p in b.paths]  # nothing fetched but its share
    for k in range(steps):
        assert not set(loaded[0][2 * k:2 * k + 2]) & set(loaded[1][2 * k:2 * k + 2])


def _torchrun_env() -> tuple[list[str], dict]:
    """torchrun, its agent and ranks forked from a preloaded Python (conftest.preloaded_torchrun), and their
    environment."""
    return preloaded_torchrun(dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                                   YOLOV9_QAT_DIST_TIMEOUT_MIN="5"))


def _torchrun(*args, cwd=CHECKOUT, timeout=900):
    torchrun, env = _torchrun_env()
    cmd = [*torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), str(CHECKOUT / "qat.py"),
           *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, text=True, capture_output=True, env=env, timeout=timeout)


def _qat(*args):
    """One process, with the thread count of each torchrun rank."""
    return run_preloaded([str(CHECKOUT / "qat.py"), *map(str, args)], CHECKOUT,
                         dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"), 900)


def _amax(weights):
    return {n: q.amax.detach().float().reshape(-1) for n, q in named_quantizers(load_quantized_model(weights))
            if q.amax is not None}


def test_cached_training_images_give_the_same_batches(demo_data, tmp_path):
    """`qat.py quantize --cache` (upstream's cache of decoded, resized images, in RAM or as .npy files beside the
    images) changes where the pixels come from, not what they are: the same seeded batches, augmentations included,
    over two passes. The disk cache writes into the dataset's folder: a copy here. The RAM it takes is what `auto`
    weighs, computed from the label cache's image sizes: it equals the decoded images' bytes."""
    import shutil
    from models.core.task import DETECT
    from models.pipeline import RunConfig, train_loader
    from utils.batches import decoded_bytes, load_data, load_hyp, seeded_batches
    copy = tmp_path / "data"
    shutil.copytree(demo_data.parent, copy)
    yaml_file = copy / demo_data.name
    yaml_file.write_text(yaml_file.read_text().replace(str(demo_data.parent), str(copy)))
    data, hyp = load_data(yaml_file), load_hyp(CHECKOUT / "data" / "hyps" / "hyp.scratch-high.yaml")
    cfg = RunConfig(weights="", data=str(yaml_file), hyp="", imgsz=int(IMGSZ), batch_size=4, workers=0)
    runs = {}
    for cache in (None, "ram", "disk"):
        loader = train_loader(DETECT, data, cfg, hyp, augment=True, cache=cache)
        assert all(im is not None for im in loader.dataset.dataset.ims) == (cache == "ram")  # decoded up front
        if cache == "ram":
            held = sum(im.nbytes for im in loader.dataset.dataset.ims)
            assert decoded_bytes(loader.dataset.shapes, int(IMGSZ)) == held
        runs[cache] = list(seeded_batches(loader, torch.device("cpu"), 8, seed=3))
    assert len(list(copy.rglob("*.npy"))) == len(loader.dataset)  # one per training image
    # what a run on a CUDA device weighs (the device's type is all it reads): the images' sizes from the label cache
    from dataclasses import replace
    from models.core.distributed import World
    from models.pipeline import Inputs, training_cache
    for processes, kept in ((2, "ram"), (10 ** 9, None)):  # 10**9 copies of even these images exceed any RAM
        inputs = Inputs(torch.device("cuda"), data, None, DETECT, None, world=World(local_size=processes))
        choice, why = training_cache(inputs, replace(cfg, cache="auto"))
        assert choice == kept and f"{processes} on this machine" in why, why
    for cache in ("ram", "disk"):
        for plain, cached in zip(runs[None], runs[cache]):
            assert plain.paths == cached.paths and torch.equal(plain.images, cached.images), cache
            assert torch.equal(plain.targets, cached.targets)


def test_cache_auto_keeps_images_in_ram_on_a_gpu_where_every_processs_copy_fits(tmp_path):
    """`--cache auto` (the default): in RAM on a CUDA device when this machine's processes' copies take at most half
    the free RAM; on a CPU, or when they do not fit, decoded at every draw, the log saying why; an explicit choice
    is kept as given, and the image sizes are read only where `auto` has to weigh them. The bytes it weighs are
    those of upstream's `load_image` for sizes whose resize is not a whole number of pixels, too."""
    import cv2
    from types import SimpleNamespace
    from utils.batches import cache_choice, decoded_bytes
    from utils.dataloaders import LoadImagesAndLabels
    sizes, files = [(1001, 500), (333, 777), (640, 480)], []
    for i, (w, h) in enumerate(sizes):
        files.append(str(tmp_path / f"{i}.png"))
        cv2.imwrite(files[-1], np.zeros((h, w, 3), np.uint8))
    loads = SimpleNamespace(ims=[None] * 3, im_files=files, npy_files=[tmp_path / "none.npy"] * 3, img_size=416,
                            augment=True)
    decoded = sum(LoadImagesAndLabels.load_image(loads, i)[0].nbytes for i in range(3))
    assert decoded_bytes(np.array(sizes), 416) == decoded
    gb, shapes = 1 << 30, lambda: np.array([[1280, 960]] * 1000)  # 0.86 GiB at 640 px: 640 x 480 x 3 each
    assert cache_choice("auto", True, 640, 1, shapes, available=2 * gb)[0] == "ram"
    none, why = cache_choice("auto", True, 640, 2, shapes, available=2 * gb)  # 1.7 of 2 GiB: more than half
    assert none is None and "more than half" in why and "2 on this machine" in why
    assert cache_choice("auto", True, 320, 2, shapes, available=2 * gb)[0] == "ram"  # a quarter of the bytes

    def unread():
        raise AssertionError("image sizes read for a choice that needs none")
    assert cache_choice("auto", False, 640, 1, unread)[0] is None
    assert [cache_choice(c, False, 640, 8, unread)[0] for c in ("ram", "disk", "off")] == ["ram", "disk", None]


def test_cache_from_the_command_line_changes_no_number(tiny_gelan_weights, demo_data, tmp_path):
    """`qat.py quantize --cache` (RAM: the flag alone) gives the run the cache and the same numbers as without it. The
    cache holds the fine-tuning loader's images only, so the epochs' losses are what it could change (a mechanism:
    the tiny GELAN)."""
    common = ["quantize", "--weights", tiny_gelan_weights, "--data", demo_data, *COMMON, "--batch-size", 4,
              "--calib-batches", 1, "--calib-method", "max", "--epochs", 1, "--iters", 2, "--no-eval-origin",
              "--project", tmp_path]
    for name, extra in (("plain", []), ("cached", ["--cache"])):
        r = _qat(*common, "--name", name, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
    plain, cached = (json.loads((tmp_path / k / "report.json").read_text()) for k in ("plain", "cached"))
    assert cached["config"]["cache"] == "ram" and plain["config"]["cache"] == "auto"
    assert cached["step"]["cache"] == "ram" and plain["step"]["cache"] is None  # auto: not on a CPU
    assert "not a CUDA device" in plain["step"]["cache_why"]
    assert [e["ap"] for e in cached["qat"]] == [e["ap"] for e in plain["qat"]] and cached["ptq"] == plain["ptq"]
    assert [e["loss"] for e in cached["qat"]] == [e["loss"] for e in plain["qat"]] and plain["qat"][0]["loss"] > 0


def test_two_process_calibration_equals_one_process(tiny_gelan_weights, demo_data, tmp_path):
    """2 gloo ranks, global batch 4 (2 per rank) and 2 calibration batches, against one process calibrating on the
    same images in batches of 4 (other batches than either rank's: before the histograms were made independent of
    batching, mse ranges of most quantizers differed, by up to 2.1 %). `auto` with every candidate saved: each
    one-rule range equal, except where the activations themselves differ: some CPUs' convolution kernels depend on
    the batch size (2 per rank vs 4) and change a value's last bits; one on a bin edge then lands in the next bin and
    moves a histogram range by one bin (seen on gelan-t: 3 of 336 quantizers). So a range may differ by at most one
    bin of its histogram (a power of two between 1/2048 and 1/1024 of the quantizer's maximum), for at most 5 % of
    the quantizers (headroom over the 1 % seen; a batching dependence moves most of them, by many bins: histograms
    sized by the first batch failed it). A mechanism: the tiny GELAN (every block type the quantizers meet)."""
    from models.quantization.calibration import bin_width
    from models.quantization.quantize import HISTOGRAM_CANDIDATES
    common = ["quantize", "--weights", tiny_gelan_weights, "--data", demo_data, *COMMON, "--epochs", 0,
              "--no-eval-origin", "--save-candidates", "--batch-size", 4, "--calib-batches", 2, "--project", tmp_path]
    r = _torchrun(*common, "--name", "two")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _qat(*common, "--name", "one")
    assert r.returncode == 0, r.stderr[-3000:]
    reports = {k: json.loads((tmp_path / k / "report.json").read_text()) for k in ("one", "two")}
    assert reports["two"]["world_size"] == 2 and reports["one"]["world_size"] == 1
    assert reports["two"]["calibration_images"] == reports["one"]["calibration_images"]  # the same images
    ranges = {k: {m: _amax(f["file"]) for m, f in reports[k]["calibration"]["saved"].items()} for k in reports}
    one, two = ranges["one"], ranges["two"]
    assert one.keys() == two.keys() == {*HISTOGRAM_CANDIDATES}
    names = list(one["max"])
    assert len(names) > 50 and all(one[m].keys() == two[m].keys() == set(names) for m in one)
    acts = [n for n in names if one["max"][n].numel() == 1]
    differ = set()
    for m in HISTOGRAM_CANDIDATES:
        for n in acts:
            delta = float((two[m][n] - one[m][n]).abs().max())
            if delta:
                differ.add(n)
                bin_ = bin_width(float(max(one["max"][n].max(), two["max"][n].max())), 2048)
                assert delta <= bin_ * (1 + 1e-6), (m, n, delta, bin_)
    print(f"{len(differ)} of {len(acts)} activation quantizers one bin apart, 2 processes vs 1")
    assert len(differ) <= 0.05 * len(acts), sorted(differ)
    assert all(torch.equal(one["max"][n], two["max"][n]) for n in names if n not in acts)  # weights: per channel


def test_two_process_run_with_modelopt_calibrates_as_one_process(tiny_gelan_weights, demo_data, tmp_path):
    """`--backend modelopt` under torchrun: Model Optimizer's quantizers collect into this project's histograms,
    combined across ranks as the default backend's are. `max` ranges from 2 ranks (2 images each) equal one process's
    (batches of 4) up to the last bits a batch-size-dependent convolution kernel changes (relative 1e-5: a float32
    ulp is 6e-8); weights bit for bit; a QAT epoch under DDP; the delivered model holds Model Optimizer's quantizers.
    A mechanism, not an accuracy: the tiny GELAN (every block type the quantizers meet)."""
    common = ["quantize", "--backend", "modelopt", "--weights", tiny_gelan_weights, "--data", demo_data, *COMMON,
              "--batch-size", 4, "--calib-batches", 2, "--calib-method", "max", "--epochs", 1, "--iters", 2,
              "--no-eval-origin", "--project", tmp_path]
    r = _torchrun(*common, "--name", "two")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _qat(*common, "--name", "one")
    assert r.returncode == 0, r.stderr[-3000:]
    reports = {k: json.loads((tmp_path / k / "report.json").read_text()) for k in ("one", "two")}
    assert reports["two"]["world_size"] == 2 and reports["two"]["config"]["quant"]["backend"] == "modelopt"
    assert reports["two"]["calibration_images"] == reports["one"]["calibration_images"]
    assert [e["epoch"] for e in reports["two"]["qat"]] == [1]
    one, two = (_amax(reports[k]["ptq_file"]) for k in ("one", "two"))
    assert one.keys() == two.keys() and len(one) > 60  # every range of the tiny GELAN (63)
    acts = [n for n in one if one[n].numel() == 1]
    rel = max(float(((two[n] - one[n]) / one[n]).abs()) for n in acts)
    print(f"max ranges, 2 processes vs 1: largest relative difference {rel:.1e} over {len(acts)} activations")
    assert rel <= 1e-5
    assert all(torch.equal(two[n], one[n]) for n in one if n not in acts)
    delivered = load_quantized_model(reports["two"]["final"]["file"])
    assert {q.backend_name for _, q in named_quantizers(delivered)} == {"modelopt"}


def _search(rank: int, out: str) -> None:
    """`per-quantizer` calibration of the tiny GELAN (its first layers: a search costs a pass per quantizer and
    candidate) on 2 gloo ranks, each its own share of two global batches, rank 1's model other than rank 0's (its
    own search would choose otherwise); what each rank ends with saved."""
    from conftest import build_model, tiny_gelan

    from models.core.distributed import World
    from models.quantization.quantize import QuantRecipe, calibrate, named_quantizers, quantize_model
    recipe = QuantRecipe(calib_method="per-quantizer", skip=(r"^model\.([4-9]|\d\d)\.",))
    model = quantize_model(build_model(tiny_gelan(12), seed=rank).fuse(), recipe)
    shares = [torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(10 * b + rank)) for b in range(2)]
    stats = calibrate(model, recipe, shares, World(rank, 2, rank))
    torch.save({"images": stats.images, "methods": stats.per_quantizer, "shares": shares,
                "amax": {n: q.amax.clone() for n, q in named_quantizers(model, activations_only=True)}},
               f"{out}/search{rank}.pt")


def test_per_quantizer_ranges_are_searched_once_and_held_by_every_rank(two_ranks):
    """Rank 0 searches on the first calibration images in one process's order (each global batch: rank 0's share,
    then rank 1's) and broadcasts: both ranks end with the same choice and the same ranges, bit for bit, though
    rank 1's model differs."""
    runs = [torch.load(two_ranks[1] / f"search{r}.pt") for r in (0, 1)]
    order = torch.cat([torch.cat([runs[0]["shares"][b], runs[1]["shares"][b]]) for b in range(2)])
    assert torch.equal(runs[0]["images"], order) and torch.equal(runs[1]["images"], order)
    assert len(runs[0]["methods"]) > 3 and runs[0]["methods"] == runs[1]["methods"]
    assert all(torch.equal(a, runs[1]["amax"][n]) for n, a in runs[0]["amax"].items())


def test_two_process_qat_writes_one_report_and_resume_checks_the_world(demo_data, demo_data320, tmp_path,
                                                                       monkeypatch):
    """With a mixed-precision budget too: rank 0 chooses the tensor classes kept in float on select, every rank
    applies the choice it broadcasts (a rank without it fails the job), and the delivered model holds it."""
    from conftest import REDUCED_SIZE, TRAINED_T
    # test_mixed_precision's max-loss run: max ranges from one batch lose on select, and single tensor classes in
    # float win some of it back, so rank 0 chooses a set that is not empty (at 160 px, or with ranges clipped far
    # below, no single class gains and the empty choice would prove nothing)
    r = _torchrun("quantize", "--weights", TRAINED_T, "--data", demo_data320, "--imgsz", REDUCED_SIZE, *COMMON[2:],
                  "--batch-size", 2, "--num-image", 16, "--calib-batches", 1, "--calib-method", "max", "--epochs", 2,
                  "--iters", 2, "--max-loss", 0, "--project", tmp_path, "--name", "run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # one folder: rank 1 made none of its own
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["finished"] and report["world_size"] == 2 and [e["epoch"] for e in report["qat"]] == [1, 2]
    mixed = report["mixed_precision"]
    assert mixed["measured"] and mixed["origin_select"] > mixed["all_int8_select"] and mixed["kept_float"]
    delivered = load_quantized_model(report["final"]["file"])
    assert {n for n, q in named_quantizers(delivered, activations_only=True) if q._disabled} == \
        {c["name"] for c in mixed["kept_float"]}
    assert r.stdout.count("results saved to") + r.stderr.count("results saved to") == 1  # rank 0 alone reports
    report["finished"] = False  # as if the job had been stopped
    (tmp_path / "run" / "report.json").write_text(json.dumps(report))
    r = call_cli("qat.py", "quantize", "--resume", tmp_path / "run", "--device", "cpu")
    assert r.returncode == 2 and "started on 2 process(es)" in r.stderr and "--nproc_per_node 2" in r.stderr
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):  # what torchrun gives each rank
        monkeypatch.setenv(name, value)
    r = call_cli("qat.py", "eval", "--weights", report["qat_best_file"], "--data", demo_data, *COMMON)
    assert r.returncode != 0 and "runs in one process" in r.stderr


def _step(rank: int, out: str) -> None:
    """One training step of a calibrated quantized tiny GELAN under DDP's default (every buffer broadcast before every
    forward) and under the student's wrapper, from the same weights: each rank its own images; the loss and the
    averaged gradients of both saved."""
    import copy

    from conftest import build_model, tiny_gelan
    from torch.nn.parallel import DistributedDataParallel

    from models.core.distributed import World, data_parallel
    from models.quantization.quantize import QuantRecipe, calibrate, quantize_model
    torch.manual_seed(0)
    model = quantize_model(build_model(tiny_gelan(12)).fuse())
    calibrate(model, QuantRecipe(calib_method="max"), [torch.rand(2, 3, 64, 64, generator=torch.Generator()
                                                                  .manual_seed(1))])
    model.train()
    if rank == 1:  # rank 1's ranges start elsewhere: only a broadcast makes them rank 0's
        for name, buf in model.named_buffers():
            if name.endswith("_amax"):
                buf.mul_(1.25)
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(10 + rank))
    runs = {}
    for name, wrap in (("default", DistributedDataParallel),
                       ("ours", lambda m: data_parallel(m, World(rank, 2, rank), torch.device("cpu")))):
        student = copy.deepcopy(model)
        ddp = wrap(student)
        wrapped = {n: b.clone() for n, b in student.named_buffers() if n.endswith("_amax")}
        loss = sum(p.float().square().mean() for p in ddp(x))
        loss.backward()
        runs[name] = {"loss": loss.detach(), "broadcast": ddp.broadcast_buffers, "wrapped": wrapped,
                      "after": {n: b.clone() for n, b in student.named_buffers() if n.endswith("_amax")},
                      "grads": {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}}
    torch.save(runs, f"{out}/step{rank}.pt")


def test_a_step_without_per_step_buffer_broadcast_equals_ddps_default(two_ranks):
    """The student's wrapper broadcasts its buffers (the quantizers' ranges) once, when it wraps, not before every
    step: rank 1, whose ranges started a quarter wider, holds rank 0's from the wrap on and after the step (a range
    that drifted apart would show here), and a step's loss and averaged gradients equal DDP's default, which
    broadcasts them each time (the same sums in the same order: equal within float rounding on any CPU)."""
    runs = [torch.load(two_ranks[1] / f"step{r}.pt") for r in (0, 1)]
    assert [(r["ours"]["broadcast"], r["default"]["broadcast"]) for r in runs] == [(False, True)] * 2
    ranges = runs[0]["ours"]["wrapped"]
    assert len(ranges) > 60  # every range of the tiny GELAN (63)
    for when in ("wrapped", "after"):
        assert all(torch.equal(runs[1]["ours"][when][n], a) for n, a in ranges.items()), when
        assert all(torch.equal(runs[0]["ours"][when][n], a) for n, a in ranges.items()), when
    for r in runs:
        ours, default = r["ours"], r["default"]
        assert torch.allclose(ours["loss"], default["loss"], rtol=1e-6)
        assert ours["grads"].keys() == default["grads"].keys() and len(ours["grads"]) > 50
        for name, g in ours["grads"].items():
            assert torch.allclose(g, default["grads"][name], rtol=1e-5, atol=1e-7), name
    # gradients were averaged over the ranks (each saw its own images): both ranks hold the same
    assert all(torch.equal(g, runs[1]["ours"]["grads"][n]) for n, g in runs[0]["ours"]["grads"].items())


def _node(node_rank: int, endpoint: str, log: Path, *args) -> subprocess.Popen:
    """One of two torchrun agents ("nodes" on this machine), one process each, meeting at a c10d rendezvous; its
    output to `log` (a pipe read after the other agent could fill up and stall the job)."""
    torchrun, env = _torchrun_env()
    cmd = [*torchrun, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node_rank), "--rdzv_backend",
           "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", "qat-nodes", str(CHECKOUT / "qat.py"), *map(str, args)]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=CHECKOUT, text=True, stdout=f, stderr=subprocess.STDOUT, env=env)


def _two_nodes(logs: Path, *args) -> list[tuple[int, str]]:
    """Both agents' exit codes and output."""
    endpoint = f"127.0.0.1:{free_port()}"
    logs.mkdir(parents=True, exist_ok=True)
    agents = [_node(k, endpoint, logs / f"node{k}.log", *args) for k in (0, 1)]
    codes = [a.wait(timeout=900) for a in agents]
    return [(rc, (logs / f"node{k}.log").read_text()) for k, rc in enumerate(codes)]


def test_two_nodes_run_as_one_job_and_resume(tiny_gelan_weights, demo_data, tmp_path):
    """`torchrun --nnodes 2` across machines, as two agents here (c10d rendezvous, gloo): global ranks 0 and 1, each
    local rank 0, one job: one report and one set of checkpoints (rank 0's), written once; stopped, the job resumes
    on two nodes again to the end, and on one process is refused with the command that fits."""
    args = ["quantize", "--weights", tiny_gelan_weights, "--data", demo_data, *COMMON, "--batch-size", 2,
            "--calib-batches", 1, "--calib-method", "max", "--epochs", 2, "--iters", 1, "--num-image", 4,
            "--project", tmp_path, "--name", "run"]
    ran = _two_nodes(tmp_path.parent / f"{tmp_path.name}-logs" / "run", *args)
    assert [rc for rc, _ in ran] == [0, 0], ran[0][1][-3000:] + ran[1][1][-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["finished"] and report["world_size"] == 2 and [e["epoch"] for e in report["qat"]] == [1, 2]
    assert sum(out.count("results saved to") for _, out in ran) == 1  # global rank 0 alone reports
    report["finished"], report["qat"] = False, report["qat"][:1]  # as if stopped after the first epoch
    (tmp_path / "run" / "report.json").write_text(json.dumps(report))
    r = call_cli("qat.py", "quantize", "--resume", tmp_path / "run", "--device", "cpu")
    assert r.returncode == 2 and "--nnodes M --nproc_per_node 2/M" in r.stderr
    ran = _two_nodes(tmp_path.parent / f"{tmp_path.name}-logs" / "resume", "quantize", "--resume", tmp_path / "run",
                     "--device", "cpu")
    assert [rc for rc, _ in ran] == [0, 0], ran[0][1][-3000:] + ran[1][1][-3000:]
    resumed = json.loads((tmp_path / "run" / "report.json").read_text())
    assert resumed["finished"] and [e["epoch"] for e in resumed["qat"]] == [1, 2] and resumed["world_size"] == 2


if __name__ == "__main__":  # a rank of the two_ranks fixture, started by torchrun
    _two_ranks(sys.argv[1])
