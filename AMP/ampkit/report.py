"""``compare.py``'s report: read the runs' logs, write the table and the plot.

Plain Python (no torch import), so the parent process of a comparison stays light;
running the children is :mod:`ampkit.runner`'s.

- :func:`summarise_log` turns a run's ``log.jsonl`` into the report's numbers.
- :func:`parse_eval_output` reads ``correct/total = acc`` from an eval script.
- :func:`write_csv`, :func:`markdown_table`, :func:`write_markdown`,
  :func:`plot_results` write ``results.csv``, ``results.md``, ``results.png``.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

OK, FAILED, NOT_RUN, INTERRUPTED = "ok", "failed", "not run", "interrupted"


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
