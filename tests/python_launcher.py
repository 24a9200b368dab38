"""What `sys.executable` runs in a process forked by tests/preloaded_python.py: `python [-u] script args` or `python
[-u] -m module args` handed to that server over its socket (forked there, with this process's argv, working
directory, umask, environment, SIGINT disposition and standard streams), signals forwarded, and this process's exit
status the child's. Anything a fork of the server cannot be (other interpreter options such as -c, an environment
that differs in what is read at import, no server) runs with the real interpreter. Started with `python -S`: the
standard library only, in a few milliseconds."""
from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys

SOCKET_VAR = "PRELOADED_PYTHON_SOCKET"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _real(python: str):
    os.execv(python, [python, *sys.argv[1:]])


def _command(args: list[str]) -> dict | None:
    """The script or module to run, its arguments and whether -u was given; None for any other interpreter option
    (torchrun starts its ranks as `python -u script`, the benchmark's Model Optimizer steps as `python -m`)."""
    unbuffered = args[:1] == ["-u"]
    args = args[unbuffered:]
    if args[:1] == ["-m"] and len(args) > 1:
        return {"module": args[1], "args": args[2:], "unbuffered": unbuffered}
    if not args or args[0].startswith("-"):
        return None
    return {"script": args[0], "args": args[1:], "unbuffered": unbuffered}


def main(python: str) -> None:
    command, path = _command(sys.argv[1:]), os.environ.get(SOCKET_VAR)
    if command is None or not path:
        _real(python)
    umask = os.umask(0)
    os.umask(umask)
    request = {**command, "cwd": os.getcwd(), "umask": umask, "env": dict(os.environ),
               "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        conn.sendmsg([json.dumps(request).encode() + b"\n"],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        answers = conn.makefile()
        first = json.loads(answers.readline())
    except OSError:
        _real(python)
    if first.get("fallback"):
        _real(python)
    for sig in FORWARDED:
        signal.signal(sig, lambda received, _: os.kill(first["pid"], received))
    code = json.loads(answers.readline())["returncode"]
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)
