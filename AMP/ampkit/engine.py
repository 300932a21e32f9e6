"""The epoch loop around a script's training step, and the accuracy count.

A train script's ``build(parts: Parts) -> Technique`` makes its variant: the wrapper, the
optimizer, the precision objects and the step -- forward under autocast, backward (scaled
or not), optimizer step. ``train_one_epoch`` runs that step and does the bookkeeping around it.
It never syncs the host per step: loss sums and counters stay on the device and are
read every ``log_every`` steps and at the end of the epoch.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Optional, Union

import torch
from torch import nn
from tqdm import tqdm

from .distributed import DistInfo, synchronize
from .machinery.errors import UserError
from .precision import SkippedSteps, resolve_amp_dtype

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (images, targets) -> loss


@dataclass
class Parts:
    """What a script's ``build()`` starts from: the objects that do not depend on the variant."""
    device: torch.device
    model: nn.Module             # the bare network, on ``device`` (resumed weights loaded)
    criterion: nn.Module
    # The autocast dtype: --amp_dtype (a name or a dtype); None: float16 on CUDA, bfloat16 on
    # the CPU. Resolved to a torch.dtype when Parts is made.
    amp_dtype: Union[torch.dtype, str, None] = None
    dp_scope: str = "model"               # --dp_scope (DataParallel scripts)
    lr: float = 1e-4                      # --lr, for the script's optimizer
    arch: str = "alexnet"                 # --arch: the network's name, for messages

    def __post_init__(self) -> None:
        if not isinstance(self.amp_dtype, torch.dtype):
            self.amp_dtype = resolve_amp_dtype(self.amp_dtype, self.device)


@dataclass
class Technique:
    """What a script's ``build()`` returns: the objects that make its variant, which the
    shared code runs, checkpoints and logs."""
    model: nn.Module                           # as wrapped by the script (DP, DDP, FSDP2)
    optimizer: torch.optim.Optimizer           # made by the script, over what it trains
    step: Step                                 # one optimizer step on (images, targets) -> loss
    autocast: Optional[torch.autocast] = None  # validation runs under it too
    scaler: Optional[torch.amp.GradScaler] = None
    param_dtype: Optional[torch.dtype] = None  # FSDP2's MixedPrecisionPolicy: the compute dtype

    @property
    def precision(self) -> str:
        if self.param_dtype is not None:
            return "mixed"
        if self.scaler is not None:
            return "grad_scaler"
        return "autocast" if self.autocast is not None else "fp32"

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype the matmuls and convolutions run in; None: float32."""
        if self.param_dtype is not None:
            return self.param_dtype
        return self.autocast.fast_dtype if self.autocast is not None else None


class TrainingDiverged(UserError):
    """The loss stayed non-finite for several consecutive steps without a GradScaler."""


class StopFlag:
    """Set by a signal handler; the loop finishes the current step, then stops."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def request(self, name: str) -> None:
        self.requested = True
        self.signal_name = name


@dataclass
class EpochStats:
    loss: float          # mean training loss over the epoch's finite steps (all ranks)
    images: int          # images trained on, all ranks together
    seconds: float       # wall time of the training loop alone
    steps: int           # optimizer steps taken in this call
    skipped: int         # steps GradScaler skipped because of inf/NaN gradients
    nonfinite: int       # steps whose loss was inf/NaN
    stopped_at: Optional[int] = None  # step index within the epoch where a stop request ended it
    data_seconds: float = 0.0  # part of `seconds` spent waiting for input (rank 0's)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Tally:
    """The epoch's running sums, kept on the device (adding to them never syncs)."""
    device: torch.device
    loss_sum: torch.Tensor = field(init=False)   # sum of loss x batch size, finite steps only
    images: torch.Tensor = field(init=False)
    finite_images: torch.Tensor = field(init=False)
    nonfinite: torch.Tensor = field(init=False)  # steps with an inf/NaN loss
    bad_run: torch.Tensor = field(init=False)    # current run of consecutive inf/NaN steps
    worst_run: torch.Tensor = field(init=False)  # longest such run

    def __post_init__(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for name in ("images", "finite_images", "nonfinite", "bad_run", "worst_run"):
            setattr(self, name, torch.zeros((), dtype=torch.int64, device=self.device))

    def add(self, loss: torch.Tensor, n: int) -> None:
        loss = loss.detach().double()
        finite = torch.isfinite(loss)
        self.loss_sum += torch.where(finite, loss, torch.zeros_like(loss)) * n
        self.images += n
        self.finite_images += finite.long() * n
        self.nonfinite += (~finite).long()
        self.bad_run = torch.where(finite, torch.zeros_like(self.bad_run), self.bad_run + 1)
        self.worst_run = torch.maximum(self.worst_run, self.bad_run)


def _diverged(worst: int, step: int) -> TrainingDiverged:
    return TrainingDiverged(f"the training loss was inf/NaN for {worst} consecutive steps (by "
                            f"step {step}); stopping. Lower --lr or use a GradScaler variant")


def train_one_epoch(step_fn: Step, loader: Iterable, info: DistInfo, *, desc: str = "train",
                    start_step: int = 0, log_every: int = 20, max_nonfinite: Optional[int] = 5,
                    stop: Optional[StopFlag] = None, skipped: Optional[SkippedSteps] = None,
                    input_format: torch.memory_format = torch.preserve_format,
                    profiler=None) -> EpochStats:
    """Run ``step_fn`` on every batch of ``loader``. ``max_nonfinite=None``: no divergence
    check (a GradScaler skips the bad steps instead); ``skipped`` counts those skips, this
    call's own; ``profiler`` (a ``machinery.profiler.StepProfiler``) records some steps."""
    device = info.device
    tally, skipped = Tally(device), skipped or SkippedSteps(None, device)
    skipped.count.zero_()  # this call's skips; the scaler's last scale carries over
    synchronize(device)
    t0 = time.perf_counter()
    step, steps_done, stopped_at, data_seconds = start_step, 0, None, 0.0
    total = start_step + len(loader) if hasattr(loader, "__len__") else None
    bar = tqdm(total=total, initial=start_step, desc=desc, disable=not info.is_main,
               leave=False, dynamic_ncols=True)
    batches = iter(loader)
    # The bar is closed before any error message, so it is not drawn over.
    with bar, profiler or contextlib.nullcontext():
        while True:
            t_wait = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            data_seconds += time.perf_counter() - t_wait  # host time waiting for input
            images = batch[0].to(device, non_blocking=True, memory_format=input_format)
            targets = batch[1].to(device, non_blocking=True)
            with skipped.watch():
                loss = step_fn(images, targets)
            tally.add(loss, targets.shape[0])
            step, steps_done = step + 1, steps_done + 1
            bar.update(1)
            if profiler is not None:
                profiler.step()
            local_stop = stop is not None and stop.requested
            if step % log_every == 0 or (local_stop and not info.distributed):
                if _host_check(tally, bar, info, local_stop, max_nonfinite, step):
                    stopped_at = step
                    break

    totals = info.all_reduce_sum(torch.stack([tally.images.double(), tally.finite_images.double(),
                                              skipped.count.double(), tally.nonfinite.double(),
                                              tally.loss_sum]))
    worst = int(info.all_reduce_max(tally.worst_run.clone()).item())
    synchronize(device)
    seconds = time.perf_counter() - t0
    images, finite_images, n_skipped, nonfinite, loss_total = totals.tolist()
    if max_nonfinite is not None and worst >= max_nonfinite:
        raise _diverged(worst, step)
    return EpochStats(loss=loss_total / finite_images if finite_images else float("nan"),
                      images=int(images), seconds=seconds, steps=steps_done,
                      skipped=int(n_skipped), nonfinite=int(nonfinite), stopped_at=stopped_at,
                      data_seconds=data_seconds)


def _host_check(tally: Tally, bar: tqdm, info: DistInfo, local_stop: bool,
                max_nonfinite: Optional[int], step: int) -> bool:
    """The host sync point, every log_every steps (never every step): the progress bar's
    loss, the divergence check, and whether to stop. Under DDP all ranks reach it at the
    same step, so they agree on stopping together. True: stop now."""
    device = info.device
    flags = torch.stack([tally.worst_run, torch.tensor(int(local_stop), device=device)])
    worst, stop_all = info.all_reduce_max(flags).tolist()
    if info.is_main:
        mean = tally.loss_sum / tally.finite_images.clamp(min=1)
        bar.set_postfix(loss=f"{mean.item():.4f}")
    if max_nonfinite is not None and worst >= max_nonfinite:
        raise _diverged(worst, step)
    return bool(stop_all)


@torch.no_grad()
def count_correct(model: nn.Module, loader: Iterable, info: DistInfo,
                  autocast: Optional[ContextManager] = None, desc: str = "eval",
                  input_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    """``tensor([correct, seen])`` (int64, on the device) over this process's batches:
    top-1 predictions that match the target. Summing them over ranks is the caller's."""
    device = info.device
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for images, targets in tqdm(loader, desc=desc, disable=not info.is_main, leave=False,
                                dynamic_ncols=True):
        images = images.to(device, non_blocking=True, memory_format=input_format)
        targets = targets.to(device, non_blocking=True)
        with autocast or contextlib.nullcontext():
            outputs = model(images)
        counts[0] += (outputs.argmax(dim=1) == targets).sum()
        counts[1] += targets.shape[0]
    return counts
