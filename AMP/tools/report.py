"""``compare.py``'s table: one :class:`VariantResult` per run, written to ``results.csv``
and ``results.md``, with each variant's speed-up over ``train_without``.

Plain Python (no torch import), so the parent process of a comparison stays light. The
runs' logs are read by :mod:`tools.run_logs`, the figure drawn by :mod:`tools.figure`,
the children run by :mod:`tools.runner`.
"""
from __future__ import annotations

import csv
import dataclasses
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
    # "" for the fp32 variants.
    amp_dtype: str
    device: str
    # GPUs (DP), processes (DDP) or 1.
    devices: int
    # The rows of log.jsonl: a stopped or failed run completes fewer than asked for.
    epochs: Optional[int] = None
    # The training command, start to exit; train_time_s, its epochs' train_time alone,
    # leaves out validation, IO and start-up, which wall time holds.
    wall_time_s: Optional[float] = None
    train_time_s: Optional[float] = None
    # Steady state, all devices together.
    images_per_s: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    # "log" (peak_mem_mb in log.jsonl) or "rss" (measured here, where the log has none).
    peak_mem_source: str = ""
    # Under torchrun, each rank's from the log: "2133 / 1901".
    peak_mem_per_rank: str = ""
    best_val_acc: Optional[float] = None
    test_acc: Optional[float] = None
    test_correct: Optional[int] = None
    test_total: Optional[int] = None
    status: str = NOT_RUN
    reason: str = ""
    checkpoint: str = ""
    seed: Optional[int] = None
    # Achieved over the training loops; utilisation is its share of the devices' peak,
    # where the peak is known.
    tflops: Optional[float] = None
    utilisation: Optional[float] = None
    # Time to the comparison's target accuracy (target_acc): whether the run's validation
    # accuracy reached it (None: the run did not finish, or there is no target), and the
    # training-loop seconds, epochs and images until the first epoch that did.
    target_acc: Optional[float] = None
    reached_target: Optional[bool] = None
    time_to_target_s: Optional[float] = None
    epochs_to_target: Optional[int] = None
    images_to_target: Optional[int] = None


CSV_COLUMNS = [f.name for f in dataclasses.fields(VariantResult)]


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


def to_target_text(r: VariantResult) -> str:
    """``12.3s (epoch 2, 3840 images)``, ``not reached``, or ``-`` where not measured."""
    if r.reached_target is None:
        return "-"
    if not r.reached_target:
        return "not reached"
    images = "" if r.images_to_target is None else f", {r.images_to_target} images"
    return f"{format_seconds(r.time_to_target_s)} (epoch {r.epochs_to_target}{images})"


MD_HEADER = ["variant", "parallel", "precision", "amp dtype", "devices", "epochs",
             "total wall time", "training time (no val)", "images/s (steady)",
             "peak memory (MB, per rank)", "TFLOP/s (of peak)", "best val acc", "test acc",
             "time to target", "status"]


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
                     to_target_text(r), status.replace("|", "\\|")])
    return rows


def markdown_table(results: Sequence[VariantResult], show_seed: bool = False) -> str:
    rows = markdown_rows(results, show_seed)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(MD_HEADER)]
    numeric = {4, 5, 6, 7, 8, 9, 10, 11, 12, 13}

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
# fp32 on one device: what every technique is measured against.
BASELINE = "train_without"


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


def peak_memory_kind(r: VariantResult) -> str:
    """What ``peak_mem_mb`` measured: the training log's figure is
    ``torch.cuda.max_memory_allocated`` on a GPU and the peak RSS on the CPU (its
    ``peak_mem_kind``); compare.py's own fallback is the peak RSS."""
    if r.peak_mem_mb is None:
        return ""
    return "GPU allocated" if r.peak_mem_source == "log" and r.device == "cuda" else "process RSS"
