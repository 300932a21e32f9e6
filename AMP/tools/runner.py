"""``compare.py``'s child processes: run one command, and say in one line why it failed.

Plain Python (no torch import):

- :func:`run_child` runs one command, passing its stdout/stderr (tqdm bars included)
  through to the terminal while keeping a copy, and measures its wall time and peak
  resident memory (``os.wait4``: the child's own rusage, not the running maximum over
  every child that ``RUSAGE_CHILDREN`` gives).
- :func:`failure_reason` finds the one line that says why a child failed (also through
  torchrun's multi-line failure banner).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence


# --------------------------------------------------------------------------- failures
# Lines no failure reason is in: rules drawn with = - * # _ ~, and tqdm bars.
_DECORATION = re.compile(r"^[\s=\-*#_~]*$")
_PROGRESS = re.compile(r"\d+%\|.*\|")
_ERROR_LINE = re.compile(r"(\berror\b|Error\b|Exception\b|Traceback|Killed|Segmentation fault)",
                         re.IGNORECASE)
_TORCHRUN_NOISE = ("ChildFailedError", "To enable traceback", "error_file", "elastic/errors",
                   "FAILED", "Root Cause", "Failures:", "<NO_OTHER_FAILURES>")


def failure_reason(stderr_text: str, returncode: Optional[int] = None, limit: int = 300) -> str:
    """The one line that says why a child failed.

    Prefers the last line that reads as an error (``prog: error: ...``,
    ``SomethingError: ...``), skipping tqdm bars and torchrun's failure banner
    (whose last line is a row of ``=``); else the last meaningful line; else the
    exit status.
    """
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", stderr_text or "")]
    lines = [ln for ln in lines if ln and not _DECORATION.match(ln) and not _PROGRESS.search(ln)
             and not ln.startswith("warnings.warn(")]
    useful = [ln for ln in lines if not any(n in ln for n in _TORCHRUN_NOISE)
              and not ln.startswith(("[rank", "W1", "W0", "I1", "I0"))]
    for line in reversed(useful):
        if _ERROR_LINE.search(line) and not line.startswith("Traceback"):
            return line[:limit]
    if returncode is not None and returncode < 0:
        return f"killed by signal {-returncode} (out of memory?)" if returncode == -9 else \
            f"killed by signal {-returncode}"
    for line in reversed(useful or lines):
        return line[:limit]
    return f"exit status {returncode}" if returncode is not None else "unknown failure"


# --------------------------------------------------------------------------- children
@dataclass
class ChildRun:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    # wait4's figure: the peak RSS of the child or of its largest descendant, not their sum.
    max_rss_mb: Optional[float]
    interrupted: bool = False


def _pump(src: IO[bytes], sinks: Sequence[IO[bytes]], keep: List[bytes], keep_max: int) -> None:
    size = 0
    fd = src.fileno()
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        for s in sinks:
            try:
                s.write(chunk)
                s.flush()
            except (OSError, ValueError):
                pass
        keep.append(chunk)
        size += len(chunk)
        while size > keep_max and len(keep) > 1:
            size -= len(keep.pop(0))
    src.close()


def _rss_mb(ru_maxrss: int) -> float:
    # ru_maxrss is in bytes on macOS, in KiB on Linux.
    return ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def run_child(cmd: Sequence[str], log_path: Optional[Path] = None, env: Optional[Dict] = None,
              cwd: Optional[Path] = None, echo: bool = True, keep_max: int = 1 << 20) -> ChildRun:
    """Run ``cmd``; its output passes through (``echo``) and is kept (last ``keep_max`` bytes)
    and written to ``log_path``. Ctrl-C is forwarded by the terminal to the child (same
    process group); the child is then waited for, so a training run can save first."""
    log = open(log_path, "wb") if log_path is not None else None
    out_sinks = [s for s in ((getattr(sys.stdout, "buffer", None) if echo else None), log)
                 if s is not None]
    err_sinks = [s for s in ((getattr(sys.stderr, "buffer", None) if echo else None), log)
                 if s is not None]
    out_keep: List[bytes] = []
    err_keep: List[bytes] = []
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=cwd)
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, out_sinks, out_keep, keep_max),
                              daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, err_sinks, err_keep, keep_max),
                              daemon=True)]
    for t in pumps:
        t.start()
    interrupted = False
    rss = None
    while True:
        try:
            if hasattr(os, "wait4"):
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
                rss = _rss_mb(usage.ru_maxrss)
            else:  # pragma: no cover - Windows
                proc.wait()
            break
        except KeyboardInterrupt:
            # A second Ctrl-C: the user will not wait for the child to save.
            if interrupted:
                proc.kill()
            interrupted = True
            print("\ncompare: interrupted; waiting for the running command to stop",
                  file=sys.stderr, flush=True)
        # The child was reaped already.
        except ChildProcessError:
            proc.wait()
            break
    wall = time.perf_counter() - t0
    for t in pumps:
        t.join(timeout=10)
    if log is not None:
        log.close()
    return ChildRun(returncode=proc.returncode,
                    stdout=b"".join(out_keep).decode("utf-8", "replace"),
                    stderr=b"".join(err_keep).decode("utf-8", "replace"),
                    wall_s=wall, max_rss_mb=rss, interrupted=interrupted)
