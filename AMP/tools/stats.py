"""A variant's runs over several seeds, summarised: mean and spread of each figure, and
whether its accuracy differs from the fp32 baseline of its parallel mode by more than the
seeds do among themselves.

The rule (said under every table it decides): Welch's t-test on the runs' test
accuracies, two-sided, at 5 %: p >= 0.05 is "within seed noise". Welch's test does not
assume the two variants spread alike, and with 3 seeds a side it asks for a difference
of about 3 to 4 standard errors, where "twice the standard error" would call 1 run in 5
of pure noise real. Plain Python (no torch, no scipy): the t distribution's tail comes
from the regularised incomplete beta function.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .report import OK, VariantResult, format_seconds

BASELINES = {"single": "train_without", "dp": "train_DP", "ddp": "train_DDP",
             "fsdp": "train_FSDP"}
ALPHA = 0.05
RULE = ("Δ test acc: the variant's mean over its seeds minus the mean of the fp32 variant "
        "of its parallel mode (train_without, train_DP, train_DDP, train_FSDP) -- for a "
        "SCRIPT+LABEL variant, of SCRIPT's plain runs where they ran too -- ± the "
        "standard error of that difference, √(s₁²/n₁ + s₂²/n₂). Verdict: Welch's t-test on "
        "the runs' test accuracies, two-sided, at 5 %: p ≥ 0.05 is within seed noise (the "
        "difference is no larger than the seeds make by themselves). Spreads are mean ± "
        "sample standard deviation (min–max) over the runs that finished.")


@dataclass
class Spread:
    mean: float
    # The sample standard deviation: 0 for one value, which has no spread to show.
    sd: float
    lo: float
    hi: float
    n: int

    def text(self, fmt) -> str:
        if self.n == 1:
            return fmt(self.mean)
        return f"{fmt(self.mean)} ± {fmt(self.sd)} ({fmt(self.lo)}–{fmt(self.hi)})"


def spread(values: Sequence[Optional[float]]) -> Optional[Spread]:
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return Spread(statistics.fmean(vals), sd, min(vals), max(vals), len(vals))


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((qam + 2 * m) * (a + 2 * m)),
                    -(a + m) * (qab + m) * x / ((a + 2 * m) * (qap + 2 * m))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    return betainc(df / 2.0, 0.5, df / (df + t * t))


@dataclass
class Difference:
    # mean(a) - mean(b), and its standard error.
    diff: float
    se: float
    # Welch's two-sided p; None where there is no spread to test against.
    p: Optional[float]

    @property
    def within_noise(self) -> bool:
        return self.p is not None and self.p >= ALPHA


def welch(a: Sequence[float], b: Sequence[float]) -> Optional[Difference]:
    """Welch's t-test of mean(a) - mean(b); None with fewer than 2 values on a side."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff, se = statistics.fmean(a) - statistics.fmean(b), math.sqrt(va + vb)
    # Every run of both alike: a difference is no noise, and no difference is nothing.
    if se == 0.0:
        return Difference(diff, 0.0, 1.0 if diff == 0.0 else None)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return Difference(diff, se, t_two_sided_p(diff / se, df))


@dataclass
class SeedSummary:
    """One variant over its seeds."""
    # Its first run, for what all of them share: names, devices.
    first: VariantResult
    runs: List[VariantResult]
    figures: Dict[str, Optional[Spread]] = field(default_factory=dict)
    delta: Optional[Difference] = None
    baseline: str = ""

    @property
    def finished(self) -> List[VariantResult]:
        return [r for r in self.runs if r.status == OK]

    def verdict(self) -> str:
        if self.first.variant == self.baseline:
            return "(the baseline)"
        if not self.baseline:
            return f"no baseline: {BASELINES[self.first.parallel]} not compared"
        if self.delta is None:
            return "needs 2 finished runs on each side"
        if self.delta.p is None:
            return "beyond seed noise (no spread among the seeds)"
        return (("within seed noise" if self.delta.within_noise else "beyond seed noise")
                + f" (p = {self.delta.p:.2f})")


FIGURES = ("wall_time_s", "images_per_s", "peak_mem_mb", "best_val_acc", "test_acc")


def summarise_seeds(results: Sequence[VariantResult]) -> List[SeedSummary]:
    """Per variant (in the order they first ran): the spread of each of ``FIGURES`` over
    its finished runs, and the difference of its test accuracy from its baseline's."""
    by_variant: Dict[str, List[VariantResult]] = {}
    for r in results:
        by_variant.setdefault(r.variant, []).append(r)
    summaries = []
    for variant, runs in by_variant.items():
        s = SeedSummary(runs[0], runs)
        s.figures = {k: spread([getattr(r, k) for r in s.finished]) for k in FIGURES}
        # SCRIPT+LABEL is measured against SCRIPT's plain runs, where they ran.
        script = variant.partition("+")[0]
        base = script if script != variant and script in by_variant else \
            BASELINES.get(runs[0].parallel, "")
        s.baseline = base if base in by_variant else ""
        summaries.append(s)
    accs = {s.first.variant: [r.test_acc for r in s.finished if r.test_acc is not None]
            for s in summaries}
    for s in summaries:
        if s.baseline and s.first.variant != s.baseline:
            s.delta = welch(accs[s.first.variant], accs[s.baseline])
    return summaries


SEED_HEADER = ["variant", "parallel", "precision", "runs", "total wall time", "images/s",
               "peak memory (MB)", "best val acc", "test acc", "Δ test acc vs baseline",
               "verdict"]


def _runs_cell(s: SeedSummary) -> str:
    """``3/3``, or ``2/3 (seed 1 failed)``: the runs counted, of those started."""
    others = [f"seed {r.seed} {r.status}" for r in s.runs if r.status != OK]
    return f"{len(s.finished)}/{len(s.runs)}" + (f" ({', '.join(others)})" if others else "")


def seed_rows(summaries: Sequence[SeedSummary]) -> List[List[str]]:
    rows = []
    for s in summaries:
        f = s.figures

        def cell(key: str, fmt) -> str:
            return "-" if f.get(key) is None else f[key].text(fmt)

        delta = "-" if s.delta is None else f"{s.delta.diff:+.4f} ± {s.delta.se:.4f}"
        rows.append([s.first.variant, s.first.parallel, s.first.precision, _runs_cell(s),
                     cell("wall_time_s", format_seconds), cell("images_per_s", lambda v: f"{v:.3g}"),
                     cell("peak_mem_mb", lambda v: f"{v:.0f}"),
                     cell("best_val_acc", lambda v: f"{v:.4f}"),
                     cell("test_acc", lambda v: f"{v:.4f}"), delta, s.verdict()])
    return rows


def seed_table(summaries: Sequence[SeedSummary]) -> str:
    rows = seed_rows(summaries)
    lines = ["| " + " | ".join(SEED_HEADER) + " |",
             "|" + "|".join("---" if i < 3 or i == len(SEED_HEADER) - 1 else "--:"
                            for i in range(len(SEED_HEADER))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |"
                              for r in rows])


def mean_result(s: SeedSummary) -> VariantResult:
    """The variant's run for the figure's bars: its first run, with the finished runs'
    mean images/s and peak memory (ok if any run finished)."""
    r = dataclasses.replace(s.first)
    for key in ("images_per_s", "peak_mem_mb"):
        setattr(r, key, None if s.figures.get(key) is None else s.figures[key].mean)
    if s.finished:
        r.status, r.reason = OK, ""
    return r


def band(curves: Sequence[List[Tuple[int, float, float]]]
         ) -> List[Tuple[int, float, float, float, float]]:
    """``(epoch, mean time, mean acc, lowest acc, highest acc)`` over the runs' accuracy
    curves, for each epoch every one of them reached."""
    curves = [c for c in curves if c]
    if not curves:
        return []
    out = []
    for i in range(min(len(c) for c in curves)):
        points = [c[i] for c in curves]
        accs = [a for _, _, a in points]
        out.append((points[0][0], statistics.fmean(t for _, t, _ in points),
                    statistics.fmean(accs), min(accs), max(accs)))
    return out
