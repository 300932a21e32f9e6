"""A variant's runs over several seeds, summarised: mean and spread of each figure, and
whether its accuracy, and its time to a target accuracy, differ from the fp32 baseline of
its parallel mode by more than the seeds do among themselves; the target itself.

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
TIME_RULE = ("Time to target: the training loops' time (`train_time` in log.jsonl, summed: no "
             "validation, checkpoints or start-up), the epochs and the images trained on (each "
             "epoch's images/s x its training time, all devices together) until the end of the "
             "first epoch whose validation accuracy reaches the target.")
SEEDS_TIME_RULE = ("Over seeds: mean ± sample standard deviation over the runs that reached "
                   "it (k of n finished), its difference from the baseline's and Welch's "
                   "verdict on the times, as for test accuracy.")


def time_rule(seeds: int) -> str:
    """What the time to target is, and over several seeds what its table says."""
    return TIME_RULE + (" " + SEEDS_TIME_RULE if seeds > 1 else "")


@dataclass
class Target:
    """The accuracy the runs' time is measured to, and how it was chosen (None: no target,
    and ``how`` says why)."""
    acc: Optional[float]
    how: str

    def sentence(self) -> str:
        return self.how[0].upper() + self.how[1:]


def choose_target(results: Sequence[VariantResult], given: Optional[float] = None) -> Target:
    """``given`` (--target_acc), else the fp32 baseline's mean final test accuracy less its
    seed spread (sample sd): train_without's, else the first of ``BASELINES`` to finish a
    run; with one run, that run's accuracy itself."""
    if given is not None:
        return Target(given, f"target: {given:.4f} (--target_acc)")
    done = [r for r in results if r.status == OK and r.test_acc is not None]
    plain = [r.variant for r in done if r.variant in BASELINES.values()]
    if not plain:
        return Target(None, f"no target: no fp32 baseline ({', '.join(BASELINES.values())}) "
                            "finished a run; --target_acc A sets one")
    base = "train_without" if "train_without" in plain else plain[0]
    accs = [r.test_acc for r in done if r.variant == base]
    mean = statistics.fmean(accs)
    if len(accs) == 1:
        return Target(mean, f"target: {mean:.4f} = {base}'s final test accuracy (one run: "
                            "no seed spread to subtract)")
    sd = statistics.stdev(accs)
    return Target(mean - sd, f"target: {mean - sd:.4f} = {base}'s mean final test accuracy "
                             f"{mean:.4f} less its seed sd {sd:.4f} ({len(accs)} runs)")


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
    # Its runs' time to target against the baseline's, over the runs that reached it.
    time_delta: Optional[Difference] = None
    baseline: str = ""

    @property
    def finished(self) -> List[VariantResult]:
        return [r for r in self.runs if r.status == OK]

    @property
    def measured(self) -> List[VariantResult]:
        """The finished runs whose time to target was measured (there is a target)."""
        return [r for r in self.finished if r.reached_target is not None]

    def _verdict(self, delta: Optional[Difference], needs: str) -> str:
        if self.first.variant == self.baseline:
            return "(the baseline)"
        if not self.baseline:
            return f"no baseline: {BASELINES[self.first.parallel]} not compared"
        if delta is None:
            return needs
        if delta.p is None:
            return "beyond seed noise (no spread among the seeds)"
        # Two decimals would print a p of 0.004 as "p = 0.00", which no test gives.
        p = "p < 0.01" if delta.p < 0.005 else f"p = {delta.p:.2f}"
        return f"{'within' if delta.within_noise else 'beyond'} seed noise ({p})"

    def verdict(self) -> str:
        return self._verdict(self.delta, "needs 2 finished runs on each side")

    def time_verdict(self) -> str:
        if not self.measured:
            return "-"
        return self._verdict(self.time_delta, "needs 2 runs that reached the target on each side")

    def reached_text(self) -> str:
        """``2 of 3 reached``: the runs that reached the target, of the finished ones."""
        return f"{sum(bool(r.reached_target) for r in self.measured)} of {len(self.measured)} reached"


FIGURES = ("wall_time_s", "images_per_s", "peak_mem_mb", "best_val_acc", "test_acc",
           "time_to_target_s", "epochs_to_target", "images_to_target")


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
    times = {s.first.variant: [r.time_to_target_s for r in s.finished if r.reached_target]
             for s in summaries}
    for s in summaries:
        if s.baseline and s.first.variant != s.baseline:
            s.delta = welch(accs[s.first.variant], accs[s.baseline])
            s.time_delta = welch(times[s.first.variant], times[s.baseline])
    return summaries


SEED_HEADER = ["variant", "parallel", "precision", "runs", "total wall time", "images/s",
               "peak memory (MB)", "best val acc", "test acc", "Δ test acc vs baseline",
               "verdict", "time to target", "Δ time to target vs baseline", "time verdict"]
# The columns of words, aligned left.
_TEXT_COLUMNS = {0, 1, 2, 10, 13}


def _signed_seconds(v: float) -> str:
    return ("-" if v < 0 else "+") + format_seconds(abs(v))


def _time_cells(s: SeedSummary) -> List[str]:
    """The time to target over the runs that reached it, with how many did; its
    difference from the baseline's; the verdict."""
    reached = s.figures.get("time_to_target_s")
    time = "-" if not s.measured else (
        (reached.text(format_seconds) + ", " if reached else "") + s.reached_text())
    delta = "-" if s.time_delta is None else \
        f"{_signed_seconds(s.time_delta.diff)} ± {format_seconds(s.time_delta.se)}"
    return [time, delta, s.time_verdict()]


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
                     cell("test_acc", lambda v: f"{v:.4f}"), delta, s.verdict(),
                     *_time_cells(s)])
    return rows


def seed_table(summaries: Sequence[SeedSummary]) -> str:
    rows = seed_rows(summaries)
    lines = ["| " + " | ".join(SEED_HEADER) + " |",
             "|" + "|".join("---" if i in _TEXT_COLUMNS else "--:"
                            for i in range(len(SEED_HEADER))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |"
                              for r in rows])


def variant_figures(s: SeedSummary) -> Dict[str, object]:
    """A variant's figures over its seeds as plain values (results.json): each of
    ``FIGURES``' spread, the differences from its baseline and their verdicts."""
    def plain(x):
        return None if x is None else dataclasses.asdict(x)

    return {"variant": s.first.variant, "parallel": s.first.parallel,
            "precision": s.first.precision, "baseline": s.baseline or None,
            "runs": len(s.runs), "finished": len(s.finished),
            "reached_target": sum(bool(r.reached_target) for r in s.measured)
            if s.measured else None,
            **{k: plain(s.figures.get(k)) for k in FIGURES},
            "test_acc_delta": plain(s.delta), "verdict": s.verdict(),
            "time_to_target_delta": plain(s.time_delta), "time_verdict": s.time_verdict()}


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
