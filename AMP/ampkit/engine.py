"""The epoch loop around a script's training step, and the accuracy count.

``train_one_epoch`` runs a script's step (``ampkit.technique``) on the epoch's micro-batches,
``accum_steps`` a step, without a host sync per step: the loss sums and counters stay on
the device and are read every ``log_every`` steps and at the epoch's end. Its meters (a
run's :class:`ampkit.meters.Meters`, or the :class:`StepMeters` alone) say where the epoch
starts, count the steps a GradScaler skipped and record --profile's steps.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import ContextManager, Iterable, Iterator, Optional, Tuple

import torch
from torch import nn
from tqdm import tqdm

from .device import DistInfo, synchronize
from .distributed import StopVote, max_over_ranks, sum_over_ranks
from .errors import UserError
from .log import progress_bar
from .profiler import StepProfiler
from .technique import MicroBatches, Step

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


@dataclass
class _DeviceSums:
    """The epoch's running sums, kept on the device (adding to them never syncs)."""
    device: torch.device
    loss_sum: torch.Tensor = field(init=False)   # sum of loss x images, finite steps only
    norm_sum: torch.Tensor = field(init=False)   # gradient norms of the counted steps
    norm_max: torch.Tensor = field(init=False)
    images: torch.Tensor = field(init=False)
    finite_images: torch.Tensor = field(init=False)
    norm_steps: torch.Tensor = field(init=False)  # steps counted in the norm
    nonfinite: torch.Tensor = field(init=False)  # steps with an inf/NaN loss or norm
    bad_run: torch.Tensor = field(init=False)    # current run of consecutive such steps
    worst_run: torch.Tensor = field(init=False)  # longest such run

    def __post_init__(self) -> None:
        for name in ("loss_sum", "norm_sum", "norm_max"):
            setattr(self, name, torch.zeros((), dtype=torch.float64, device=self.device))
        for name in ("images", "finite_images", "norm_steps", "nonfinite", "bad_run",
                     "worst_run"):
            setattr(self, name, torch.zeros((), dtype=torch.int64, device=self.device))

    def add(self, loss: torch.Tensor, n: int, norm: torch.Tensor, skipped: torch.Tensor) -> None:
        """One optimizer step over ``n`` images; ``skipped``: GradScaler skipped it (its norm,
        of inf/NaN gradients, is not counted)."""
        loss, norm = loss.detach().double(), norm.detach().double()
        finite, finite_norm = torch.isfinite(loss), torch.isfinite(norm)
        self.loss_sum += torch.where(finite, loss, torch.zeros_like(loss)) * n
        self.images += n
        self.finite_images += finite.long() * n
        counted = finite_norm & ~skipped
        self.norm_sum += torch.where(counted, norm, torch.zeros_like(norm))
        self.norm_max = torch.maximum(self.norm_max, torch.where(counted, norm, self.norm_max))
        self.norm_steps += counted.long()
        bad = ~(finite & finite_norm)
        self.nonfinite += bad.long()
        self.bad_run = torch.where(bad, self.bad_run + 1, torch.zeros_like(self.bad_run))
        self.worst_run = torch.maximum(self.worst_run, self.bad_run)


def _diverged(worst: int, step: int) -> TrainingDiverged:
    return TrainingDiverged(f"the training loss or gradient norm was inf/NaN for {worst} "
                            f"consecutive steps (by step {step}); stopping. Lower --lr, clip "
                            "the gradients (--clip_grad) or use a GradScaler variant")


class SkippedSteps:
    """Counts the optimizer steps a GradScaler skipped (inf/NaN gradients), on the device.

    Why not ``scaler.get_scale()``: it returns a Python float, so calling it after every
    step would make the host wait for the GPU at every step. The scale is a tensor on the
    device (GradScaler's private ``_scale``; there is no public accessor for the tensor),
    and ``update()`` halves it exactly when ``step()`` was skipped, so comparing it
    before and after a step counts the skips without a sync. ``scaler=None`` or a
    disabled scaler: counts nothing.
    """

    def __init__(self, scaler: Optional[torch.amp.GradScaler], device: torch.device) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.last = torch.zeros((), dtype=torch.bool, device=device)  # the last step skipped
        self._scale: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around one optimizer step."""
        if self.scaler is None:
            yield
            return
        before = self._scale
        if before is None:  # before the first step the scale is still a float: no sync
            before = torch.tensor(self.scaler.get_scale(), device=self.count.device)
        yield
        after = self.scaler._scale
        self.last = (after < before).squeeze()
        self.count += self.last.long()
        self._scale = after.clone()


class StepMeters:
    """What ``train_one_epoch`` meters besides its sums: the steps ``scaler`` skipped (one
    counter for the whole run: the scale carries over from epoch to epoch), ``profiler``'s
    steps (None: none), and where an epoch starts (here: at its first step; a run's
    :class:`ampkit.meters.Meters` knows a resumed epoch's)."""

    def __init__(self, scaler: Optional[torch.amp.GradScaler], device: torch.device,
                 profiler: Optional[StepProfiler] = None) -> None:
        self.skipped = SkippedSteps(scaler, device)
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
    device, meters = info.device, meters or StepMeters(None, info.device)
    start_step = meters.begin_epoch(epoch)
    if hasattr(loader, "start_at"):  # a training loader (a list of batches starts at 0)
        loader.start_at(start_step * accum_steps)
    sums, skipped = _DeviceSums(device), meters.skipped
    skipped.count.zero_()  # this call's skips; the scaler's last scale carries over
    before = meters.before(epoch)
    synchronize(device)
    t0 = time.perf_counter()
    step, steps_done, stopped_at, data_seconds = start_step, 0, None, 0.0
    if stop is not None and stop.before_epoch():  # a signal since the last epoch's steps
        return _epoch_stats(sums, skipped, info, max_nonfinite, step, t0,
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
            with skipped.watch():
                loss, norm = train_step(micro_batches)
            sums.add(loss, sum(y.shape[0] for _, y in micro_batches), norm, skipped.last)
            step, steps_done = step + 1, steps_done + 1
            bar.update(1)
            if profiler is not None:
                profiler.step()
            if stop is not None and stop.after_step():  # every rank, at this same step
                stopped_at = step
                break
            if step % log_every == 0:
                _host_check(sums, bar, info, max_nonfinite, step)
    # Asked during the last step? (Always called: it takes the vote still in flight.)
    if stop is not None and stop.any_rank_asked() and stopped_at is None:
        stopped_at = step
    return _epoch_stats(sums, skipped, info, max_nonfinite, step, t0,
                        dict(steps=steps_done, stopped_at=stopped_at,
                             data_seconds=data_seconds)).after(_so_far(before))


def _so_far(before: Optional[dict]) -> Optional[TrainStats]:
    return TrainStats(**before) if before else None


def _epoch_stats(sums: _DeviceSums, skipped: SkippedSteps, info: DistInfo,
                 max_nonfinite: Optional[int], step: int, t0: float, kw: dict) -> TrainStats:
    """The epoch's figures, summed over the ranks: the epoch's one host sync."""
    totals = sum_over_ranks(torch.stack([sums.images.double(), sums.finite_images.double(),
                                         skipped.count.double(), sums.nonfinite.double(),
                                         sums.loss_sum]), info)
    worst = int(max_over_ranks(sums.worst_run.clone(), info).item())
    norms = torch.stack([sums.norm_sum, sums.norm_steps.double(), sums.norm_max]).tolist()
    synchronize(info.device)
    seconds = time.perf_counter() - t0
    images, finite_images, n_skipped, nonfinite, loss_total = totals.tolist()
    if max_nonfinite is not None and worst >= max_nonfinite:
        raise _diverged(worst, step)
    nan = float("nan")
    return TrainStats(loss=loss_total / finite_images if finite_images else nan,
                      images=int(images), seconds=seconds, skipped=int(n_skipped),
                      nonfinite=int(nonfinite), grad_norm_mean=norms[0] / norms[1]
                      if norms[1] else nan, grad_norm_max=norms[2] if norms[1] else nan,
                      finite_images=int(finite_images), norm_steps=int(norms[1]), **kw)


def _host_check(sums: _DeviceSums, bar: tqdm, info: DistInfo, max_nonfinite: Optional[int],
                step: int) -> None:
    """The host sync point, every log_every steps (never every step): the progress bar's
    loss and the divergence check, which all ranks reach at the same step and pass or fail
    together."""
    worst = int(max_over_ranks(sums.worst_run.clone(), info).item())
    if info.is_main:
        mean = sums.loss_sum / sums.finite_images.clamp(min=1)
        bar.set_postfix(loss=f"{mean.item():.4f}")
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
