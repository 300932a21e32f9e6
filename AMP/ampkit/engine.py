"""The epoch loop around a script's training step, and the accuracy count.

``train_one_epoch`` runs a script's step (``ampkit.technique``) on the epoch's micro-batches,
``accum_steps`` a step, without a host sync per step: each step's loss and gradient norm
stay on the device as the step returned them (:class:`StepFigures`), and are read on the
host every ``log_every`` steps and at the epoch's end, within a ``HOST_READ`` span of the
profiler. Its meters (a run's :class:`ampkit.meters.Meters`, or the :class:`StepMeters`
alone) say where the epoch starts and whether a GradScaler skips steps, and record
--profile's steps.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from typing import ContextManager, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn
from tqdm import tqdm

from .device import DistInfo, synchronize
from .distributed import StopVote, gather_from_ranks, max_over_ranks
from .errors import UserError
from .log import progress_bar
from .profiler import StepProfiler
from .technique import MicroBatches, Step

# The name of the span (torch.profiler.record_function) of each host read of the epoch: the
# only host syncs of a training epoch, every log_every steps and at its end.
HOST_READ = "ampkit: host read"


class TrainingDiverged(UserError):
    """The loss stayed non-finite for several consecutive steps without a GradScaler."""


@dataclass
class TrainStats:
    loss: float          # mean training loss over the epoch's finite steps (all ranks)
    images: int          # images trained on, all ranks together
    seconds: float       # wall time of the training loop alone
    steps: int           # optimizer steps taken
    skipped: int         # steps GradScaler skipped because of inf/NaN gradients
    nonfinite: int       # steps whose loss or gradient norm was inf/NaN
    stopped_at: Optional[int] = None  # optimizer step within the epoch where a stop ended it
    data_seconds: float = 0.0  # part of `seconds` spent waiting for input (rank 0's)
    grad_norm_mean: float = float("nan")  # gradient norm before clipping, over the finite,
    grad_norm_max: float = float("nan")   # not skipped steps (rank 0's: the same on all ranks)
    finite_images: int = 0  # the images of the steps the loss is the mean of
    norm_steps: int = 0     # the steps the gradient norm is the mean of

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def after(self, before: Optional["TrainStats"]) -> "TrainStats":
        """The whole epoch: ``before`` (its steps up to a stop, in the stopped run) and
        these, its steps since the resume; the stop is this part's."""
        if before is None:
            return self

        def mean(a: float, n: int, b: float, m: int) -> float:  # of n a's and m b's
            if not n or not m:  # one side's mean is NaN (of nothing)
                return a if n else b
            return (a * n + b * m) / (n + m)

        norms = [x for x in (before.grad_norm_max, self.grad_norm_max) if not math.isnan(x)]
        return TrainStats(
            loss=mean(before.loss, before.finite_images, self.loss, self.finite_images),
            images=before.images + self.images, seconds=before.seconds + self.seconds,
            steps=before.steps + self.steps, skipped=before.skipped + self.skipped,
            nonfinite=before.nonfinite + self.nonfinite, stopped_at=self.stopped_at,
            data_seconds=before.data_seconds + self.data_seconds,
            grad_norm_mean=mean(before.grad_norm_mean, before.norm_steps,
                                self.grad_norm_mean, self.norm_steps),
            grad_norm_max=max(norms) if norms else float("nan"),
            finite_images=before.finite_images + self.finite_images,
            norm_steps=before.norm_steps + self.norm_steps)


class StepFigures:
    """An epoch's per-step figures: each step's micro-batch losses and gradient norm as the
    step returns them, kept on the device (adding a step costs no op and no sync), then read
    on the host in one copy every ``log_every`` steps and summed there in double precision,
    each loss weighted by its micro-batch's images -- a device may have no float64 at all
    (MPS, some Intel GPUs). ``scaled``: a GradScaler runs, and it skips exactly the steps
    whose unscaled gradients hold an inf/NaN, the ones whose gradient norm (taken after
    ``unscale_``) is inf/NaN: those are counted as skipped, and their norm in no mean or
    maximum."""

    def __init__(self, scaled: bool) -> None:
        self.scaled = scaled
        self._pending: List[Tuple[List[torch.Tensor], torch.Tensor, List[int]]] = []
        self.images = self.finite_images = self.norm_steps = 0
        self.nonfinite = self.skipped = self.bad_run = self.worst_run = 0
        self.loss_sum = self.norm_sum = 0.0  # loss x images of the finite steps; norms
        self.norm_max = float("nan")

    def add(self, losses: List[torch.Tensor], norm: torch.Tensor, sizes: List[int]) -> None:
        """One optimizer step: its micro-batches' mean losses, of ``sizes`` images each."""
        self._pending.append((losses, norm, sizes))

    def read(self) -> None:
        """The steps added since the last read, onto the host: the run's host sync."""
        if not self._pending:
            return
        values = iter(torch.stack([t for losses, norm, _ in self._pending
                                   for t in (*losses, norm)]).tolist())
        for losses, _, sizes in self._pending:
            step_losses, norm = [next(values) for _ in losses], next(values)
            n = sum(sizes)
            finite_loss, finite_norm = all(map(math.isfinite, step_losses)), math.isfinite(norm)
            self.images += n
            if finite_loss:
                self.loss_sum += sum(loss * size for loss, size in zip(step_losses, sizes))
                self.finite_images += n
            if finite_norm:
                self.norm_sum += norm
                self.norm_max = norm if math.isnan(self.norm_max) else max(self.norm_max, norm)
                self.norm_steps += 1
            self.skipped += self.scaled and not finite_norm
            bad = not (finite_loss and finite_norm)
            self.nonfinite += bad
            self.bad_run = self.bad_run + 1 if bad else 0
            self.worst_run = max(self.worst_run, self.bad_run)
        self._pending.clear()

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.finite_images if self.finite_images else float("nan")


def _diverged(worst: int, step: int) -> TrainingDiverged:
    return TrainingDiverged(f"the training loss or gradient norm was inf/NaN for {worst} "
                            f"consecutive steps (by step {step}); stopping. Lower --lr, clip "
                            "the gradients (--clip_grad) or use a GradScaler variant")


class StepMeters:
    """What ``train_one_epoch`` meters besides its figures: whether ``scaler`` (a GradScaler,
    or None) skips steps, ``profiler``'s steps (None: none), and where an epoch starts
    (here: at its first step; a run's :class:`ampkit.meters.Meters` knows a resumed
    epoch's)."""

    def __init__(self, scaler: Optional[torch.amp.GradScaler],
                 profiler: Optional[StepProfiler] = None) -> None:
        self.scaled = scaler is not None and scaler.is_enabled()
        self._profiler = profiler

    def begin_epoch(self, epoch: int) -> int:
        """The step ``epoch`` starts from."""
        return 0

    def before(self, epoch: int) -> Optional[dict]:
        """The figures of ``epoch``'s steps before a stop that the run resumed from."""
        return None

    def profiler(self, epoch: int) -> Optional[StepProfiler]:
        return self._profiler


def micro_batches_by_step(loader: Iterable, accum_steps: int
                          ) -> Iterator[Tuple[MicroBatches, float]]:
    """The loader's batches, ``accum_steps`` at a time (an epoch's last step may have fewer),
    with the host's seconds spent waiting for them."""
    batches = iter(loader)
    while True:
        t_wait = time.perf_counter()
        micro_batches = list(itertools.islice(batches, accum_steps))
        if not micro_batches:
            return
        yield micro_batches, time.perf_counter() - t_wait


def train_one_epoch(train_step: Step, loader: Iterable, info: DistInfo, *, epoch: int = 0,
                    meters: Optional[StepMeters] = None, accum_steps: int = 1,
                    max_nonfinite: Optional[int] = 5, stop: Optional[StopVote] = None,
                    log_every: int = 20, desc: str = "train") -> TrainStats:
    """Run ``train_step`` on ``loader``'s batches (on the device), ``accum_steps`` at a time:
    one optimizer step each, from the step ``meters`` says the epoch starts at (a resumed
    epoch's rest: ``loader.start_at``). ``log_every`` and the progress bar count optimizer
    steps. ``stop``: the ranks' vote, taken before the epoch (for a signal since the last
    one) and after every step (no host sync); when it says so, the epoch ends there on every
    rank (``TrainStats.stopped_at``). ``max_nonfinite=None``: no divergence check (a
    GradScaler skips the bad steps instead). The figures returned include a resumed epoch's
    before its stop."""
    device, meters = info.device, meters or StepMeters(None)
    start_step = meters.begin_epoch(epoch)
    if hasattr(loader, "start_at"):  # a training loader (a list of batches starts at 0)
        loader.start_at(start_step * accum_steps)
    figures = StepFigures(meters.scaled)
    before = meters.before(epoch)
    synchronize(device)
    t0 = time.perf_counter()
    step, steps_done, stopped_at, data_seconds = start_step, 0, None, 0.0
    if stop is not None and stop.before_epoch():  # a signal since the last epoch's steps
        return _epoch_stats(figures, info, max_nonfinite, step, t0,
                            dict(steps=0, stopped_at=step)).after(_so_far(before))
    total = (start_step + math.ceil(len(loader) / accum_steps) if hasattr(loader, "__len__")
             else None)
    bar = progress_bar(total=total, initial=start_step, desc=desc, disable=not info.is_main,
                       unit="step")
    profiler = meters.profiler(epoch)
    # The bar is closed before any error message, so it is not drawn over.
    with profiler or contextlib.nullcontext(), bar:  # the bar closes first, then a report
        for micro_batches, waited in micro_batches_by_step(loader, accum_steps):
            data_seconds += waited  # host time waiting for input
            losses, norm = train_step(micro_batches)
            figures.add(losses, norm, [y.shape[0] for _, y in micro_batches])
            step, steps_done = step + 1, steps_done + 1
            bar.update(1)
            if profiler is not None:
                profiler.step()
            if stop is not None and stop.after_step():  # every rank, at this same step
                stopped_at = step
                break
            if step % log_every == 0:
                _host_check(figures, bar, info, max_nonfinite, step)
    # Asked during the last step? (Always called: it takes the vote still in flight.)
    if stop is not None and stop.any_rank_asked() and stopped_at is None:
        stopped_at = step
    return _epoch_stats(figures, info, max_nonfinite, step, t0,
                        dict(steps=steps_done, stopped_at=stopped_at,
                             data_seconds=data_seconds)).after(_so_far(before))


def _so_far(before: Optional[dict]) -> Optional[TrainStats]:
    return TrainStats(**before) if before else None


def _epoch_stats(figures: StepFigures, info: DistInfo, max_nonfinite: Optional[int],
                 step: int, t0: float, kw: dict) -> TrainStats:
    """The epoch's figures over the ranks: every rank's gathered and added up on the host, in
    rank order (the same exact sums on every rank). Steps are skipped, and gradient norms
    taken, alike on every rank (the gradients are the reduced ones): rank 0's."""
    with torch.profiler.record_function(HOST_READ):
        figures.read()
        ranks = gather_from_ranks([(figures.images, figures.finite_images, figures.loss_sum,
                                    figures.nonfinite, figures.worst_run)], info)
    synchronize(info.device)
    seconds = time.perf_counter() - t0
    images, finite_images, loss_sum = (sum(r[i] for r in ranks) for i in range(3))
    worst = max(r[4] for r in ranks)
    if max_nonfinite is not None and worst >= max_nonfinite:
        raise _diverged(worst, step)
    nan, counted = float("nan"), figures.norm_steps
    return TrainStats(loss=loss_sum / finite_images if finite_images else nan,
                      images=images, seconds=seconds, skipped=figures.skipped,
                      nonfinite=max(r[3] for r in ranks),
                      grad_norm_mean=figures.norm_sum / counted if counted else nan,
                      grad_norm_max=figures.norm_max if counted else nan,
                      finite_images=finite_images, norm_steps=counted, **kw)


def _host_check(figures: StepFigures, bar: tqdm, info: DistInfo,
                max_nonfinite: Optional[int], step: int) -> None:
    """The host sync point, every log_every steps (never every step): the steps' figures
    read, the progress bar's loss and the divergence check, which all ranks reach at the
    same step and pass or fail together."""
    with torch.profiler.record_function(HOST_READ):
        figures.read()
        worst = figures.worst_run
        if info.distributed:
            worst = int(max_over_ranks(torch.tensor(worst, device=info.device), info).item())
    if info.is_main:
        bar.set_postfix(loss=f"{figures.mean_loss:.4f}")
    if max_nonfinite is not None and worst >= max_nonfinite:
        raise _diverged(worst, step)


@torch.no_grad()
def count_correct(model: nn.Module, loader: Iterable, info: DistInfo,
                  autocast: Optional[ContextManager] = None, desc: str = "eval") -> torch.Tensor:
    """``tensor([correct, seen])`` (int64, on the device) over this process's batches (on the
    device): top-1 predictions that match the target. Summing them over ranks is the
    caller's.

    In a process group every rank runs as many forwards as the rank with the most batches:
    a sharded (FSDP2) or DDP model's forward is a collective, and a rank with one batch
    fewer -- 21 images over 2 ranks, or none at all -- would leave its peers waiting.
    A rank whose shard has run out forwards its last batch again (or, with none, one
    blank image of the loader's ``image_shape``), and counts nothing of it."""
    device = info.device
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    forwards = len(loader)
    if info.distributed:  # one host read per validation
        with torch.profiler.record_function(HOST_READ):
            forwards = int(max_over_ranks(torch.tensor(forwards, device=device), info).item())
    batches, padding = iter(loader), None
    for _ in progress_bar(range(forwards), desc=desc, disable=not info.is_main):
        batch = next(batches, None)  # None: this rank's shard has run out
        if batch is None and not info.distributed:
            break
        if batch is None and padding is None:
            padding = torch.zeros((1, *loader.image_shape), device=device).contiguous(
                memory_format=loader.memory_format)
        images = padding if batch is None else batch[0]
        with autocast or contextlib.nullcontext():
            outputs = model(images)
        if batch is None:
            continue  # a forward for the peers' collectives, not counted
        counts[0] += (outputs.argmax(dim=1) == batch[1]).sum()
        counts[1] += batch[1].shape[0]
        padding = images
    next(batches, None)  # to its end: a loader's bookkeeping after its last batch
    return counts
