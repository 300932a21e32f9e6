"""The one training/evaluation loop shared by every variant.

Variants differ only by the objects passed in: the model (bare, DataParallel or
DDP), the autocast factory (a no-op for fp32) and the GradScaler (disabled
unless the variant uses it). The hot loop never syncs the host: loss sums,
non-finite counters and skipped-step counts stay on the device and are read
every ``log_every`` steps and at the end of the epoch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Optional, Tuple

import torch
from torch import nn
from tqdm import tqdm

from .distributed import DistInfo, synchronize
from .errors import UserError


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



def train_one_epoch(model: nn.Module, loader: Iterable, criterion: nn.Module,
                    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    autocast: Callable[[], ContextManager], info: DistInfo, *,
                    desc: str = "train", start_step: int = 0, log_every: int = 20,
                    max_nonfinite: int = 5, stop: Optional[StopFlag] = None,
                    input_format: torch.memory_format = torch.preserve_format) -> EpochStats:
    device = info.device
    model.train()
    loss_sum = torch.zeros((), device=device)
    counts = torch.zeros(4, dtype=torch.int64, device=device)  # images, finite images, skipped, non-finite
    run_bad = torch.zeros((), dtype=torch.int64, device=device)    # consecutive non-finite steps
    worst_bad = torch.zeros((), dtype=torch.int64, device=device)
    use_scaler = scaler.is_enabled()

    synchronize(device)
    t0 = time.perf_counter()
    step, steps_done, stopped_at = start_step, 0, None
    total = start_step + len(loader) if hasattr(loader, "__len__") else None
    bar = tqdm(total=total, initial=start_step, desc=desc, disable=not info.is_main,
               leave=False, dynamic_ncols=True)
    data_seconds = 0.0  # host time blocked waiting for the next batch (input stalls)
    batches = iter(loader)
    try:
        while True:
            t_wait = time.perf_counter()
            try:
                images, targets = next(batches)
            except StopIteration:
                break
            data_seconds += time.perf_counter() - t_wait
            images = images.to(device, non_blocking=True, memory_format=input_format)
            targets = targets.to(device, non_blocking=True)
            with autocast():
                outputs = model(images)
                loss = criterion(outputs, targets)
            optimizer.zero_grad(set_to_none=True)
            if use_scaler:
                scaler.scale(loss).backward()
                scale_before = scaler._scale.clone()
                scaler.step(optimizer)  # skipped internally when the gradients hold inf/NaN
                scaler.update()
                # update() lowers the scale exactly when it found inf/NaN, i.e. skipped the step.
                counts[2] += (scaler._scale < scale_before).long().squeeze()
            else:
                loss.backward()
                optimizer.step()

            loss = loss.detach().float()
            finite = torch.isfinite(loss)
            n = targets.shape[0]
            loss_sum += torch.where(finite, loss, torch.zeros_like(loss)) * n
            counts[0] += n
            counts[1] += finite.long() * n
            counts[3] += (~finite).long()
            run_bad = torch.where(finite, torch.zeros_like(run_bad), run_bad + 1)
            worst_bad = torch.maximum(worst_bad, run_bad)
            step += 1
            steps_done += 1
            bar.update(1)

            local_stop = stop is not None and stop.requested
            if step % log_every == 0 or (local_stop and not info.distributed):
                # A host sync point: every log_every steps, never every step. Under DDP all
                # ranks reach it at the same step, so they agree on stopping together.
                flags = torch.stack([worst_bad, torch.tensor(int(local_stop), device=device)])
                worst, stop_all = info.all_reduce_max(flags).tolist()
                if info.is_main:
                    c = counts.tolist()
                    bar.set_postfix(loss=f"{(loss_sum / max(c[1], 1)).item():.4f}")
                if worst >= max_nonfinite and not use_scaler:
                    raise TrainingDiverged(
                        f"the training loss was inf/NaN for {worst} consecutive steps (at step "
                        f"{step}); stopping. Lower --lr or use a GradScaler variant")
                if stop_all:
                    stopped_at = step
                    break
    finally:
        bar.close()  # before any error message, so it is not drawn over

    totals = info.all_reduce_sum(torch.cat([counts.double(), loss_sum.double().view(1)]))
    worst = int(info.all_reduce_max(worst_bad.clone()).item())
    synchronize(device)
    seconds = time.perf_counter() - t0
    images, finite_images, skipped, nonfinite, loss_total = totals.tolist()
    if worst >= max_nonfinite and not use_scaler:
        raise TrainingDiverged(f"the training loss was inf/NaN for {worst} consecutive steps; "
                               "stopping. Lower --lr or use a GradScaler variant")
    mean_loss = loss_total / finite_images if finite_images else float("nan")
    return EpochStats(loss=mean_loss, images=int(images), seconds=seconds, steps=steps_done,
                      skipped=int(skipped), nonfinite=int(nonfinite), stopped_at=stopped_at,
                      data_seconds=data_seconds)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, autocast: Callable[[], ContextManager],
             info: DistInfo, desc: str = "eval",
             input_format: torch.memory_format = torch.preserve_format) -> Tuple[int, int]:
    """Top-1 (correct, total) over the whole split, summed exactly across ranks."""
    device = info.device
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for images, targets in tqdm(loader, desc=desc, disable=not info.is_main, leave=False,
                                dynamic_ncols=True):
        images = images.to(device, non_blocking=True, memory_format=input_format)
        targets = targets.to(device, non_blocking=True)
        with autocast():
            outputs = model(images)
        counts[0] += (outputs.argmax(dim=1) == targets).sum()
        counts[1] += targets.shape[0]
    correct, total = info.all_reduce_sum(counts).tolist()
    return int(correct), int(total)
