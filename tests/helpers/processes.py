"""The one way the tests start a process: a real, fresh interpreter (``PYTHON``) from the
repository root, in a session of its own, as a user's shell or a batch scheduler starts a job.

``start(cmd, env=None)`` -> ``subprocess.Popen``: pipes for stdout and stderr (text), the
    environment of :func:`script_env`. The job is registered so that a SIGTERM to pytest (a
    CI or ``timeout`` limit) kills it too: its own session also takes it out of the group
    that ``timeout`` signals.
``finish(proc, timeout)`` -> :class:`ScriptResult`: its exit status and output; past
    ``timeout`` (a hang: a rank waiting on a collective its peers skipped) the whole job is
    killed and the test fails with the output so far.
``run(cmd, env=None, timeout=)``: ``finish(start(cmd, env), timeout)``.
``run_script(name, *args, torchrun_nproc=None, env=None, timeout=)``: ``AMP/<name>.py`` under
    ``python``, or under torchrun with ``torchrun_nproc`` workers.
``torchrun(*args)``: the command line of ``python -m torch.distributed.run`` (``--standalone``
    picks a free rendezvous port: parallel runs never collide).
``kill_job(pid, sig)``: ``sig`` to the whole process group of a job started here (torchrun,
    its workers and their loader workers), as a scheduler signals one.
``wait_for(pred, timeout, proc=None)``: poll until ``pred()``; fails if ``proc`` ends first.
``children(pid)``: the living child processes of ``pid`` (a loader's workers, say);
    ``descendants(pid)``: all below it, whatever group they lead (what a hang's kill takes).
``clean_output(text)``: what a terminal finally shows on each line (the part after the last
    ``\\r``), blank lines and tqdm's bars dropped.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
AMP_DIR = REPO_ROOT / "AMP"
PYTHON = sys.executable
DEFAULT_TIMEOUT = 600  # seconds; generous: the test machine's 2 cores are shared

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def _show_our_deprecations() -> str:
    """A PYTHONWARNINGS value that shows (Pending)DeprecationWarnings raised on behalf of
    the project's own modules, which Python's default filters hide outside __main__
    (FutureWarning and UserWarning are shown by default anyway)."""
    modules = ["__main__", "alexnet"] + sorted(
        ".".join(p.relative_to(AMP_DIR).with_suffix("").parts).removesuffix(".__init__")
        for p in (AMP_DIR / "ampkit").rglob("*.py"))
    return ",".join(f"default::{cat}:{m}" for m in modules
                    for cat in ("DeprecationWarning", "PendingDeprecationWarning"))


def script_env(env: Optional[Dict[str, str]] = None, *, workers: bool = False) -> Dict[str, str]:
    """``os.environ`` without torchrun's variables (a test is never a rank), our deprecations
    shown, one thread a process for torchrun's ``workers`` (what torchrun sets anyway, with a
    warning), then ``env`` over it."""
    full = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    full.setdefault("PYTHONWARNINGS", _show_our_deprecations())
    if workers:
        full.setdefault("OMP_NUM_THREADS", "1")
    full.update(env or {})
    return full


def torchrun(*args) -> List[str]:
    return [PYTHON, "-m", "torch.distributed.run", *map(str, args)]


class ScriptResult(tuple):
    """``(returncode, stdout, stderr)`` (cleaned of tqdm redraws), plus the raw text."""

    def __new__(cls, returncode: int, raw_stdout: str, raw_stderr: str, cmd: List[str]):
        self = super().__new__(cls, (returncode, clean_output(raw_stdout),
                                     clean_output(raw_stderr)))
        self.raw_stdout, self.raw_stderr, self.cmd = raw_stdout, raw_stderr, cmd
        return self

    returncode = property(lambda self: self[0])
    stdout = property(lambda self: self[1])
    stderr = property(lambda self: self[2])

    def describe(self) -> str:
        """For assertion messages: the command, its exit status and its output."""
        return (f"$ {' '.join(self.cmd)}\nexit {self.returncode}\n--- stdout\n{self.stdout}"
                f"\n--- stderr\n{self.stderr}")


_TQDM_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+")


def clean_output(text: str) -> str:
    lines = []
    for line in text.split("\n"):
        shown = line.split("\r")[-1].rstrip()
        if shown.strip() and not _TQDM_BAR.search(shown):
            lines.append(shown)
    return "\n".join(lines)


_LIVE_GROUPS: set = set()  # the jobs running now, each the leader of its own group


def kill_live_jobs_then_die(signum, frame) -> None:
    """pytest's SIGTERM handler (conftest installs it): the jobs first, then pytest."""
    for pgid in list(_LIVE_GROUPS):
        for pid in descendants(pgid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def kill_job(pid: int, sig: int) -> None:
    """``sig`` to the job started as ``pid`` in a session of its own: its whole process
    group (torchrun and its workers, say); to ``pid`` alone if it leads no group."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def start(cmd: List, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env=script_env(env, workers="torch.distributed.run" in cmd))
    _LIVE_GROUPS.add(proc.pid)
    return proc


def finish(proc: subprocess.Popen, timeout: float = DEFAULT_TIMEOUT) -> ScriptResult:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Its descendants first: torchrun's workers lead groups of their own, and one left
        # alive would hold the pipes open.
        for pid in descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_job(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"no end after {timeout} s (a hang?): {' '.join(proc.args)}\n--- stdout\n"
                    f"{clean_output(out)[-3000:]}\n--- stderr\n{clean_output(err)[-3000:]}")
    finally:
        _LIVE_GROUPS.discard(proc.pid)
    return ScriptResult(proc.returncode, out, err, proc.args)


def run(cmd: List, env: Optional[Dict[str, str]] = None,
        timeout: float = DEFAULT_TIMEOUT) -> ScriptResult:
    return finish(start(cmd, env), timeout)


def run_script(name: str, *args, torchrun_nproc: Optional[int] = None,
               env: Optional[Dict[str, str]] = None,
               timeout: float = DEFAULT_TIMEOUT) -> ScriptResult:
    """``python AMP/<name>.py *args`` (``name`` with or without ``.py``), or with
    ``torchrun_nproc=N`` the same script under ``torchrun --standalone --nproc_per_node=N``."""
    script = f"AMP/{name if name.endswith('.py') else name + '.py'}"
    assert (REPO_ROOT / script).is_file(), f"no such script: {script}"
    cmd = ([PYTHON, script] if torchrun_nproc is None else
           torchrun("--standalone", f"--nproc_per_node={torchrun_nproc}", script))
    return run(cmd + list(args), env, timeout)


def wait_for(pred: Callable[[], bool], timeout: float,
             proc: Optional[subprocess.Popen] = None) -> None:
    """Poll ``pred()`` until it holds; the test fails if ``proc`` ends first or the time runs
    out (the job is then killed, and its output shown)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            end = finish(proc, 10)
            pytest.fail(f"the process ended early:\n{end.describe()[-3000:]}")
        if time.monotonic() > deadline:
            if proc is not None:
                kill_job(proc.pid, signal.SIGKILL)
                pytest.fail(f"timed out after {timeout} s:\n{finish(proc, 10).describe()[-3000:]}")
            pytest.fail(f"timed out after {timeout} s")
        time.sleep(0.05)


def descendants(pid: int) -> set:
    """The living processes below ``pid``, whatever group or session they lead."""
    found, frontier = set(), {pid}
    while frontier:
        frontier = set().union(*(children(p) for p in frontier)) - found
        found |= frontier
    return found


def children(pid: Optional[int] = None) -> set:
    """The living child processes of ``pid`` (default: this process), from /proc: their
    parent, zombies left out."""
    pid = os.getpid() if pid is None else pid
    kids = set()
    for entry in Path("/proc").iterdir():
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and int(parent) == pid and state != "Z":
            kids.add(int(entry.name))
    return kids
