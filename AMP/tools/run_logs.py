"""What a run left behind, read back: its ``log.jsonl`` and its eval script's result line.

- :func:`summarise_log` turns a run's ``log.jsonl`` into the table's numbers;
  :func:`accuracy_curve` into (epoch, cumulative training time, val accuracy) points;
  :func:`time_to_target` into the training time, epochs and images to a target accuracy.
- :func:`parse_eval_output` reads ``correct/total = acc`` from an eval script.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple


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


@dataclass
class Reached:
    """Where a run's validation accuracy first reached a target: at the end of ``epoch``,
    after ``seconds`` of training loops and ``images`` trained on (all devices together;
    None where an epoch's row has no images/s)."""
    epoch: int
    seconds: float
    images: Optional[int]


def time_to_target(rows: Sequence[Dict], target: float) -> Optional[Reached]:
    """The first epoch whose ``val_acc`` is at least ``target``, with the training time of
    :func:`accuracy_curve` (the loops alone) up to its end and the images trained on until
    then (each epoch's ``images_per_s`` x ``train_time``: its images, all ranks); None where
    the run never reached it in the epochs whose time is known."""
    epochs = epoch_rows(rows)
    for epoch, seconds, acc in accuracy_curve(rows):
        if acc >= target:
            rates = [_finite(r.get("images_per_s")) for r in epochs[:epoch]]
            images = (round(sum(rate * r["train_time"] for rate, r in zip(rates, epochs)))
                      if None not in rates else None)
            return Reached(epoch, seconds, images)
    return None


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
    return " / ".join(f"{max(known):.0f}" if (known := [v for v in col if v is not None])
                      else "n/a" for col in zip(*lists))


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
