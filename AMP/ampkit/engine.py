"""The epoch: what a script's ``build()`` returns (:class:`Technique`), the loop around its
training step (:func:`train_one_epoch`) and the accuracy count (:func:`count_correct`).

``train_one_epoch`` runs a script's step on the epoch's micro-batches, ``accum_steps`` a step,
from where the epoch starts (a resumed epoch's rest: the loader's ``batches(start)``), without
a host sync per step: its meters (``ampkit.meters``) keep each step's loss and gradient norm
on the device and read them on the host every ``log_every`` steps and at the epoch's end,
within a ``HOST_READ`` span of the profiler; the ranks' stop is asked after every step."""
from __future__ import annotations

import contextlib
import itertools
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn
from tqdm import tqdm

from .device import HOST_READ
from .distributed import DistInfo, max_over_ranks
from .errors import UserError


# Seconds between redraws of a progress bar where stderr is not a terminal (a log file,
# SLURM's, compare.py's children): a few lines a log keeps, not one redraw per step.
LOG_REDRAW_S = 30.0


class _Bar(tqdm):
    # No monitor thread: tqdm starts one with each bar (a disabled one too) and ends it with
    # the last, and a thread starting or ending while a DataLoader forks its workers can
    # leave a worker deadlocked in the fork (CPython gh-112275, in 3.11.7 for one).
    monitor_interval = 0


def progress_bar(iterable=None, **kw) -> tqdm:
    """tqdm on stderr, which clears itself when done (``leave=False``). In a terminal it
    redraws as tqdm does; elsewhere every ``LOG_REDRAW_S`` seconds at most."""
    interactive = sys.stderr.isatty()
    return _Bar(iterable, leave=False, dynamic_ncols=interactive,
                mininterval=0.1 if interactive else LOG_REDRAW_S, **kw)


# One optimizer step over its micro-batches [(images, targets), ...] -> (each micro-batch's
# mean loss, the gradient norm before clipping).
MicroBatches = List[Tuple[torch.Tensor, torch.Tensor]]
Step = Callable[[MicroBatches], Tuple[List[torch.Tensor], torch.Tensor]]


@dataclass
class Technique:
    """What a script's ``build()`` returns: the objects that make its variant, which the loop
    runs, the saver checkpoints and the meters read."""
    # The network as the script runs it: wrapped for its parallel mode.
    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_step: Step
    # Validation runs under it too: it measures the model the way it trains.
    autocast: Optional[torch.autocast] = None
    scaler: Optional[torch.amp.GradScaler] = None
    # FSDP2's MixedPrecisionPolicy, where the parameters are cast instead of the ops.
    mp_policy: Optional[object] = None

    @property
    def amp_dtype(self) -> Optional[torch.dtype]:
        """What the step computes in below float32 (None: float32 throughout)."""
        if self.autocast is not None:
            return self.autocast.fast_dtype
        return getattr(self.mp_policy, "param_dtype", None)


class StepFigures:
    """An epoch's per-step figures: each step's micro-batch losses and gradient norm as the
    step returns them, kept on the device (adding a step costs no op and no sync), then read
    on the host in one copy every ``log_every`` steps (float32 tensors, stacked) and summed
    there as Python floats, each loss weighted by its micro-batch's images: no float64
    tensor, which a device may not have at all (MPS, some Intel GPUs). ``scaled``: a
    GradScaler runs, and it skips exactly the steps whose unscaled gradients hold an
    inf/NaN, the ones whose gradient norm (taken after ``unscale_``) is inf/NaN: those are
    counted as skipped, and their norm in no mean or maximum."""

    def __init__(self, scaled: bool) -> None:
        self.scaled = scaled
        # The caller synced the device first, so no earlier work is timed as training.
        self.t0 = time.perf_counter()
        self._pending: List[Tuple[List[torch.Tensor], torch.Tensor, List[int]]] = []
        self.images = self.finite_images = self.norm_steps = 0
        self.nonfinite = self.skipped = self.bad_run = self.worst_run = 0
        # Each finite step's loss weighted by its images, so that the mean is per image.
        self.loss_sum = self.norm_sum = 0.0
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


class TrainingDiverged(UserError):
    """The loss stayed non-finite for several consecutive steps without a GradScaler."""


def _diverged(worst: int, step: int) -> TrainingDiverged:
    return TrainingDiverged(f"the training loss or gradient norm was inf/NaN for {worst} "
                            f"consecutive steps (by step {step}); stopping. Lower --lr, clip "
                            "the gradients (--clip_grad) or use a GradScaler variant")


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


def train_one_epoch(train_step: Step, loader: Iterable, info: DistInfo, *, meters,
                    start: int = 0, accum_steps: int = 1, max_nonfinite: Optional[int] = 5,
                    stop=None, log_every: int = 20, desc: str = "train"):
    """Run ``train_step`` on ``loader``'s batches (on the device), ``accum_steps`` at a time:
    one optimizer step each, from step ``start`` of the epoch on (a resumed epoch's rest).
    ``meters`` (``ampkit.meters``) keep the figures. ``log_every`` and the progress bar
    count optimizer steps. ``stop``: the ranks' stop (``ampkit.stop.Stop``), asked before
    the epoch (for a signal since the last one) and after every step (no host sync); when
    it says so, the epoch ends there on every rank (``TrainStats.stopped_at``).
    ``max_nonfinite`` inf/NaN losses in a row end the run, unless a GradScaler runs (the
    technique's scaler, which ``meters`` were made with: it skips those steps instead) or
    it is None. The figures returned include a resumed epoch's before its stop."""
    if meters.scaled:
        max_nonfinite = None
    figures = meters.begin_epoch()
    step, stopped_at, data_seconds = start, None, 0.0
    # A signal since the last epoch's steps: this epoch does not start.
    if stop is not None and stop.before_epoch():
        return meters.end_epoch(figures, steps=0, stopped_at=start)
    batches = loader.batches(start * accum_steps) if start else loader
    total = math.ceil(len(loader) / accum_steps) if hasattr(loader, "__len__") else None
    bar = progress_bar(total=total, initial=start, desc=desc, disable=not info.is_main,
                       unit="step")
    profiler = meters.profiler()
    # The bar is closed before any error message, so it is not drawn over.
    with profiler or contextlib.nullcontext(), bar:
        for micro_batches, waited in micro_batches_by_step(batches, accum_steps):
            data_seconds += waited
            losses, norm = train_step(micro_batches)
            figures.add(losses, norm, [y.shape[0] for _, y in micro_batches])
            step += 1
            bar.update(1)
            if profiler is not None:
                profiler.step()
            # Every rank learns it at this same step, and all stop together.
            if stop is not None and stop.after_step():
                stopped_at = step
                break
            if step % log_every == 0:
                _host_check(figures, bar, info, max_nonfinite, step)
    # Asked during the last step? (Always called: it receives the round still in flight.)
    if stop is not None and stop.any_rank_asked() and stopped_at is None:
        stopped_at = step
    stats = meters.end_epoch(figures, steps=step - start, stopped_at=stopped_at,
                             data_seconds=data_seconds)
    if max_nonfinite is not None and stats.worst_run >= max_nonfinite:
        raise _diverged(stats.worst_run, step)
    return stats


def _host_check(figures, bar: tqdm, info: DistInfo, max_nonfinite: Optional[int],
                step: int) -> None:
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
    # The longest shard's count sets every rank's forwards: one host read per validation.
    if info.distributed:
        with torch.profiler.record_function(HOST_READ):
            forwards = int(max_over_ranks(torch.tensor(forwards, device=device), info).item())
    batches, padding = iter(loader), None
    for _ in progress_bar(range(forwards), desc=desc, disable=not info.is_main):
        # None: this rank's shard has run out, while a peer's has not.
        batch = next(batches, None)
        if batch is None and not info.distributed:
            break
        if batch is None and padding is None:
            padding = torch.zeros((1, *loader.image_shape), device=device).contiguous(
                memory_format=loader.memory_format)
        images = padding if batch is None else batch[0]
        with autocast or contextlib.nullcontext():
            outputs = model(images)
        if batch is None:
            continue
        counts[0] += (outputs.argmax(dim=1) == batch[1]).sum()
        counts[1] += batch[1].shape[0]
        padding = images
    # The loop stops after ``forwards`` batches without asking for another: a loader does
    # its bookkeeping after its last batch, once it is asked for the next.
    next(batches, None)
    # --skip_bad_images may leave every image out: 0 of 0 is no accuracy (one host read, only
    # where images can be left out).
    if getattr(loader, "skip", False) and not max_over_ranks(counts[1:].clone(), info).item():
        raise UserError(f"{desc}: no readable image to evaluate (--skip_bad_images left out "
                        "every one)")
    return counts
