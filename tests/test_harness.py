"""The tests' warm python (conftest.python, tests/helpers/zygote.py) behaves as a fresh
interpreter does in what the other tests read: exit status, streams, signals, the
environment, argv and path, warning options, and the interpreter its children start."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

import conftest
from conftest import REAL_PYTHON, python

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("AMP_TESTS_ZYGOTE", "1") == "0",
                                 reason="AMP_TESTS_ZYGOTE=0: the tests use the real python")]

PROBE = r'''
import json, os, sys, warnings
mode = sys.argv[1]
if mode == "report":
    import torch
    warnings.warn("from the probe", DeprecationWarning)  # shown only in __main__ by default
    try:
        warnings.warn("made an error by PYTHONWARNINGS", UserWarning)
        raised = False
    except UserWarning:
        raised = True
    print(json.dumps({"raised": raised, "argv": sys.argv[1:], "cwd": os.getcwd(),
                      "path0": sys.path[0],
                      "env": os.environ.get("PROBE_VALUE"), "threads": torch.get_num_threads(),
                      "name": __name__}))
    print("to stderr", file=sys.stderr)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "message":
    sys.exit("a message")
elif mode == "raise":
    raise ValueError("boom")
elif mode == "interrupt":
    raise KeyboardInterrupt
elif mode == "wait":
    import signal, time
    signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(7)))
    print("waiting", flush=True)
    time.sleep(60)
elif mode == "family":  # a parent and its child, each saying once what it got
    import signal, subprocess, time
    role = sys.argv[2]
    def said(*a):
        sys.stdout.write(f"SIGTERM {role}\n")  # one write: the two share the pipe
        sys.stdout.flush()
        sys.exit(7)
    signal.signal(signal.SIGTERM, said)
    if role == "parent":
        child = subprocess.Popen([sys.executable, __file__, "family", "child"])
    print(f"waiting {role}", flush=True)
    time.sleep(60)
elif mode == "child":
    import subprocess
    sys.exit(subprocess.run([sys.executable, __file__, "exit", "5"]).returncode)
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


def _both(probe, *args, **kw):
    """(the real interpreter's result, the warm one's), from the same command line."""
    return [subprocess.run([exe, str(probe), *args], capture_output=True, text=True,
                           timeout=60, **kw) for exe in (REAL_PYTHON, python())]


@pytest.fixture(autouse=True)
def warm_python():
    python()
    why = conftest._ZYGOTE["why_not"]
    if why and "cannot be run" in why:  # the suite still passes, at the old ~10 minutes
        pytest.skip(f"{why}: every test pays for its imports")


def test_the_warm_python_is_in_use():
    assert python() != REAL_PYTHON, conftest._ZYGOTE["why_not"]


@pytest.mark.parametrize("args", [("exit", "3"), ("message",), ("raise",), ("interrupt",),
                                  ("child",)])
def test_exit_status_and_streams_are_a_fresh_interpreters(probe, args):
    real, warm = _both(probe, *args)
    assert warm.returncode == real.returncode
    assert warm.stdout == real.stdout
    assert warm.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:]
    assert ("Traceback" in warm.stderr) == ("Traceback" in real.stderr)


def test_argv_cwd_path_environment_and_warnings_are_the_callers(probe, tmp_path):
    env = dict(os.environ, PROBE_VALUE="42", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="error::UserWarning")
    real, warm = _both(probe, "report", "x y", cwd=tmp_path, env=env)
    assert warm.returncode == real.returncode == 0, warm.stderr
    assert warm.stdout == real.stdout  # argv, cwd, sys.path[0], env, threads, __main__
    assert '"raised": true' in warm.stdout
    assert "DeprecationWarning: from the probe" in warm.stderr
    assert warm.stderr.splitlines()[-1] == "to stderr"


def test_a_signal_reaches_the_run_and_its_status_comes_back(probe):
    proc = subprocess.Popen([python(), str(probe), "wait"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "waiting"
    proc.send_signal(signal.SIGTERM)
    assert proc.communicate(timeout=30)[0].strip() == "got SIGTERM"
    assert proc.returncode == 7


def _children(pid: int) -> set:
    return set(subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                              text=True).stdout.split())


def test_a_killed_client_takes_its_run_with_it(probe):
    proc = subprocess.Popen([python(), str(probe), "wait"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "waiting"
    server = conftest._ZYGOTE["proc"].pid
    runs = _children(server)
    assert runs, "the run is not a fork of the server"
    proc.kill()  # SIGKILL: the client cannot pass it on
    proc.wait()
    deadline = time.monotonic() + 10
    while runs & _children(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not runs & _children(server), "the run outlived its client"


def test_kill_job_signals_every_process_of_the_job_once(probe):
    proc = subprocess.Popen([python(), str(probe), "family", "parent"], stdout=subprocess.PIPE,
                            text=True)
    assert {proc.stdout.readline().strip() for _ in range(2)} == {"waiting parent",
                                                                  "waiting child"}
    runs, clients = conftest.job_processes(proc.pid)
    assert len(runs) == 2 and proc.pid in clients
    conftest.kill_job(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert sorted(out.split("\n")[:-1]) == ["SIGTERM child", "SIGTERM parent"], out
    assert proc.returncode == 7
