"""Fixtures: a real upstream YOLOv9 checkout (scripts/get_yolov9.sh) patched with this overlay, a small
generated dataset, and float checkpoints of real upstream models. Built once per session and cached
under tests/.cache (the checkout and the dataset are reused across sessions).

The suite runs in pytest-xdist workers (pytest.ini: `-n auto`, one test file per worker at a time), each with its
share of the cores for its math threads and those of the processes it starts."""
from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from python_launcher import SOCKET_VAR

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("YOLOV9_QAT_TEST_CACHE", REPO / "tests" / ".cache"))
CHECKOUT = CACHE / "yolov9"
IMGSZ = 160
MAX_WORKERS = 4  # each worker holds a few GB while its tests quantize and export
# Read before upstream's utils/general.py is imported: it sets OMP_NUM_THREADS for the processes started after it
# (cores - 1, up to 8) whatever runs beside them. More OpenMP threads than cores spin against each other (seen: a
# step 20x slower), so each worker takes its share, unless the caller chose a count.
THREADS = os.environ.get("OMP_NUM_THREADS") or str(
    max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def pytest_xdist_auto_num_workers(config) -> int:
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


# The files that take longest, longest first (pytest --durations on a 2-core CPU): xdist hands out whole files in
# collection order (pytest.ini: loadfile, not reordered), so these start first and the last minutes are not one
# long file on one core while the other waits. The rest follow in name order.
LONGEST_FIRST = ("test_upstream.py", "test_distributed.py", "test_segment.py", "test_mixed_precision.py",
                 "test_scripts.py", "test_export.py", "test_fast_step.py", "test_qat_cli.py", "test_val_trt.py",
                 "test_reparameterization.py", "test_quantize.py", "test_sensitive.py", "test_deploy.py",
                 "test_published.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), item.path.name))


def pytest_collection_finish(session) -> None:
    """The test modules' imports (torch, the checkout) are done: the collector set as in the preloaded Python."""
    from preloaded_python import settle_collector
    settle_collector()


@pytest.fixture(scope="session", autouse=True)
def cpu_share():
    import torch
    os.environ["OMP_NUM_THREADS"] = THREADS
    torch.set_num_threads(int(THREADS))


@pytest.fixture(scope="session", autouse=True)
def no_flops_count():
    """Upstream's Model() and fuse() end with a summary whose FLOPs thop counts on a deep copy of the model (0.1-0.5 s
    a model; ~9 s of the suite's models built in the test processes, and no test reads the figure): here the summary
    has none, as upstream prints it without thop. The scripts the tests run are other processes and count them."""
    from utils import torch_utils
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_utils, "thop", None)
        yield


def _run(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


@contextmanager
def _cache_lock():
    """One process at a time builds what the cache holds: every xdist worker imports this file."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build_checkout() -> Path:
    with _cache_lock():
        _run(["bash", str(REPO / "scripts" / "get_yolov9.sh"), str(CHECKOUT)])
        _run(["bash", str(REPO / "patch_yolov9.sh"), str(CHECKOUT)])
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
    return CHECKOUT


CHECKOUT_READY = _build_checkout()  # before test modules import models.* from the checkout


@pytest.fixture(scope="session")
def checkout() -> Path:
    return CHECKOUT_READY


def _demo(name: str, *args) -> Path:
    """A generated dataset under the cache (scripts/make_demo_dataset.py), made once."""
    out = CACHE / name
    with _cache_lock():
        if not (out / "data.yaml").is_file():
            _run([sys.executable, str(REPO / "scripts" / "make_demo_dataset.py"), "--out", str(out), *map(str, args),
                  "--exist-ok"])
    return out / "data.yaml"


@pytest.fixture(scope="session")
def demo_data() -> Path:
    """12-class generated dataset, 24 train / 12 val images at 160 px."""
    return _demo("demo160", "--train", 24, "--val", 12, "--imgsz", IMGSZ, "--seed", 3)


@pytest.fixture(scope="session")
def demo_data16() -> Path:
    """demo_data's distribution, 16 train / 8 val: the accuracy benchmark's (select, fit and val of 8 images each;
    its dozens of evaluations cost per image)."""
    return _demo("demo160-16", "--train", 16, "--val", 8, "--imgsz", IMGSZ, "--seed", 3)


@pytest.fixture(scope="session")
def demo_data320() -> Path:
    """The demo dataset's distribution at 320 px (what assets/gelan-t-demo.pt was trained on), new images: 16 train /
    40 val (the val images are measured again and again at 320 px: runtime tolerances are counted in boxes,
    one_box)."""
    return _demo("demo320-40", "--train", 16, "--val", 40, "--imgsz", 320, "--seed", 5)


@pytest.fixture(scope="session")
def seg_data() -> Path:
    """Outline polygons (what assets/gelan-t-seg-demo.pt was trained on), new images: 8 train / 40 val at 320 px
    (each segmentation evaluation costs ~0.3 s an image here, and the module runs about ten)."""
    return _demo("demoseg320-40", "--train", 8, "--val", 40, "--imgsz", 320, "--seed", 5, "--segments")


def one_box(data: dict) -> float:
    """The most one box can move mAP (or mAP50) on the val labels of `data` (load_data's dict): a box that crosses a
    ground-truth match or swaps rank with one moves its class's AP by up to 1 / (that class's boxes), and mAP by that
    over the classes; the rarest class bounds it. Tolerances between runtimes are counted in such boxes."""
    from collections import Counter
    labels = Path(str(data["val"]).replace("images", "labels"))
    boxes = Counter(int(line.split()[0]) for f in labels.glob("*.txt") for line in f.read_text().splitlines() if line)
    return 1 / (data["nc"] * min(boxes.values()))


def end2end_result(weights: Path, data: Path, size: int, tmp_path: Path, *export_args, batch: int = 4) -> dict:
    """val_trt.py's result for the end-to-end graph of a copy of `weights` exported at the evaluation's thresholds
    (0.001 / 0.7 / 300), at `batch`: what a test sets beside the plain graph's at the same batch."""
    import json
    import shutil
    e2e = tmp_path / "e2e.pt"
    shutil.copy(weights, e2e)
    r = run_cli("export_qat.py", "--weights", e2e, "--imgsz", size, "--dynamic", "--include", "onnx_end2end",
                "--conf-thres", 0.001, "--iou-thres", 0.7, "--topk-all", 300, *export_args)
    assert r.returncode == 0, r.stderr[-3000:]
    r = call_cli("val_trt.py", "--onnx-file", e2e.with_name("e2e-end2end.onnx"), "--data", data, "--imgsz", size,
                 "--batch-size", batch, "--workers", 0, "--project", tmp_path, "--name", "e2e")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((tmp_path / "e2e" / "val_trt.json").read_text())


def find_shared() -> Path | None:
    """The project's shared folder (reference documents, datasets): $YOLOV9_QAT_SHARED, a `shared/` beside the
    checkout or one of its parents, or beside the repository this checkout was cloned from (a fresh clone in a
    temp folder still finds the original's neighbour)."""
    candidates = [os.environ.get("YOLOV9_QAT_SHARED")] + [p / "shared" for p in REPO.parents]
    origin = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"], text=True,
                            capture_output=True).stdout.strip()
    if origin and "://" not in origin and not origin.startswith("git@"):
        candidates += [p / "shared" for p in Path(origin).resolve().parents]
    return next((Path(c) for c in candidates if c and (Path(c) / "reference").is_dir()), None)


SHARED = find_shared()
TRAINED_T = REPO / "assets" / "gelan-t-demo.pt"  # gelan-t trained on the demo dataset (H100, 60 epochs, 320 px)
# Where a test evaluates TRAINED_T over and over (an evaluation per tensor class): 3/5 of the size it was trained at
# still finds the shapes (float mAP50-95 on 100 images of the demo320 distribution: 0.19 at 192 px, 0.26 at 256, 0.14
# at 160) at 56 % of 256 px's cost
REDUCED_SIZE = 192


def build_model(cfg: str | dict, nc: int = 12, seed: int = 0):
    """A real upstream model from its yaml (a name in the checkout's models/, or a yaml dict such as tiny_gelan's),
    with BN running stats made non-trivial."""
    import torch
    from models.yolo import Model
    torch.manual_seed(seed)
    if isinstance(cfg, str):
        cfg = str(CHECKOUT / "models" / ("segment" if "seg" in cfg else "detect") / f"{cfg}.yaml")
    model = Model(cfg, nc=nc)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    model.names = [f"class{i}" for i in range(nc)]
    return model.eval()


class NothingHeld:
    """A runner without `held()`: models/deployment/evaluate.py then opens no block, and every batch quantizes every
    weight and computes every scale again from the model as it is (what an evaluation with no cache at all computes)."""

    def __init__(self, runner):
        self.runner = runner
        self.input_shape, self.task, self.output_names = runner.input_shape, runner.task, runner.output_names

    def __call__(self, images):
        return self.runner(images)


def tiny_gelan(nc: int, segment: bool = False) -> dict:
    """A model yaml with every block type GELAN models quantize (Conv, ELAN1 (gelan-t's), RepNCSPELAN4 with its
    residual adds, ADown, AConv, SPPELAN with its max pools, Upsample, Concat, DDetect) at the fewest layers: for what
    costs per layer (compiling: seconds a layer on a CPU; `qat.py sensitive`: an evaluation per tensor class; an ONNX
    trace), and for export structure, where upstream's GELANs only repeat these blocks wider and deeper. `segment`:
    with gelan-c-seg's head instead (Segment: DDetect's maps, mask coefficients, a prototype branch that upsamples)."""
    head = [[7, 4], 1, "Segment", ["nc", 8, 16]] if segment else [[7, 4], 1, "DDetect", ["nc"]]
    return {
        "nc": nc, "depth_multiple": 1.0, "width_multiple": 1.0, "anchors": 3,
        "backbone": [[-1, 1, "Conv", [16, 3, 2]], [-1, 1, "ADown", [32]], [-1, 1, "ELAN1", [32, 32, 16]],
                     [-1, 1, "AConv", [48]], [-1, 1, "SPPELAN", [48, 24]]],
        "head": [[-1, 1, "nn.Upsample", [None, 2, "nearest"]], [[-1, 2], 1, "Concat", [1]],
                 [-1, 1, "RepNCSPELAN4", [32, 32, 16, 1]], head],
    }


@pytest.fixture(scope="session")
def tiny_gelan_weights(tmp_path_factory) -> Path:
    """A float checkpoint of tiny_gelan(12) (the demo datasets' classes), untrained."""
    import torch
    import yaml
    from models.yolo import Model
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "tiny-gelan.yaml").write_text(yaml.safe_dump(tiny_gelan(12)))
    torch.manual_seed(0)
    model = Model(str(folder / "tiny-gelan.yaml"), nc=12)
    model.names = [f"class{i}" for i in range(12)]
    return save_float_checkpoint(model.eval(), folder / "tiny-gelan.pt")


def save_float_checkpoint(model, path: Path, **record) -> Path:
    """Saved the way upstream train.py saves (pickled model in FP16), with `record`'s entries (its `opt`, say)."""
    import copy
    import torch
    torch.save({"model": copy.deepcopy(model).half(), "epoch": -1, **record}, path)
    return path


@pytest.fixture(scope="session")
def gelan_t_weights(tmp_path_factory) -> Path:
    return save_float_checkpoint(build_model("gelan-t"), tmp_path_factory.mktemp("w") / "gelan-t-demo.pt")


class Started:
    """A script running in a fork of a PreloadedPython (its `start`), as a Popen is for a process of its own."""

    def __init__(self, server: PreloadedPython, cmd: list[str], pid: int, folder) -> None:
        self.server, self.cmd, self.pid, self.folder = server, cmd, pid, folder
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server._answer("returncode", 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Its exit code and what it printed; killed, and TimeoutExpired raised, past `timeout` seconds."""
        if self.returncode is None:
            self.returncode = self.server._answer("returncode", timeout)
        expired = self.returncode is None
        if expired:
            os.kill(self.pid, 9)
            self.returncode = self.server._answer("returncode")
        self.server.running = None
        out, err = Path(self.folder.name) / "out", Path(self.folder.name) / "err"
        printed = [path.read_text(errors="replace") if path.exists() else "" for path in (out, err)]
        self.folder.cleanup()
        if expired:
            raise subprocess.TimeoutExpired(self.cmd, timeout, *printed)
        return subprocess.CompletedProcess(self.cmd, self.returncode, *printed)


class PreloadedPython:
    """tests/preloaded_python.py, started once per environment in this worker: each run a fresh process forked from a
    Python that has imported torch and the checkout (~12 s a start saved, of ~100 starts in the suite)."""

    def __init__(self, env: dict, cwd: Path, libraries_only: bool = False):
        cmd = [sys.executable, str(REPO / "tests" / "preloaded_python.py")]
        if libraries_only:
            cmd.append("--libraries")
        self.server = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pending = b""  # what was read of the server's answers past the last whole line
        self.running: Started | None = None
        ready = self._line()
        self.launcher, self.socket = ready["launcher"], ready["socket"]  # for preloaded_torchrun

    def _answer(self, key: str, timeout: float | None = None):
        """The server's next line's `key`, or None if no line came within `timeout` seconds."""
        line = self._line(timeout)
        return None if line is None else line[key]

    def _line(self, timeout: float | None = None) -> dict | None:
        import select
        fd = self.server.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"preloaded_python ended (rc {self.server.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def start(self, cmd: list[str], cwd: Path, interruptible: bool = False) -> Started:
        """`cmd` (a script and its arguments, or "-m", a module and its arguments) started in a fork, not waited for.
        The server answers in the order its children end: one at a time."""
        import tempfile
        assert self.running is None, f"{self.running.cmd} still runs in this server"
        folder = tempfile.TemporaryDirectory()
        umask = os.umask(0)
        os.umask(umask)
        out, err = Path(folder.name) / "out", Path(folder.name) / "err"
        command = {"module": cmd[1], "args": cmd[2:]} if cmd[0] == "-m" else {"script": cmd[0], "args": cmd[1:]}
        request = {**command, "cwd": str(cwd), "out": str(out), "err": str(err), "umask": umask,
                   "interruptible": interruptible}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        self.running = Started(self, cmd, self._answer("pid"), folder)
        return self.running

    def run(self, cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        return self.start(cmd, cwd).wait(timeout)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait()


_PRELOADED: dict[tuple, PreloadedPython] = {}  # this worker's servers by environment, the last used last
KEEP_SERVERS = 3  # the session's environment, one test's own and a torchrun test's (~0.9 GB each)


def _server(env: dict, cwd: Path, libraries_only: bool = False) -> PreloadedPython:
    """The server for `env`, started if none is kept; the least recently used one closed to make room (the session's
    own environment, used by most tests, is not closed for a test's own: a start costs ~4 s)."""
    env = _served(env)
    key = (libraries_only, *sorted(env.items()))
    if key in _PRELOADED:
        _PRELOADED[key] = _PRELOADED.pop(key)
    else:
        while len(_PRELOADED) >= KEEP_SERVERS:
            _PRELOADED.pop(next(iter(_PRELOADED))).close()
        _PRELOADED[key] = PreloadedPython(env, cwd, libraries_only)
    return _PRELOADED[key]


def _served(env: dict) -> dict:
    # pytest names the running test in the environment: kept out, or every test would start its own server
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


def free_port() -> int:
    """A TCP port free on this machine now (torchrun's --master_port, a rendezvous endpoint)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preloaded_torchrun(env: dict) -> tuple[list[str], dict]:
    """`python -m torch.distributed.run` (torchrun) and the environment to run it with, `env` plus what forks it and
    its ranks from a preloaded Python that imported only the libraries (tests/preloaded_python.py --libraries: ~6 s
    saved per rank, its imports and interpreter teardown). Start it with subprocess, as many at once as needed."""
    server = _server(env, CHECKOUT, libraries_only=True)
    ranks_env = {**_served(env), SOCKET_VAR: server.socket, "PYTHON_EXEC": server.launcher}
    return [server.launcher, "-m", "torch.distributed.run", "--log-dir", _torchrun_logs()], ranks_env


@functools.cache
def _torchrun_logs() -> str:
    """torchrun's own folder (without --log-dir, every run leaves an empty torchelastic_* tree in the system's temporary
    folder): one for this worker's runs, removed when it exits."""
    folder = tempfile.mkdtemp(prefix="suite-torchrun-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def run_preloaded(cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python script args` (cmd: the script's path, then its arguments; or "-m", a module, its arguments) with
    `env`, in a new process forked from a preloaded Python started with that environment (tests/preloaded_python.py
    says what it shares with a fresh interpreter, which is only imports). PYTHONPATH in `env` picks the checkout
    whose modules it preloads."""
    return _server(env, cwd).run(cmd, cwd, timeout)


def cli_env() -> dict[str, str]:
    """A script's environment: this worker's thread share, which upstream's utils.general, once imported in this
    process, replaces in os.environ with min(8, cores - 1)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=THREADS)


def run_cli(script: str, *args, cwd: Path | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run a top-level script of the patched checkout as a user would, in a new process (run_preloaded)."""
    return run_preloaded([str(CHECKOUT / script), *map(str, args)], cwd or CHECKOUT, cli_env(), timeout)


def start_cli(script: str, *args) -> Started:
    """run_cli, not waited for; Ctrl-C (SIGINT) interrupts it as in a terminal, whatever the suite was started with."""
    return _server(cli_env(), CHECKOUT).start([str(CHECKOUT / script), *map(str, args)], CHECKOUT, interruptible=True)


def wait_for_file(folder: Path, glob: str, started: Started, timeout: float = 600) -> None:
    """Until a file matching `glob` is in `folder`; fails if `started` ends first."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(folder.glob(glob)):
            return
        if started.poll() is not None:
            raise AssertionError(f"run ended early: {started.wait().stderr[-2000:]}")
        time.sleep(0.2)
    with suppress(subprocess.TimeoutExpired):
        started.wait(0)  # killed, so that the server can serve the next test
    raise AssertionError(f"{glob} never appeared in {folder}")


def load_script(path: Path, name: str):
    """A script file as a module, registered before it runs (its dataclasses look their module up), with sys.path
    as it was: scripts/*.py put the working directory first, as they run from the checkout; here that is the repo
    root, whose reparameterization.py and models/ would shadow the checkout's for the rest of this worker."""
    import importlib.util
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def call_cli(script: str, *args) -> subprocess.CompletedProcess:
    """A top-level script's main(argv) in this process: the exit code and what it printed, as run_cli gives them,
    without starting a Python that imports torch again (~5 s each). For refusals, and for ONNX Runtime
    evaluations compared within a tolerance: a PyTorch run in this process does not reproduce a fresh process's
    numbers to the last digit (this process's torch state differs), and exports switch pytorch-quantization's
    export mode for the whole process. An exception that escapes main() fails the calling test, as a traceback
    would."""
    import contextlib
    import io
    import logging
    name = f"cli_{Path(script).stem}"
    module = sys.modules.get(name) or load_script(CHECKOUT / script, name)
    out, err = io.StringIO(), io.StringIO()
    # upstream's LOGGER holds the stderr of when it was made, which pytest's capture had replaced
    handlers = [h for h in logging.getLogger("yolov5").handlers if isinstance(h, logging.StreamHandler)]
    streams = [h.setStream(err) for h in handlers]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = module.main([str(a) for a in args])
            except SystemExit as e:  # argparse's errors
                code = e.code if isinstance(e.code, int) else 1
    finally:
        for h, stream in zip(handlers, streams):
            h.setStream(stream)
    return subprocess.CompletedProcess([script, *map(str, args)], code, out.getvalue(), err.getvalue())
