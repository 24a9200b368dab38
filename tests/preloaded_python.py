"""A Python that has already imported torch and the checkout's libraries, and forks a fresh process per script run.

Starting `python qat.py ...` on a 2-core CPU spends ~12 s importing (torch, torchvision and the torch._dynamo it
pulls in, upstream's utils, ours) before the first line of work and ~3 s tearing the interpreter down at exit. This
server pays the imports once per test worker and environment. Each request is a fork of it: a new process, with
nothing run in it but those imports, in which the script runs as `__main__` with its own argv, working directory,
sys.path[0], umask, stdin from /dev/null, stdout and stderr to files, and which exits as the interpreter exits after
a script (non-daemon threads joined, atexit handlers run; module teardown skipped). What it shares with its siblings
is only the state an import leaves; the RNGs that import seeds from the OS are seeded again per fork, as a new
interpreter would. tests/test_harness.py compares it with a fresh interpreter.

Protocol (one JSON line each way): the client writes {"script", "args", "cwd", "out", "err", "umask"}; the server
answers {"pid"} once the child runs and {"returncode"} when it ends (negative: killed by that signal, as
subprocess reports it). The environment is the server's own: the client starts one server per environment.

Invalidation: a server serves one environment (its start environment, less PYTEST_CURRENT_TEST) and the code of the
modules it preloaded at its start; the client (conftest.run_preloaded) starts a new one when the environment
differs, and none outlives a test session, in which the checkout is not edited.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import threading
import traceback

# What every CLI of the overlay imports first (the script's own imports then find them loaded).
PRELOAD = ("torch", "torchvision", "onnx", "utils.general", "models.yolo", "models.evaluate",
           "models.finetune", "models.quantize")


def _child(request: dict) -> int:
    """Runs one script as `python script args` would, in this freshly forked process; its exit code."""
    import random
    import numpy as np
    for fd, path in ((1, request["out"]), (2, request["err"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.umask(request["umask"])
    os.chdir(request["cwd"])
    random.seed()
    np.random.seed()
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as the interpreter puts a script's folder first
    try:
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
        return 1
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
    os._exit(code)


def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    # a fork copies only the calling thread: a lock another Python thread held would never be released in the
    # child. (`import torch` leaves one idle native thread, as in every process that forks DataLoader workers.)
    if threading.active_count() != 1:
        raise SystemExit(f"preloaded_python: {threading.active_count()} Python threads after the imports")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _exit(_child(request))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
