"""What `sys.executable` runs in a process forked by tests/preloaded_python.py: `python script args` handed to that
server over its socket (forked there, with this process's argv, working directory, umask, environment, SIGINT
disposition and standard streams), signals forwarded, and this process's exit status the child's. Anything a fork of
the server cannot be (interpreter options such as -c or -m, another environment, no server) runs with the real
interpreter. Started with `python -S`: the standard library only, in a few milliseconds."""
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


def main(python: str) -> None:
    args, path = sys.argv[1:], os.environ.get(SOCKET_VAR)
    if not args or args[0].startswith("-") or not path:
        _real(python)
    umask = os.umask(0)
    os.umask(umask)
    request = {"script": args[0], "args": args[1:], "cwd": os.getcwd(), "umask": umask, "env": dict(os.environ),
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
