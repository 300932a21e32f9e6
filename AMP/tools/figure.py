"""``results.png``: validation accuracy against training time, the speed-up over
``train_without`` and the peak memory of each variant, side by side (matplotlib, no pyplot)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .report import BASELINE, OK, VariantResult, peak_memory_kind, speedups

_STYLE = {"single": ("-", "o"), "dp": ("--", "s"), "ddp": (":", "^")}
_NOT_OK_COLOUR = "#cb181d"


def _colour(i: int) -> str:
    return ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf"][i % 10]


def _accuracy_panel(ax, results: Sequence[VariantResult],
                    curves: Dict[str, List[Tuple[int, float, float]]],
                    bands: Dict[str, List[Tuple[int, float, float, float, float]]],
                    target: Optional[float], target_label: str) -> None:
    """Validation accuracy against cumulative training time, one line per variant; over
    several seeds (``bands``) the mean line and the band from the lowest to the highest;
    the target accuracy as a horizontal line, with ``target_label`` written on it."""
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
    if target is not None:
        ax.axhline(target, color="black", linestyle="-.", linewidth=1,
                   label=f"target {target:.4f}")
        ax.text(0.01, target, target_label or f"target {target:.4f}", va="bottom", fontsize=7,
                transform=ax.get_yaxis_transform())
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"cumulative training time ({unit}; training loops only, no validation)")
    ax.set_ylabel("validation accuracy (top-1)")
    ax.set_title("accuracy vs training time")
    ax.grid(alpha=0.3)
    # The legend goes below the axes, where it never hides a line.
    if results:
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
    # Inverted limits: the first variant stands on top.
    ax.set_ylim(max(len(results), 1) - 0.5, -0.5)
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
    kinds = sorted({peak_memory_kind(r) for r in results} - {""})
    mixed = len(kinds) > 1
    drawn = _bar_panel(ax, results, {r.variant: r.peak_mem_mb for r in results},
                       lambda r, v: f"{v:.0f}" + (f" ({peak_memory_kind(r)})" if mixed else ""))
    ax.set_xlabel("MB (the run's largest process or device)")
    ax.set_title("peak memory per device" + (f": {kinds[0]}" if len(kinds) == 1 else ""))
    return drawn


def plot_results(results: Sequence[VariantResult], path: Optional[Path] = None,
                 title: str = "",
                 curves: Optional[Dict[str, List[Tuple[int, float, float]]]] = None,
                 bands: Optional[Dict[str, List[Tuple[int, float, float, float, float]]]] = None,
                 target: Optional[float] = None, target_label: str = ""):
    """Three panels side by side, and the figure returned (a matplotlib ``Figure``
    outside pyplot: nothing to close); written to ``path`` as a PNG when given.

    1. validation accuracy against cumulative training time, from ``curves``
       (variant -> :func:`accuracy_curve` points), or over several seeds ``bands``
       (variant -> ``stats.band`` points: the mean and the range over the seeds), and
       ``target`` (the accuracy compare.py times the runs to) as a line labelled
       ``target_label``;
    2. speed-up over ``train_without`` (:func:`speedups`);
    3. peak memory per device (``peak_mem_mb``, labelled GPU allocated or process RSS).

    A variant that did not finish is drawn faded with its status in the legend, and its
    status is written in place of its bars.
    """
    from matplotlib.figure import Figure

    curves = curves or {}
    fig = Figure(figsize=(17, 0.3 * len(results) + 5.2), layout="constrained")
    ax_acc, ax_speed, ax_mem = fig.subplots(1, 3, width_ratios=[1.35, 1, 1])
    _accuracy_panel(ax_acc, results, curves, bands or {}, target, target_label)
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
