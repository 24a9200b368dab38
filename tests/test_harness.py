"""The suite's way of starting a script (conftest.run_preloaded: a fork of a Python that has imported torch and the
checkout) against a fresh interpreter: what a script can observe of how it was started must be the same."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CHECKOUT, free_port, preloaded_torchrun, run_preloaded
from preloaded_python import LIBRARIES, Served, is_rank_variable, launcher_gone

INNER = r'''
import os, sys
open("made-inner.txt", "w").close()
print("inner argv", os.path.basename(sys.argv[0]), sys.argv[1:], "cwd", os.getcwd(),
      "umask", oct(os.stat("made-inner.txt").st_mode & 0o777), "path0", sys.path[0], "main", __name__,
      "file", globals().get("__file__"))
sys.exit(5)
'''
# The child that Ctrl-C interrupts: it says it is ready only once its main thread is on the sleep, so that the
# interrupt lands there in either way of starting it (when "ready" was written before the sleep, the interrupt could
# land inside that write, and the tracebacks differed by where).
SLEEPER = r'''
import linecache, sys, threading, time


def main_thread_line(main=threading.main_thread().ident):
    frame = sys._current_frames()[main]
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()


def ready_once_asleep():
    while main_thread_line() != "time.sleep(60)":
        time.sleep(0.01)
    open("ready", "w").close()


threading.Thread(target=ready_once_asleep, daemon=True).start()
time.sleep(60)
'''
# Each case: what the script does, observed through its output files, its exit code and what it printed.
SCRIPT = f"INNER = {INNER!r}\nSLEEPER = {SLEEPER!r}\n" + r'''
import atexit, os, sys, threading, time, weakref
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
if case == "atexit":  # a finalizer of an object alive at exit (the server's imports' do not run), and a handler
    class Alive: pass
    alive = Alive()
    weakref.finalize(alive, print, "finalizer ran", file=sys.stderr)
    atexit.register(lambda: print("atexit ran", file=sys.stderr))
if case == "thread":  # a non-daemon thread outlives the main one: the process waits for it
    threading.Thread(target=lambda: (time.sleep(0.5), open("thread.txt", "w").write("joined"))).start()
if case == "umask":
    open("made.txt", "w").close()
    print(oct(os.stat("made.txt").st_mode & 0o777))
if case.startswith("child") and case != "child interrupted":  # a process of its own, as the benchmark's steps
    import subprocess                                             # and torchrun's ranks are started
    open("inner.py", "w").write(INNER)
    options = {"child": [], "child -c": ["-c", INNER], "child -m": ["-m", "inner"], "child -u": ["-u"]}[case]
    cmd = [sys.executable, *options, *(["inner.py"] if case in ("child", "child -u") else []), "x"]
    with open("inner.txt", "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    print("inner exit", r.returncode, os.path.basename(sys.executable))
if case == "child interrupted":  # Ctrl-C reaches it through the process that started it
    import signal, subprocess
    open("inner.py", "w").write(SLEEPER)
    with open("inner.txt", "w") as out:
        p = subprocess.Popen([sys.executable, "inner.py"], stdout=out, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        while not os.path.exists("ready"):
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        print("inner exit", p.wait())
'''
CASES = ("exit", "message", "raise", "atexit", "thread", "umask", "plain", "child", "child -c", "child -m",
         "child -u", "child interrupted")


def _observed(r: subprocess.CompletedProcess, cwd) -> tuple:
    files = sorted((p.name, p.read_text().replace(str(cwd), "CWD")) for p in cwd.iterdir() if p.suffix == ".txt")
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
    printed = {"atexit": ["finalizer ran", "atexit ran"], "raise": ["ValueError: uncaught"]}.get(case, [])
    assert all(line in fresh[2] for line in printed)


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


def test_a_scripts_own_python_is_forked_from_the_server_and_dies_with_its_launcher(tmp_path):
    """What a forked script starts with sys.executable runs in a fork of the preloaded server (torch already
    imported: the time saved), and a SIGKILL of the process the script started (the launcher) ends that fork too."""
    script = tmp_path / "outer.py"
    script.write_text(r'''
import os, signal, subprocess, sys, time
open("inner.py", "w").write("import os, sys, time\nprint('torch' in sys.modules, flush=True)\n"
                            "open('pid', 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
p = subprocess.Popen([sys.executable, "inner.py"], stdout=subprocess.PIPE, text=True)
print("preloaded", p.stdout.readline().strip())
while not os.path.exists("pid") or not open("pid").read():
    time.sleep(0.05)
p.kill()
p.wait()
inner = int(open("pid").read())
for _ in range(100):
    try:
        os.kill(inner, 0)
    except ProcessLookupError:
        print("gone")
        break
    time.sleep(0.05)
''')
    r = run_preloaded([str(script)], tmp_path, dict(os.environ, PYTHONUNBUFFERED="1"), 60)
    assert (r.returncode, r.stdout) == (0, "preloaded True\ngone\n"), r.stderr


def test_torchruns_agent_and_ranks_are_forks_of_a_server_that_imported_only_libraries(tmp_path):
    """conftest.preloaded_torchrun: the agent (`-m torch.distributed.run`) and its ranks (`-u script`, torchrun's
    per-rank variables in their environment) are forks of a --libraries server (torch imported before the script
    ran, upstream's utils not), each rank with its own RANK. A server that preloaded the checkout starts such a rank
    with the real interpreter: upstream's utils read RANK at import."""
    rank = tmp_path / "rank.py"
    # one write() a line: two ranks share the pipe, and print's pieces interleaved ("rankrank 0 ...")
    rank.write_text("import os, sys\nos.write(1, f\"rank {os.environ['RANK']} {'torch' in sys.modules} "
                    "{'utils.general' in sys.modules}\\n\".encode())\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    torchrun, ranks_env = preloaded_torchrun(env)
    r = subprocess.run([*torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), str(rank)], cwd=tmp_path,
                       env=ranks_env, text=True, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("rank")) == \
        ["rank 0 True False", "rank 1 True False"]
    outer = tmp_path / "outer.py"
    outer.write_text("import os, subprocess, sys\n"
                     "subprocess.run([sys.executable, '-u', 'rank.py'], env=dict(os.environ, RANK='1'))\n")
    r = run_preloaded([str(outer)], tmp_path, env, 60)
    assert (r.returncode, r.stdout) == (0, "rank 1 False False\n"), r.stderr


def test_the_libraries_read_no_rank_variable_at_import():
    """What lets a --libraries server stand in for any rank: importing LIBRARIES in a fresh interpreter reads none of
    torchrun's per-rank variables (every read of os.environ recorded)."""
    code = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from preloaded_python import is_rank_variable
read = set()
class Recording(type(os.environ)):
    def __getitem__(self, key):
        if sys._getframe(1).f_code.co_name != "__iter__":  # not a walk over every variable (tqdm's)
            read.add(key)
        return super().__getitem__(key)
    def __contains__(self, key):
        read.add(key)
        return super().__contains__(key)
os.environ.__class__ = Recording
for name in {LIBRARIES!r}:
    __import__(name)
print(sorted(k for k in read if is_rank_variable(k)), len(read) > 0)
"""
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, RANK="1"), text=True, capture_output=True,
                       timeout=120)
    assert (r.returncode, r.stdout) == (0, "[] True\n"), r.stderr[-2000:]
    assert is_rank_variable("LOCAL_RANK") and is_rank_variable("TORCHELASTIC_RUN_ID")


def test_a_fork_runs_torch_on_the_threads_its_environment_names_not_the_servers():
    """A server preloaded the checkout with OMP_NUM_THREADS=2; upstream's utils.general rewrote it to 1, so a
    script's child asks for an environment naming 1, which a fresh interpreter's torch would read at import: the
    fork gets 1 thread, and an environment naming none (torch's own default) is not served by a fork."""
    served = Served({"OMP_NUM_THREADS": "1", "A": "a"}, {}, libraries_only=False, threads_read=2)
    asked = {"OMP_NUM_THREADS": "1", "A": "a"}
    assert served.environment_for(asked) == asked and served.threads_for(asked) == 1
    same = Served(asked, {}, libraries_only=False, threads_read=1)
    assert same.environment_for(asked) == asked and same.threads_for(asked) is None
    read_two = Served({"A": "a"}, {}, libraries_only=False, threads_read=2)  # the checkout's imports removed it
    assert read_two.environment_for({"A": "a"}) is None
    assert same.environment_for({"A": "a", "OMP_NUM_THREADS": "x"}) is None
    unset = Served({"A": "a"}, {}, libraries_only=True, threads_read=None)
    assert unset.environment_for({"A": "a"}) == {"A": "a"} and unset.threads_for({"A": "a"}) is None
    assert unset.threads_for({"A": "a", "OMP_NUM_THREADS": "3"}) == 3


@pytest.mark.parametrize("unread", [b"", b'{"pid": 1}\n'], ids=["read its answer", "killed before reading it"])
def test_a_launcher_that_went_away_is_gone_whether_or_not_it_read_its_answer(unread):
    """The race the test above can lose on a loaded machine: the script kills its child's launcher before the
    launcher has read the {"pid"} answer; the connection is then reset, not closed, and the fork must die all the same."""
    supervisor, launcher = socket.socketpair()
    supervisor.sendall(unread)
    launcher.close()
    assert launcher_gone(supervisor)
