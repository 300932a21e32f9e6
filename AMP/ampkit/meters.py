"""The run's meters: what ``engine.train_one_epoch`` and the epoch's log row measure. An
epoch's steps (``engine.StepFigures``) summed over the ranks (:class:`TrainStats`), and the
run's (:class:`Meters`): the epoch's clock, learning rate and memory peak, TFLOP/s
against the device's peak, a comm hook's bytes, the images the loaders left out, --profile's
recorder. What would make a figure mean less than it says (bf16 emulated on this CPU, no
known peak, a comm hook with nothing to send) is said once, as the meters are made."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .device import (HOST_READ, memory_kind, peak_memory_mb, reset_peak_memory, run_peak, slow_bf16,
                     synchronize)
from .distributed import DistInfo, gather_from_ranks
from .comm_hooks import wire_per_step
from .data import unreadable_line
from .engine import StepFigures
from .models import arch_flops_per_image
from .profiler import StepProfiler


@dataclass
class TrainStats:
    """An epoch's training figures, all ranks together: the mean loss over the finite steps
    (one inf/NaN step would make it NaN) and the images; the training loop's wall time and
    its part waiting for input (rank 0's); optimizer steps, those a GradScaler skipped and
    those whose loss or gradient norm was inf/NaN (the most in a row: ``worst_run``); the
    step where a stop ended it (None: it ran whole); the gradient norm before clipping over
    the finite, not skipped steps (rank 0's: every rank's, taken of the reduced gradients),
    and what the two means are of, by which :meth:`after` weighs a resumed epoch's parts."""
    loss: float
    images: int
    seconds: float
    steps: int
    skipped: int
    nonfinite: int
    stopped_at: Optional[int] = None
    data_seconds: float = 0.0
    grad_norm_mean: float = float("nan")
    grad_norm_max: float = float("nan")
    finite_images: int = 0
    norm_steps: int = 0
    worst_run: int = 0

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def from_saved(cls, saved: Dict[str, Any]) -> "TrainStats":
        """A checkpoint's figures of a stopped epoch (Progress checked that they are numbers;
        a field an older file lacks is 0)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{"loss": float("nan"), "images": 0, "seconds": 0.0, "steps": 0,
                      "skipped": 0, "nonfinite": 0}
                   | {k: v for k, v in saved.items() if k in names})

    def after(self, before: Optional["TrainStats"]) -> "TrainStats":
        """The whole epoch: ``before`` (its steps up to a stop, in the stopped run) and
        these, its steps since the resume; the stop is this part's."""
        if before is None:
            return self

        # The mean of n values whose mean is a and m whose mean is b.
        def mean(a: float, n: int, b: float, m: int) -> float:
            # A side of no values has a NaN mean, which would turn the weighted sum NaN.
            if not n or not m:
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
            norm_steps=before.norm_steps + self.norm_steps,
            worst_run=max(before.worst_run, self.worst_run))


class Meters:
    """The figures of a run's epochs, for ``train_one_epoch`` and the epoch's log row; they
    only add. ``technique``: the script's (its model, optimizer, scaler and precision);
    ``data``: its loaders (the global batch, the image size); ``progress``: where the run
    stands (a resumed epoch's figures before its stop are added to the rest of it);
    ``comm_hook``: DDP's (None: its own all-reduce), whose bytes are counted; ``arch``: the
    network's name, whose FLOPs per image are counted on the meta device (None: none); ``profile_dir``:
    --profile's traces of the run's first steps (None: none); ``peak_tflops``: --peak_tflops
    (None: by GPU name). Every rank calls :meth:`end_epoch` and :meth:`row` together: both
    gather from the ranks."""

    def __init__(self, technique, data, info: DistInfo, log, *, progress, arch: Optional[str],
                 accum_steps: int, comm_hook=None, peak_tflops: Optional[float] = None,
                 fp32_math: str = "", profile_dir: Optional[Path] = None) -> None:
        self.technique, self.data, self.info, self.log = technique, data, info, log
        self.progress, self.comm_hook = progress, comm_hook
        self.scaled = technique.scaler is not None and technique.scaler.is_enabled()
        self.global_batch = data.global_batch(accum_steps, info.world_size)
        self._profiler = (StepProfiler(profile_dir / f"trace_rank{info.rank}.json", info.device,
                                       say=log.print) if profile_dir is not None else None)
        self.flops_per_image = (arch_flops_per_image(arch, data.num_classes, data.image_shape)
                                if arch else 0.0)
        self.dp = any(isinstance(m, nn.DataParallel) for m in technique.model.modules())
        log.warn(slow_bf16(technique.amp_dtype, info.device))
        if comm_hook is not None:
            log.warn(comm_hook.caveat(info.world_size, technique.scaler))
        self.peak, note = run_peak(peak_tflops, info.device, technique.amp_dtype, fp32_math)
        log.warn(note)
        # The peak is one device's: under DataParallel one process drives every visible GPU.
        gpus = torch.cuda.device_count() if self.dp and info.device.type == "cuda" else 1
        self.devices = info.world_size * gpus
        self.train_seconds, self.train_flops = 0.0, 0.0
        self.start: Optional[tuple] = None
        self.before: Optional[TrainStats] = None

    def begin_epoch(self) -> StepFigures:
        """The epoch's clock and learning rate, its memory peak and wire bytes from zero, the
        figures of its steps before a stop the run resumed from; its steps' figures, their
        clock started once the device is idle."""
        so_far = self.progress.so_far if self.progress.step else None
        self.before = TrainStats.from_saved(so_far) if so_far else None
        self.start = (time.perf_counter(), self.technique.optimizer.param_groups[0]["lr"],
                      reset_peak_memory(self.info.device, all_gpus=self.dp))
        if self.comm_hook is not None:
            self.comm_hook.reset_counts()
        synchronize(self.info.device)
        return StepFigures(self.scaled)

    def profiler(self) -> Optional[StepProfiler]:
        """--profile's recorder, for this run's first epoch alone (else None)."""
        profiler, self._profiler = self._profiler, None
        return profiler

    def end_epoch(self, figures: StepFigures, *, steps: int, stopped_at: Optional[int],
                  data_seconds: float = 0.0) -> TrainStats:
        """The whole epoch's figures over the ranks (every rank calls it): each rank's
        gathered and added up on the host, in rank order (the same exact sums on every
        rank); steps are skipped, and gradient norms taken, alike on every rank (the
        gradients are the reduced ones): rank 0's. A resumed epoch's figures before its stop
        are added in; the run's time and FLOPs count this process's own steps."""
        with torch.profiler.record_function(HOST_READ):
            figures.read()
            ranks = gather_from_ranks([(figures.images, figures.finite_images,
                                        figures.loss_sum, figures.nonfinite,
                                        figures.worst_run)], self.info)
        synchronize(self.info.device)
        seconds = time.perf_counter() - figures.t0
        images, finite_images, loss_sum = (sum(r[i] for r in ranks) for i in range(3))
        nan, counted = float("nan"), figures.norm_steps
        stats = TrainStats(
            loss=loss_sum / finite_images if finite_images else nan, images=images,
            seconds=seconds, steps=steps, skipped=figures.skipped,
            nonfinite=max(r[3] for r in ranks), stopped_at=stopped_at,
            data_seconds=data_seconds,
            grad_norm_mean=figures.norm_sum / counted if counted else nan,
            grad_norm_max=figures.norm_max if counted else nan, finite_images=finite_images,
            norm_steps=counted, worst_run=max(r[4] for r in ranks))
        self.train_seconds += stats.seconds
        self.train_flops += stats.images * self.flops_per_image
        return stats.after(self.before)

    def row(self, epoch: int, stats: TrainStats, correct: int, seen: int) -> Dict[str, Any]:
        """The epoch's log row: ``stats`` (the whole epoch's, :meth:`end_epoch`), validation's
        counts, and every rank's peak memory (and, with --skip_bad_images, the images each
        left out) gathered: every rank calls it."""
        t0, lr, reset = self.start
        peak = peak_memory_mb(self.info.device, all_gpus=self.dp)
        mine = (round(peak, 1) if peak is not None else None, self.data.take_unreadable())
        ranks = gather_from_ranks([mine], self.info)
        peaks, unreadable = [peak for peak, _ in ranks], [u for _, left in ranks for u in left]
        self.log.print(unreadable_line(unreadable, "this epoch"))
        # None: a device whose allocator keeps no peak.
        known = [peak for peak in peaks if peak is not None]
        scaler = self.technique.scaler
        row = {"epoch": epoch + 1, "train_loss": stats.loss, "val_acc": correct / seen,
               "val_correct": correct, "val_seen": seen, "lr": lr,
               "epoch_time": time.perf_counter() - t0 + (self.before.seconds if self.before
                                                         else 0.0),
               "train_time": stats.seconds, "data_time": stats.data_seconds,
               "images_per_s": stats.images_per_s, "optimizer_steps": stats.steps,
               "global_batch": self.global_batch,
               "grad_norm_mean": stats.grad_norm_mean, "grad_norm_max": stats.grad_norm_max,
               "skipped_steps": stats.skipped,
               "skipped_images": len(unreadable),
               "peak_mem_mb": max(known) if known else None, "peak_mem_mb_per_rank": peaks,
               "peak_mem_kind": memory_kind(self.info.device, reset) if known else "n/a"}
        row |= {"grad_scale": scaler.get_scale()} if scaler is not None else {}
        row |= achieved(stats.images * self.flops_per_image, stats.seconds, self.peak,
                        self.devices)
        ddp = isinstance(self.technique.model, DistributedDataParallel)
        return row | (wire_per_step(self.technique.model, self.comm_hook) if ddp else {})

    def mean(self) -> dict:
        """The run's achieved TFLOP/s over its training time (and share of the peak)."""
        return achieved(self.train_flops, self.train_seconds, self.peak, self.devices)


def achieved(flops: float, seconds: float, peak: Optional[float], devices: int) -> dict:
    """``{"tflops": achieved TFLOP/s, "utilisation": its share of peak x devices, or None}``."""
    tflops = flops / seconds / 1e12 if seconds > 0 else float("nan")
    return {"tflops": tflops, "utilisation": tflops / (peak * devices) if peak else None}
