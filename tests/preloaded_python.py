"""A Python that has already imported torch and the checkout's libraries, and forks a fresh process per script run.

Starting `python qat.py ...` on a 2-core CPU spends ~12 s importing (torch, torchvision and the torch._dynamo it
pulls in, upstream's utils, ours) before the first line of work and ~3 s tearing the interpreter down at exit. This
server pays the imports once per test worker and environment. Each request is a fork of it: a new process, with
nothing run in it but those imports, in which the script runs as `__main__` with its own argv, working directory,
sys.path[0], umask and standard streams, and which exits as the interpreter exits after a script (non-daemon threads
joined, atexit handlers run; module teardown and the imports' own finalizers skipped). What it shares with its
siblings is only the state an import leaves, and the garbage collector's setting (settle_collector: the imports'
objects frozen out of its reach); the RNGs that import seeds from the OS are seeded again per fork, as a new
interpreter would. tests/test_harness.py compares it with a fresh interpreter.

Two ways in:
- the test process (conftest.run_preloaded, start_preloaded), one JSON line each way on the server's stdin and
  stdout: it writes {"script" (or "module"), "args", "cwd", "out", "err", "umask", "interruptible"} (stdin from
  /dev/null, stdout and stderr to those files; SIGINT raising KeyboardInterrupt if interruptible, else as in the
  server); the server answers {"pid"} once the child runs and {"returncode"} when it ends (negative: killed by that
  signal, as subprocess reports it).
- the scripts' own child processes: in a child, `sys.executable` is a launcher (tests/python_launcher.py) under
  the real interpreter's name, so what a script starts with sys.executable (the benchmark's steps, `-m` ones
  included) is forked here too. The launcher hands over its argv, working directory, umask, environment, SIGINT
  disposition and standard streams on a Unix socket, forwards signals and exits with the child's status. What a
  fork cannot be (other interpreter options such as -c, another environment) it runs with the real interpreter.

Two kinds of server: the default preloads the checkout too (PRELOAD); `--libraries` preloads only LIBRARIES, none of
which reads torchrun's per-rank variables at import (upstream's utils do: their RANK and LOCAL_RANK constants),
so its forks can be torchrun's agent and ranks (conftest.preloaded_torchrun).

Invalidation: a server serves one environment (its start environment, less PYTEST_CURRENT_TEST; a `--libraries`
server also any that differs from it only in RANK_VARIABLES, which its forks take over) and the code of the modules
it preloaded at its start; the client (conftest) starts a new one when the environment differs, and none outlives a
test session, in which the checkout is not edited. What torch read at import from OMP_NUM_THREADS (its thread count)
a fork sets again from its own environment (Served.threads_for).
"""
from __future__ import annotations

import array
import contextlib
import gc
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import sys
import tempfile
import threading
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path

from python_launcher import SOCKET_VAR  # where a child's launcher finds this server (tests/ is this script's folder)

# What every CLI of the overlay imports first (the script's own imports then find them loaded).
LIBRARIES = ("torch", "torchvision", "onnx")
PRELOAD = (*LIBRARIES, "utils.general", "models.yolo", "models.deployment.evaluate", "models.finetuning.finetune",
           "models.quantization.quantize")
# What torchrun sets for each agent and rank (torch.distributed.elastic's worker environment, PYTHON_EXEC its rank
# interpreter), beside the TORCHELASTIC_ ones.
RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                            "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHON_EXEC"})
REAL_PYTHON = sys.executable


def is_rank_variable(name: str) -> bool:
    return name in RANK_VARIABLES or name.startswith("TORCHELASTIC_")


@dataclass(frozen=True)
class Served:
    """What a server's forks can be: its environment after its imports, what those imports added to it (a fresh
    interpreter's imports add the same where the variable is unset: torch's inductor cache folder), whether it
    preloaded LIBRARIES only, and the OMP_NUM_THREADS its torch read at import (that of its start environment)."""
    env: dict
    added: dict
    libraries_only: bool
    threads_read: int | None

    def environment_for(self, env: dict) -> dict | None:
        """The environment a fresh interpreter started with `env` has after the preloaded imports, if a fork of
        this server is that interpreter (torch's thread count set as `threads_for` says); None if not."""
        if threads_var(env) is None and self.threads_read is not None:
            return None  # torch's own default count: what a fork cannot tell
        if not self.libraries_only:
            return env if env == self.env else None
        env = {**self.added, **env}
        keys = env.keys() | self.env.keys()
        return env if all(env.get(k) == self.env.get(k) for k in keys if not is_rank_variable(k)) else None

    def threads_for(self, env: dict) -> int | None:
        """The intra-op thread count that a fresh interpreter started with `env` gives torch at import, where it
        differs from this server's; None where they agree. The checkout's imports rewrite OMP_NUM_THREADS
        (upstream's utils.general: min(8, cores - 1)), so a script's environment, and its children's, can name
        another count than the one the server's torch read (the accuracy benchmark's test, its steps given two threads
        where they asked for one, several at once on two cores: 290 s against 46)."""
        wanted = threads_var(env)
        return None if wanted is None or wanted == self.threads_read else wanted


def threads_var(env: dict) -> int | None:
    """OMP_NUM_THREADS in `env` as torch reads it at import (a positive integer), else None."""
    value = env.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _main_file(request: dict) -> str:
    """The file that runs as __main__: the script, or the module (a package's __main__) as `python -m` finds it."""
    if "module" not in request:
        return os.path.abspath(request["script"])  # the interpreter's __main__.__file__, absolute since Python 3.9
    spec = importlib.util.find_spec(request["module"])
    if spec is not None and spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(request["module"] + ".__main__")
    if spec is None or spec.origin is None:
        raise SystemExit(f"{REAL_PYTHON}: No module named {request['module']}")
    return spec.origin


def _child(request: dict) -> int:
    """Runs one script as `python [-u] script args` (or `-m module`) would, in this freshly forked process (its
    standard streams already in place); its exit code."""
    import random
    import numpy as np
    os.umask(request["umask"])
    os.chdir(request["cwd"])
    if "env" in request:  # a launcher's: the server's but for what Served.environment_for lets differ
        os.environ.clear()
        os.environ.update(request["env"])
    if request.get("threads"):
        import torch
        torch.set_num_threads(request["threads"])
    if request.get("unbuffered"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    random.seed()
    np.random.seed()
    script = None
    try:
        if "module" in request:  # found, as the interpreter finds it, from the working directory first
            sys.path[0] = os.getcwd()
        script = _main_file(request)
        sys.argv = [script, *request["args"]]
        if "module" in request:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(script)  # as the interpreter puts a script's folder first
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # what the interpreter prints for an uncaught exception: from the script's frames on
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1  # the interpreter ends by the signal
    return 0


def _exit(code: int) -> None:
    """What the interpreter does at exit that a script can observe: wait for its non-daemon threads, run its atexit
    handlers, flush stdout and stderr. Not the teardown of every module after that (~3 s with torch loaded, in a
    fresh interpreter too), which writes nothing."""
    import atexit
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _streams(fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)


def _start(request: dict, fds: list[int], sigint) -> int:
    """Fork the child that runs `request` on standard streams `fds` (stdin, stdout, stderr); its pid."""
    pid = os.fork()
    if pid == 0:  # never returns: an exception here must not unwind into the server's loop in this copy of it
        try:
            _streams(fds)
            signal.signal(signal.SIGINT, sigint)
            code = _child(request)
        except BaseException:
            traceback.print_exc()
            code = 1
        _exit(code)
    for fd in fds:
        os.close(fd)
    return pid


def _from_file(request: dict) -> int:
    null = os.open(os.devnull, os.O_RDONLY)
    outs = [os.open(request[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for k in ("out", "err")]
    # Ctrl-C as in a terminal when asked: a suite started in the background (`cmd &`, nohup) starts this server with
    # SIGINT ignored, which its forks would inherit
    sigint = signal.default_int_handler if request["interruptible"] else signal.getsignal(signal.SIGINT)
    return _start(request, [null, *outs], sigint)


def _supervise(conn: socket.socket, served: Served) -> None:
    """In a fork of the server: one launcher's request. The script's child is forked from here; its status goes
    back on `conn`. A launcher that goes away (killed) takes the child with it, as a process's death takes itself."""
    msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * array.array("i").itemsize))
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    while not msg.endswith(b"\n"):  # one JSON line, perhaps in several reads
        chunk = conn.recv(1 << 20)
        if not chunk:  # the launcher went away before it asked
            os._exit(0)
        msg += chunk
    request = json.loads(msg)
    request["threads"] = served.threads_for(request["env"])
    request["env"] = served.environment_for(request["env"])
    if request["env"] is None or len(fds) != 3:
        conn.sendall(b'{"fallback": true}\n')
        os._exit(0)
    sigint = signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler
    pid = _start(request, list(fds), sigint)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            with contextlib.suppress(OSError):  # a launcher killed meanwhile hears nothing
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            os._exit(0)
        if select.select([conn], [], [], 0.05)[0] and launcher_gone(conn):
            os.kill(pid, signal.SIGKILL)


def launcher_gone(conn: socket.socket) -> bool:
    """Whether the launcher's end of a readable `conn` is closed. A launcher killed before it read the {"pid"}
    answer resets the connection instead of closing it (Linux, for a Unix socket closed with unread data)."""
    try:
        return not conn.recv(1)
    except ConnectionResetError:
        return True


def _launcher(folder: Path) -> Path:
    """An executable under the real interpreter's name that runs tests/python_launcher.py."""
    path = folder / Path(REAL_PYTHON).name
    path.write_text(f"#!{REAL_PYTHON} -S\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                    f"import python_launcher\npython_launcher.main({REAL_PYTHON!r})\n")
    path.chmod(0o755)
    return path


def settle_collector() -> None:
    """Once the imports are done: their objects (~500,000, alive for good) left out of the full garbage collections,
    which would traverse them all each time (~0.1-0.2 s a collection), and the youngest generation collected every
    10,000 allocations rather than 700, so that fewer short-lived objects reach the older ones (test_quantize.py:
    1.57 -> 0.69 s in the collector). Nothing a test asserts depends on when garbage is collected. Forks inherit
    both."""
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])


def skip_imports_finalizers() -> None:
    """The finalizers the imports registered (torch.library's, one per operator library: each unregisters its
    operators) not run at a fork's exit: teardown that writes nothing, as the module teardown that _exit skips. In a
    fork they cost 25 ms an exit (7 ms in the process that imported: unregistering writes the dispatcher's tables,
    whose pages a fork then copies). Those a script registers still run. (The finalizers are listed by weakref's
    registry, its only index of them.)"""
    for f in list(weakref.finalize._registry):
        f.atexit = False


def serve(libraries_only: bool) -> None:
    before = dict(os.environ)
    for name in LIBRARIES if libraries_only else PRELOAD:
        importlib.import_module(name)
    settle_collector()
    skip_imports_finalizers()
    # a fork copies only the calling thread: a lock another Python thread held would never be released in the
    # child. (`import torch` leaves one idle native thread, as in every process that forks DataLoader workers.)
    if threading.active_count() != 1:
        raise SystemExit(f"preloaded_python: {threading.active_count()} Python threads after the imports")
    folder = Path(tempfile.mkdtemp(prefix="preloaded-"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / "socket"))
    listener.listen()
    os.environ[SOCKET_VAR] = str(folder / "socket")
    served = Served(dict(os.environ), {k: v for k, v in os.environ.items() if k not in before and k != SOCKET_VAR},
                    libraries_only, threads_var(before))
    sys.executable = str(_launcher(folder))  # what the children start their own children with
    print(json.dumps({"ready": True, "launcher": sys.executable, "socket": os.environ[SOCKET_VAR]}), flush=True)
    waiting, supervisors = set(), set()  # the test process's children (answered when they end); launchers'
    try:
        while True:
            for pid in list(waiting):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    waiting.remove(pid)
                    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
            supervisors -= {pid for pid in supervisors if os.waitpid(pid, os.WNOHANG)[0]}
            ready = select.select([sys.stdin, listener], [], [], 0.05)[0]
            if sys.stdin in ready:
                line = sys.stdin.readline()
                if not line:
                    return
                pid = _from_file(json.loads(line))
                waiting.add(pid)
                print(json.dumps({"pid": pid}), flush=True)
            if listener in ready:
                conn, _ = listener.accept()
                pid = os.fork()
                if pid == 0:  # never returns (as above)
                    try:
                        listener.close()
                        _supervise(conn, served)
                    finally:
                        os._exit(0)
                supervisors.add(pid)
                conn.close()
    finally:
        listener.close()
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


if __name__ == "__main__":
    serve(sys.argv[1:] == ["--libraries"])
