"""``compare.py``'s report: read the runs' logs, write the table and the plot.

Plain Python (no torch import), so the parent process of a comparison stays light;
running the children is :mod:`ampkit.runner`'s.

- :func:`summarise_log` turns a run's ``log.jsonl`` into the report's numbers;
  :func:`accuracy_curve` into (epoch, cumulative training time, val accuracy) points.
- :func:`speedups` divides each variant's images/s by the fp32 single-device baseline's.
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
from typing import Dict, List, Optional, Sequence, Tuple

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
    peak_mem_per_rank: str = ""    # under torchrun: each rank's, "2133 / 1901" (log only)
    best_val_acc: Optional[float] = None
    test_acc: Optional[float] = None
    test_correct: Optional[int] = None
    test_total: Optional[int] = None
    status: str = NOT_RUN
    reason: str = ""
    checkpoint: str = ""
    seed: Optional[int] = None              # the run's --seed
    tflops: Optional[float] = None          # achieved TFLOP/s over the training loops
    utilisation: Optional[float] = None     # its share of the devices' peak, where known


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


def epoch_rows(rows: Sequence[Dict]) -> List[Dict]:
    """One row per epoch, in epoch order: a resumed run appends rows, and the last row
    of an epoch is the one that counts."""
    by_epoch: Dict[int, Dict] = {}
    for r in rows:
        if isinstance(r.get("epoch"), int) and not isinstance(r.get("epoch"), bool):
            by_epoch[r["epoch"]] = r
    return [by_epoch[e] for e in sorted(by_epoch)]


def _finite(v) -> Optional[float]:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def accuracy_curve(rows: Sequence[Dict]) -> List[Tuple[int, float, float]]:
    """``(epoch, cumulative training seconds, val_acc)`` for each epoch of a log.

    The time is the sum of ``train_time`` (the training loops alone: no validation, no
    checkpointing, no start-up) up to and including that epoch. The curve stops at the
    first epoch whose training time is unknown, or where an epoch is missing, since the
    time of every later point would then be wrong; an epoch without ``val_acc`` adds its
    time but no point.
    """
    points: List[Tuple[int, float, float]] = []
    total = 0.0
    for expected, r in enumerate(epoch_rows(rows), 1):
        seconds = _finite(r.get("train_time"))
        if r["epoch"] != expected or seconds is None:
            break
        total += seconds
        acc = _finite(r.get("val_acc"))
        if acc is not None:
            points.append((r["epoch"], total, acc))
    return points


def summarise_log(rows: Sequence[Dict]) -> Dict[str, Optional[float]]:
    """epochs, train_time_s (sum of ``train_time``), images_per_s (steady state),
    best_val_acc and peak_mem_mb (max of ``peak_mem_mb`` when the rows have it)."""
    rows = epoch_rows(rows)
    train = _numbers(rows, "train_time")
    acc = _numbers(rows, "val_acc")
    mem = _numbers(rows, "peak_mem_mb")
    return {"epochs": len(rows) or None,
            "train_time_s": sum(train) if train else None,
            "images_per_s": steady_images_per_s(_numbers(rows, "images_per_s")),
            "best_val_acc": max(acc) if acc else None,
            "peak_mem_mb": max(mem) if mem else None,
            "peak_mem_per_rank": _per_rank(rows), **_rates(rows)}


def _rates(rows: Sequence[Dict]) -> Dict[str, Optional[float]]:
    """The run's achieved TFLOP/s over its training loops (each epoch's weighted by its
    training time) and its share of the peak, from the epochs that logged them."""
    timed = [(t, r) for r in rows for t in [_finite(r.get("train_time"))]
             if t and _finite(r.get("tflops")) is not None]
    seconds = sum(t for t, _ in timed)
    if not seconds:
        return {"tflops": None, "utilisation": None}
    tflops = sum(t * r["tflops"] for t, r in timed) / seconds
    shares = [(t, _finite(r.get("utilisation"))) for t, r in timed]
    util = (sum(t * u for t, u in shares) / seconds
            if all(u is not None for _, u in shares) else None)
    return {"tflops": tflops, "utilisation": util}


def _per_rank(rows: Sequence[Dict]) -> str:
    """Each rank's largest ``peak_mem_mb_per_rank`` over the epochs, as "a / b"; "" for one."""
    lists = [r["peak_mem_mb_per_rank"] for r in rows
             if isinstance(r.get("peak_mem_mb_per_rank"), list) and r["peak_mem_mb_per_rank"]]
    if not lists or len(lists[0]) < 2:
        return ""
    return " / ".join(f"{max(col):.0f}" for col in zip(*lists))


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
             "peak memory (MB, per rank)", "TFLOP/s (of peak)", "best val acc", "test acc",
             "status"]


def markdown_rows(results: Sequence[VariantResult], show_seed: bool = False) -> List[List[str]]:
    rows = []
    for r in results:
        mem = "-" if r.peak_mem_mb is None else (
            (r.peak_mem_per_rank or f"{r.peak_mem_mb:.0f}")
            + (" (RSS)" if r.peak_mem_source == "rss" else ""))
        status = r.status if r.status != FAILED else f"failed: {r.reason}"
        test = _acc(r.test_acc)
        if r.test_correct is not None:
            test += f" ({r.test_correct}/{r.test_total})"
        rate = "-" if r.tflops is None else f"{r.tflops:.3g}" + (
            f" ({100 * r.utilisation:.1f}%)" if r.utilisation is not None else "")
        name = r.variant + (f" (seed {r.seed})" if show_seed else "")
        rows.append([name, r.parallel, r.precision, r.amp_dtype or "-",
                     f"{r.devices} {r.device}", "-" if r.epochs is None else str(r.epochs),
                     format_seconds(r.wall_time_s), format_seconds(r.train_time_s),
                     _num(r.images_per_s), mem, rate, _acc(r.best_val_acc), test,
                     status.replace("|", "\\|")])
    return rows


def markdown_table(results: Sequence[VariantResult], show_seed: bool = False) -> str:
    rows = markdown_rows(results, show_seed)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(MD_HEADER)]
    numeric = {4, 5, 6, 7, 8, 9, 10, 11, 12}

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
                   preamble: Sequence[str] = (), notes: Sequence[str] = (), summary: str = "",
                   show_seed: bool = False) -> str:
    """The title, ``preamble``, ``summary`` (the table over the seeds), the table of every
    run, and ``notes``."""
    text = "\n".join([f"# {title}", ""] + list(preamble) + [""]
                     + ([summary] if summary else [])
                     + [markdown_table(results, show_seed), ""] + list(notes)) + "\n"
    Path(path).write_text(text, encoding="utf-8")
    return text


# --------------------------------------------------------------------------- the figure
BASELINE = "train_without"  # fp32 on one device: what every technique is measured against


def speedups(results: Sequence[VariantResult], baseline: str = BASELINE
             ) -> Tuple[Dict[str, Optional[float]], str]:
    """Each variant's steady-state images/s divided by ``baseline``'s, and a note.

    The ratio is None for a variant that did not finish (status other than ok) or has no
    images/s. Without a usable baseline (not run, failed, no images/s) every ratio is
    None and the note says why; otherwise the note is empty.
    """
    none = {r.variant: None for r in results}
    base = next((r for r in results if r.variant == baseline), None)
    if base is None:
        return none, f"no baseline: {baseline} was not among the variants"
    if base.status != OK:
        return none, f"no baseline: {baseline} {base.status}"
    if not base.images_per_s or base.images_per_s <= 0:
        return none, f"no baseline: {baseline} logged no images/s"
    return {r.variant: (r.images_per_s / base.images_per_s
                        if r.status == OK and r.images_per_s else None)
            for r in results}, ""


def memory_kind(r: VariantResult) -> str:
    """What ``peak_mem_mb`` measured: the training log's figure is
    ``torch.cuda.max_memory_allocated`` on a GPU and the peak RSS on the CPU (its
    ``peak_mem_kind``); compare.py's own fallback is the peak RSS."""
    if r.peak_mem_mb is None:
        return ""
    return "GPU allocated" if r.peak_mem_source == "log" and r.device == "cuda" else "process RSS"


_STYLE = {"single": ("-", "o"), "dp": ("--", "s"), "ddp": (":", "^")}
_NOT_OK_COLOUR = "#cb181d"


def _colour(i: int) -> str:
    return ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf"][i % 10]


def _accuracy_panel(ax, results: Sequence[VariantResult],
                    curves: Dict[str, List[Tuple[int, float, float]]],
                    bands: Dict[str, List[Tuple[int, float, float, float, float]]]) -> None:
    """Validation accuracy against cumulative training time, one line per variant; over
    several seeds (``bands``) the mean line and the band from the lowest to the highest."""
    ends = [c[-1][1] for c in curves.values() if c] + [b[-1][1] for b in bands.values() if b]
    unit, div = ("min", 60.0) if max(ends, default=0.0) >= 300 else ("s", 1.0)
    for i, r in enumerate(results):
        band = bands.get(r.variant) or []
        points = [(e, t, a) for e, t, a, _, _ in band] or curves.get(r.variant) or []
        linestyle, marker = _STYLE.get(r.parallel, ("-", "o"))
        label = r.variant if r.status == OK else f"{r.variant} ({r.status})"
        if r.status == OK and not points:
            label += " (no epoch logged)"
        ax.plot([t / div for _, t, _ in points], [a for _, _, a in points], label=label,
                color=_colour(i), linestyle=linestyle, marker=marker, markersize=5,
                alpha=1.0 if r.status == OK else 0.45)
        if band:
            ax.fill_between([t / div for _, t, _, _, _ in band], [lo for *_, lo, _ in band],
                            [hi for *_, hi in band], color=_colour(i), alpha=0.15, linewidth=0)
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"cumulative training time ({unit}; training loops only, no validation)")
    ax.set_ylabel("validation accuracy (top-1)")
    ax.set_title("accuracy vs training time")
    ax.grid(alpha=0.3)
    if results:  # below the axes, never over the lines
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8,
                  frameon=False)


def _bar_panel(ax, results: Sequence[VariantResult], values: Dict[str, Optional[float]],
               fmt) -> List[Optional[float]]:
    """One horizontal bar per variant (in the accuracy panel's colours) with its value
    written at its end; a variant without a value gets its status written instead."""
    drawn = [values.get(r.variant) for r in results]
    top = max((v for v in drawn if v is not None), default=1.0) or 1.0
    for i, (r, v) in enumerate(zip(results, drawn)):
        if v is None:
            why = r.status if r.status != OK else "not measured"
            ax.text(0.02, i, why, transform=ax.get_yaxis_transform(), va="center",
                    color=_NOT_OK_COLOUR, fontsize=9)
            continue
        ax.barh(i, v, 0.7, color=_colour(i), alpha=1.0 if r.status == OK else 0.45,
                hatch=None if r.status == OK else "//")
        ax.text(v + 0.01 * top, i, fmt(r, v), va="center", fontsize=8)
    ax.set_xlim(0, top * 1.3)
    ax.set_ylim(max(len(results), 1) - 0.5, -0.5)  # the first variant on top
    ax.grid(axis="x", alpha=0.3)
    return drawn


def _speedup_panel(ax, results: Sequence[VariantResult]) -> List[Optional[float]]:
    ratios, note = speedups(results)
    drawn = _bar_panel(ax, results, ratios, lambda r, v: f"{v:.2f}x")
    if note:
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center",
                fontsize=10, color=_NOT_OK_COLOUR, wrap=True,
                bbox=dict(facecolor="white", edgecolor=_NOT_OK_COLOUR))
    else:
        ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(f"images/s (steady state) / {BASELINE}'s")
    ax.set_title(f"speed-up over {BASELINE} (fp32, 1 device)")
    return drawn


def _memory_panel(ax, results: Sequence[VariantResult]) -> List[Optional[float]]:
    kinds = sorted({memory_kind(r) for r in results} - {""})
    mixed = len(kinds) > 1
    drawn = _bar_panel(ax, results, {r.variant: r.peak_mem_mb for r in results},
                       lambda r, v: f"{v:.0f}" + (f" ({memory_kind(r)})" if mixed else ""))
    ax.set_xlabel("MB (the run's largest process or device)")
    ax.set_title("peak memory per device" + (f": {kinds[0]}" if len(kinds) == 1 else ""))
    return drawn


def plot_results(results: Sequence[VariantResult], path: Optional[Path] = None,
                 title: str = "",
                 curves: Optional[Dict[str, List[Tuple[int, float, float]]]] = None,
                 bands: Optional[Dict[str, List[Tuple[int, float, float, float, float]]]] = None):
    """Three panels side by side, and the figure returned (a matplotlib ``Figure``
    outside pyplot: nothing to close); written to ``path`` as a PNG when given.

    1. validation accuracy against cumulative training time, from ``curves``
       (variant -> :func:`accuracy_curve` points), or over several seeds ``bands``
       (variant -> ``stats.band`` points: the mean and the range over the seeds);
    2. speed-up over ``train_without`` (:func:`speedups`);
    3. peak memory per device (``peak_mem_mb``, labelled GPU allocated or process RSS).

    A variant that did not finish is drawn faded with its status in the legend, and its
    status is written in place of its bars.
    """
    from matplotlib.figure import Figure

    curves = curves or {}
    fig = Figure(figsize=(17, 0.3 * len(results) + 5.2), layout="constrained")
    ax_acc, ax_speed, ax_mem = fig.subplots(1, 3, width_ratios=[1.35, 1, 1])
    _accuracy_panel(ax_acc, results, curves, bands or {})
    _speedup_panel(ax_speed, results)
    _memory_panel(ax_mem, results)
    names = [r.variant if r.status == OK else f"{r.variant} ({r.status})" for r in results]
    for ax in (ax_speed, ax_mem):
        ax.set_yticks(range(len(results)))
        ax.set_yticklabels(names, fontsize=9)
        for label, r in zip(ax.get_yticklabels(), results):
            if r.status != OK:
                label.set_color(_NOT_OK_COLOUR)
    if title:
        fig.suptitle(title, fontsize=11)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
