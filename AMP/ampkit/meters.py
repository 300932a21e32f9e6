"""The run's meters, which ``train_one_epoch`` runs and the epoch's log row reads: an epoch's
clock and learning rate, its memory peak, the steps a GradScaler skipped, TFLOP/s against
the device's peak, the bytes a comm hook sent, ``--profile``'s recorder, and where a
resumed epoch starts (its figures before the stop included). What would make a figure mean
less than it says (bf16 emulated on this CPU, no known peak, a comm hook with nothing to
send) is said once, as the meters are made.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from .data import Loaders, report_unreadable
from .device import DistInfo, memory_kind, peak_memory_mb, reset_peak_memory
from .distributed import gather_from_ranks
from .engine import StepMeters
from .flops import achieved, arch_flops_per_image, run_peak
from .precision import slow_bf16
from .profiler import StepProfiler


class Meters(StepMeters):
    """The figures of a run's epochs (module docstring), for ``train_one_epoch`` and the
    epoch's log row. ``technique``: the script's (its model, optimizer and scaler);
    ``comm_hook``: DDP's, whose bytes are counted; ``arch``: the network's name, whose FLOPs
    per image are counted on the meta device; ``profile_dir``: --profile's traces (None:
    none); ``peak_tflops``: --peak_tflops (None: by GPU name)."""

    def __init__(self, technique, data: Loaders, info: DistInfo, resumed, log, *, arch: str,
                 accum_steps: int, comm_hook=None, peak_tflops: Optional[float] = None,
                 fp32_math: str = "", profile_dir: Optional[Path] = None) -> None:
        self.technique, self.data, self.info, self.resumed, self.log = (technique, data, info,
                                                                        resumed, log)
        self.comm_hook = comm_hook
        self.global_batch = data.batch_size * accum_steps * info.world_size
        profiler = (StepProfiler(profile_dir / f"trace_rank{info.rank}.json", info.device,
                                 say=log.print) if profile_dir is not None else None)
        super().__init__(technique.scaler, profiler)
        self.flops_per_image = arch_flops_per_image(arch, data.num_classes, data.image_shape)
        self.dp = any(isinstance(m, nn.DataParallel) for m in technique.model.modules())
        log.warn(slow_bf16(technique.amp_dtype, info.device))
        if comm_hook is not None:
            log.warn(comm_hook.caveat(info.world_size, technique.scaler))
        self.peak, note = run_peak(peak_tflops, info.device, technique.amp_dtype, fp32_math)
        log.warn(note)
        gpus = torch.cuda.device_count() if self.dp and info.device.type == "cuda" else 1  # DP
        self.devices = info.world_size * gpus  # what the peak is multiplied by
        self.train_seconds, self.train_flops, self.start = 0.0, 0.0, None

    def begin_epoch(self, epoch: int) -> int:
        """The epoch's clock and learning rate, its memory peak and wire bytes from zero; the
        step it starts from (a resumed epoch's: where its stop saved; else 0)."""
        self.start = (time.perf_counter(), self.technique.optimizer.param_groups[0]["lr"],
                      reset_peak_memory(self.info.device, all_gpus=self.dp))
        if self.comm_hook is not None:
            self.comm_hook.reset_counts()
        return self.resumed.step_in(epoch)

    def before(self, epoch: int) -> Optional[Dict[str, Any]]:
        """A resumed epoch's figures up to its stop (None: ``epoch`` starts afresh)."""
        return self.resumed.so_far_in(epoch)

    def profiler(self, epoch: int) -> Optional[StepProfiler]:
        """--profile: the recorder of this run's first epoch's first steps (else None)."""
        return self._profiler if epoch == self.resumed.epoch else None

    def row(self, epoch: int, stats, correct: int, seen: int) -> Dict[str, Any]:
        """The epoch's log row: ``stats`` (``engine.TrainStats``), validation's counts, and
        every rank's peak memory (and, with --skip_bad_images, the images each left out)
        gathered: every rank calls it."""
        before = self.resumed.so_far_in(epoch) or {}  # a resumed epoch's part before its stop
        seconds_before, images_before = before.get("seconds", 0.0), before.get("images", 0)
        self.train_seconds += stats.seconds - seconds_before  # this process's own
        self.train_flops += (stats.images - images_before) * self.flops_per_image
        t0, lr, reset = self.start
        peak = peak_memory_mb(self.info.device, all_gpus=self.dp)
        mine = (round(peak, 1) if peak is not None else None, self.data.take_unreadable())
        ranks = gather_from_ranks([mine], self.info)  # every rank's peak this epoch
        peaks, unreadable = [peak for peak, _ in ranks], [u for _, left in ranks for u in left]
        known = [peak for peak in peaks if peak is not None]  # None: the device keeps none
        scaler = self.technique.scaler
        row = {"epoch": epoch + 1, "train_loss": stats.loss, "val_acc": correct / seen,
               "val_correct": correct, "val_seen": seen, "lr": lr,
               "epoch_time": time.perf_counter() - t0 + seconds_before,
               "train_time": stats.seconds, "data_time": stats.data_seconds,
               "images_per_s": stats.images_per_s, "optimizer_steps": stats.steps,
               "global_batch": self.global_batch,
               "grad_norm_mean": stats.grad_norm_mean, "grad_norm_max": stats.grad_norm_max,
               "skipped_steps": stats.skipped,
               "skipped_images": report_unreadable(self.log.print, unreadable),
               "peak_mem_mb": max(known) if known else None, "peak_mem_mb_per_rank": peaks,
               "peak_mem_kind": memory_kind(self.info.device, reset) if known else "n/a"}
        row |= {"grad_scale": scaler.get_scale()} if scaler is not None else {}
        row |= achieved(stats.images * self.flops_per_image, stats.seconds, self.peak,
                        self.devices)
        return row | (self.comm_hook.per_step(self.technique.model)
                      if self.comm_hook is not None else {})

    def mean(self) -> dict:
        """The run's achieved TFLOP/s over its training time (and share of the peak)."""
        return achieved(self.train_flops, self.train_seconds, self.peak, self.devices)
