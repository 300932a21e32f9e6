"""Bookkeeping of ``compare.py``: run children, read their logs, write the report.

Everything here is plain Python (no torch import), so the parent process of a
comparison stays light and these helpers are unit-testable on their own:

- :func:`run_child` runs one command, passing its stdout/stderr (tqdm bars
  included) through to the terminal while keeping a copy, and measures its wall
  time and peak resident memory (``os.wait4``: the child's own rusage, not the
  running maximum over every child that ``RUSAGE_CHILDREN`` gives).
- :func:`summarise_log` turns a run's ``log.jsonl`` into the report's numbers.
- :func:`parse_eval_output` reads ``correct/total = acc`` from an eval script.
- :func:`failure_reason` finds the one line that says why a child failed
  (also through torchrun's multi-line failure banner).
- :func:`write_csv`, :func:`markdown_table`, :func:`write_markdown`,
  :func:`plot_results` write ``results.csv``, ``results.md``, ``results.png``.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence

OK, FAILED, NOT_RUN = "ok", "failed", "not run"


# --------------------------------------------------------------------------- results
@dataclass
class VariantResult:
    variant: str
    parallel: str
    precision: str
    amp_dtype: str                 # "" for the fp32 variants
    device: str                    # "cpu" or "cuda"
    devices: int                   # GPUs (DP), processes (DDP) or 1
    epochs: Optional[int] = None   # epochs completed (rows of log.jsonl)
    wall_time_s: Optional[float] = None     # the training command, start to exit
    train_time_s: Optional[float] = None    # sum of train_time: no validation, IO, startup
    images_per_s: Optional[float] = None    # steady state, all devices together
    peak_mem_mb: Optional[float] = None
    peak_mem_source: str = ""      # "log" (peak_mem_mb in log.jsonl) or "rss" (measured here)
    best_val_acc: Optional[float] = None
    test_acc: Optional[float] = None
    test_correct: Optional[int] = None
    test_total: Optional[int] = None
    status: str = NOT_RUN
    reason: str = ""
    checkpoint: str = ""


CSV_COLUMNS = [f.name for f in dataclasses.fields(VariantResult)]


# --------------------------------------------------------------------------- log.jsonl
def read_log(path: Path) -> List[Dict]:
    """The rows of a ``log.jsonl`` (lines that are not JSON objects are skipped)."""
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return rows
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _numbers(rows: Sequence[Dict], key: str) -> List[float]:
    out = []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def steady_images_per_s(values: Sequence[float]) -> Optional[float]:
    """Median over the epochs after the first (warm-up, caches, cuDNN autotuning);
    the only epoch's figure when there is one."""
    values = list(values)
    if not values:
        return None
    return float(statistics.median(values[1:] if len(values) > 1 else values))


def summarise_log(rows: Sequence[Dict]) -> Dict[str, Optional[float]]:
    """epochs, train_time_s (sum of ``train_time``), images_per_s (steady state),
    best_val_acc and peak_mem_mb (max of ``peak_mem_mb`` when the rows have it)."""
    # A resumed run appends rows; keep the last row of each epoch.
    by_epoch: Dict[int, Dict] = {}
    for r in rows:
        if isinstance(r.get("epoch"), int):
            by_epoch[r["epoch"]] = r
    rows = [by_epoch[e] for e in sorted(by_epoch)]
    train = _numbers(rows, "train_time")
    acc = _numbers(rows, "val_acc")
    mem = _numbers(rows, "peak_mem_mb")
    return {"epochs": len(rows) or None,
            "train_time_s": sum(train) if train else None,
            "images_per_s": steady_images_per_s(_numbers(rows, "images_per_s")),
            "best_val_acc": max(acc) if acc else None,
            "peak_mem_mb": max(mem) if mem else None}


# --------------------------------------------------------------------------- eval output
_EVAL_RE = re.compile(r"(\d+)\s*/\s*(\d+)\s*=\s*([0-9]*\.?[0-9]+)\s*$")


def parse_eval_output(text: str) -> Optional[tuple]:
    """``(correct, total)`` from an eval script's ``top-1 accuracy ...: c/t = acc`` line."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
    preferred = [ln for ln in lines if "top-1 accuracy" in ln] or lines
    for line in reversed(preferred):
        m = _EVAL_RE.search(line)
        if m:
            correct, total = int(m.group(1)), int(m.group(2))
            if total > 0 and 0 <= correct <= total:
                return correct, total
    return None


# --------------------------------------------------------------------------- failures
_DECORATION = re.compile(r"^[\s=\-*#_~]*$")
_PROGRESS = re.compile(r"\d+%\|.*\|")                       # a tqdm bar
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
    max_rss_mb: Optional[float]  # peak RSS of the child or of its largest descendant
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
    return ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux


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
            if interrupted:  # a second Ctrl-C: stop the child now
                proc.kill()
            interrupted = True
            print("\ncompare: interrupted; waiting for the running command to stop",
                  file=sys.stderr, flush=True)
        except ChildProcessError:  # already reaped
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


# --------------------------------------------------------------------------- formatting
def format_seconds(s: Optional[float]) -> str:
    """``12.34`` -> ``12.3s``; ``1342`` -> ``22m22s``; ``4000`` -> ``1h06m40s``."""
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    s = int(round(s))
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def _num(v: Optional[float], digits: int = 3) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


def _acc(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.4f}"


MD_HEADER = ["variant", "parallel", "precision", "amp dtype", "devices", "epochs",
             "total wall time", "training time (no val)", "images/s (steady)",
             "peak memory (MB)", "best val acc", "test acc", "status"]


def markdown_rows(results: Sequence[VariantResult]) -> List[List[str]]:
    rows = []
    for r in results:
        mem = "-" if r.peak_mem_mb is None else (
            f"{r.peak_mem_mb:.0f}" + (" (RSS)" if r.peak_mem_source == "rss" else ""))
        status = r.status if r.status != FAILED else f"failed: {r.reason}"
        test = _acc(r.test_acc)
        if r.test_correct is not None:
            test += f" ({r.test_correct}/{r.test_total})"
        rows.append([r.variant, r.parallel, r.precision, r.amp_dtype or "-",
                     f"{r.devices} {r.device}", "-" if r.epochs is None else str(r.epochs),
                     format_seconds(r.wall_time_s), format_seconds(r.train_time_s),
                     _num(r.images_per_s), mem, _acc(r.best_val_acc), test,
                     status.replace("|", "\\|")])
    return rows


def markdown_table(results: Sequence[VariantResult]) -> str:
    rows = markdown_rows(results)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(MD_HEADER)]
    numeric = {4, 5, 6, 7, 8, 9, 10, 11}

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in numeric else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in numeric else ("-" * (w + 2))
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(MD_HEADER), sep] + [line(r) for r in rows])


def write_csv(results: Sequence[VariantResult], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in results:
            w.writerow({k: ("" if v is None else v) for k, v in dataclasses.asdict(r).items()})


def read_csv(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def write_markdown(results: Sequence[VariantResult], path: Path, *, title: str,
                   preamble: Sequence[str] = (), notes: Sequence[str] = ()) -> str:
    text = "\n".join([f"# {title}", ""] + list(preamble) + ["", markdown_table(results), ""]
                     + list(notes)) + "\n"
    Path(path).write_text(text, encoding="utf-8")
    return text


def plot_results(results: Sequence[VariantResult], path: Path, title: str = "") -> None:
    """Two panels, one bar group per variant: time (wall, training alone) and accuracy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.variant for r in results]
    y = list(range(len(results)))
    fig, (ax_t, ax_a) = plt.subplots(1, 2, figsize=(12, 0.55 * len(results) + 1.8), sharey=True)
    walls = [(r.wall_time_s or 0.0) if r.status == OK else 0.0 for r in results]
    unit, div = ("min", 60.0) if max(walls, default=0) >= 300 else ("s", 1.0)
    h = 0.38
    ax_t.barh([i - h / 2 for i in y], [w / div for w in walls], h, label="total wall time",
              color="#9ecae1")
    ax_t.barh([i + h / 2 for i in y],
              [(r.train_time_s or 0.0) / div if r.status == OK else 0.0 for r in results], h,
              label="training alone (no validation)", color="#3182bd")
    ax_t.set_xlabel(f"time ({unit})")
    ax_t.set_title("time per variant")
    ax_a.barh([i - h / 2 for i in y], [r.best_val_acc or 0.0 for r in results], h,
              label="best val acc", color="#a1d99b")
    ax_a.barh([i + h / 2 for i in y], [r.test_acc or 0.0 for r in results], h,
              label="test acc (eval script)", color="#31a354")
    ax_a.set_xlim(0, 1)
    ax_a.set_xlabel("top-1 accuracy")
    ax_a.set_title("accuracy per variant")
    for i, r in enumerate(results):
        if r.status != OK:
            for ax in (ax_t, ax_a):
                ax.text(0.01, i, r.status, transform=ax.get_yaxis_transform(), va="center",
                        color="#cb181d")
        elif r.test_acc is not None:
            ax_a.text(r.test_acc, i + h / 2, f" {r.test_acc:.3f}", va="center", fontsize=8)
    ax_t.set_yticks(y)
    ax_t.set_yticklabels(names)
    ax_t.invert_yaxis()
    for ax in (ax_t, ax_a):
        ax.legend(loc="best", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
