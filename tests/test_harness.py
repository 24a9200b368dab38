"""The suite's way of starting a script (conftest.run_preloaded: a fork of a Python that has imported torch and the
checkout) against a fresh interpreter: what a script can observe of how it was started must be the same."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import CHECKOUT, run_preloaded

# Each case: what the script does, observed through its output files, its exit code and what it printed.
SCRIPT = r'''
import atexit, os, sys, threading, time
case = sys.argv[1]
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0], "main", __name__, "file", __file__)
print("stdin", repr(sys.stdin.read()))
print("no newline at the end", end="")
if case == "exit":
    sys.exit(3)
if case == "message":
    sys.exit("a message instead of a code")
if case == "raise":
    raise ValueError("uncaught")
if case == "atexit":
    atexit.register(lambda: print("atexit ran", file=sys.stderr))
if case == "thread":  # a non-daemon thread outlives the main one: the process waits for it
    threading.Thread(target=lambda: (time.sleep(0.5), open("thread.txt", "w").write("joined"))).start()
if case == "umask":
    open("made.txt", "w").close()
    print(oct(os.stat("made.txt").st_mode & 0o777))
'''
CASES = ("exit", "message", "raise", "atexit", "thread", "umask", "plain")


def _observed(r: subprocess.CompletedProcess, cwd) -> tuple:
    files = sorted((p.name, p.read_text()) for p in cwd.iterdir() if p.suffix == ".txt")
    return r.returncode, r.stdout.replace(str(cwd), "CWD"), r.stderr, files


@pytest.mark.parametrize("case", CASES)
def test_a_preloaded_fork_runs_a_script_as_a_fresh_interpreter_does(case, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run_preloaded([str(script), "plain"], tmp_path, env, 60)  # the server, started (if not yet) under this umask
    old = os.umask(0o027)  # then another: each run takes its caller's
    try:
        results = []
        for name, start in (("fresh", lambda cwd: subprocess.run([sys.executable, str(script), case], cwd=cwd,
                                                                  env=env, text=True, capture_output=True,
                                                                  stdin=subprocess.DEVNULL, timeout=60)),
                            ("fork", lambda cwd: run_preloaded([str(script), case], cwd, env, 60))):
            cwd = tmp_path / name
            cwd.mkdir()
            r = start(cwd)
            results.append(_observed(r, cwd))
    finally:
        os.umask(old)
    fresh, fork = results
    assert fork == fresh
    assert fresh[0] == {"exit": 3, "message": 1, "raise": 1}.get(case, 0)
    assert {"atexit": "atexit ran", "raise": "ValueError: uncaught"}.get(case, "") in fresh[2]


def test_a_script_that_runs_past_its_timeout_is_killed(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_preloaded([str(script)], CHECKOUT, dict(os.environ, PYTHONUNBUFFERED="1"), 2)
    assert "started" in e.value.output
    quick = tmp_path / "quick.py"
    quick.write_text("print('next')\n")
    r = run_preloaded([str(quick)], CHECKOUT, dict(os.environ, PYTHONUNBUFFERED="1"), 60)  # the server goes on
    assert (r.returncode, r.stdout) == (0, "next\n")
