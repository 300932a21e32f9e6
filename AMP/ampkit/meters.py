"""The run's meters: what ``engine.train_one_epoch`` and the epoch's log row measure.

- An epoch's steps (:class:`StepFigures`): each step's losses and gradient norm, kept on the
  device and read on the host every ``log_every`` steps; the skipped steps of a GradScaler.
- Their sum over the ranks (:class:`TrainStats`), and a resumed epoch's figures before its
  stop added in (:meth:`StepMeters.end_epoch`).
- The run's (:class:`Meters`): an epoch's clock and learning rate, its memory peak, TFLOP/s
  against the device's peak, the bytes a comm hook sent, the images the loaders left out,
  and ``--profile``'s traces (:class:`StepProfiler`: a Chrome trace per rank, the operators
  that took the most time). What would make a figure mean less than it says (bf16 emulated
  on this CPU, no known peak, a comm hook with nothing to send) is said once, as the meters
  are made.

Every rank calls :meth:`StepMeters.end_epoch` and :meth:`Meters.row` together: both gather
from the ranks (:mod:`ampkit.distributed`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, schedule

from .device import (HOST_READ, memory_kind, peak_memory_mb, reset_peak_memory, run_peak, slow_bf16,
                     synchronize)
from .distributed import DistInfo, gather_from_ranks
from .models import arch_flops_per_image


@dataclass
class TrainStats:
    # Over the epoch's finite steps, all ranks: a single inf/NaN step would make the mean NaN.
    loss: float
    # All ranks together.
    images: int
    # Wall time of the training loop alone.
    seconds: float
    # Optimizer steps, not micro-batches.
    steps: int
    # GradScaler skips a step whose gradients hold an inf/NaN.
    skipped: int
    # Steps whose loss or gradient norm was inf/NaN.
    nonfinite: int
    # The optimizer step within the epoch where a stop ended it (None: the epoch ran whole).
    stopped_at: Optional[int] = None
    # The part of ``seconds`` spent waiting for input (rank 0's).
    data_seconds: float = 0.0
    # The gradient norm before clipping, over the finite, not skipped steps: rank 0's, which
    # is every rank's, since the norm is taken of the reduced gradients.
    grad_norm_mean: float = float("nan")
    grad_norm_max: float = float("nan")
    # What the two means are of: after() weights a resumed epoch's two parts by them.
    finite_images: int = 0
    norm_steps: int = 0
    # The most inf/NaN steps in a row (any rank's).
    worst_run: int = 0

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

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


class StepMeters:
    """What ``train_one_epoch`` meters: its steps' figures (whether ``scaler``, a GradScaler or
    None, skips steps), ``profiler``'s steps (None: none); a run's :class:`Meters` adds the
    rest."""

    def __init__(self, scaler: Optional[torch.amp.GradScaler],
                 profiler: Optional[StepProfiler] = None) -> None:
        self.scaled = scaler is not None and scaler.is_enabled()
        self._profiler = profiler

    def begin_epoch(self, epoch: int, info: DistInfo) -> StepFigures:
        """The figures of the epoch's steps, their clock started once the device is idle."""
        synchronize(info.device)
        return StepFigures(self.scaled)

    def profiler(self, epoch: int) -> Optional[StepProfiler]:
        return self._profiler

    def before(self, epoch: int) -> Optional[dict]:
        """The figures of ``epoch``'s steps before a stop that the run resumed from."""
        return None

    def end_epoch(self, figures: StepFigures, info: DistInfo, *, epoch: int, steps: int,
                  stopped_at: Optional[int], data_seconds: float = 0.0) -> TrainStats:
        """The epoch's figures over the ranks (every rank calls it): each rank's gathered and
        added up on the host, in rank order (the same exact sums on every rank); steps are
        skipped, and gradient norms taken, alike on every rank (the gradients are the
        reduced ones): rank 0's. A resumed epoch's figures before its stop are added in."""
        with torch.profiler.record_function(HOST_READ):
            figures.read()
            ranks = gather_from_ranks([(figures.images, figures.finite_images,
                                        figures.loss_sum, figures.nonfinite,
                                        figures.worst_run)], info)
        synchronize(info.device)
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
        before = self.before(epoch)
        return stats.after(TrainStats(**before) if before else None)


class Meters(StepMeters):
    """The figures of a run's epochs (module docstring), for ``train_one_epoch`` and the
    epoch's log row. ``technique``: the script's (its model, optimizer and scaler);
    ``comm_hook``: DDP's (None: its own all-reduce), whose bytes are counted; ``arch``: the
    network's name, whose FLOPs per image are counted on the meta device; ``profile_dir``:
    --profile's traces (None: none); ``peak_tflops``: --peak_tflops (None: by GPU name)."""

    def __init__(self, technique, data, info: DistInfo, resumed, log, *, arch: str,
                 amp_dtype: Optional[torch.dtype], accum_steps: int, comm_hook=None,
                 peak_tflops: Optional[float] = None, fp32_math: str = "",
                 profile_dir: Optional[Path] = None) -> None:
        self.technique, self.data, self.info, self.resumed, self.log = (technique, data, info,
                                                                        resumed, log)
        self.comm_hook = comm_hook
        self.ddp = isinstance(technique.model, DistributedDataParallel)
        self.global_batch = data.batch_size * accum_steps * info.world_size
        profiler = (StepProfiler(profile_dir / f"trace_rank{info.rank}.json", info.device,
                                 say=log.print) if profile_dir is not None else None)
        super().__init__(technique.scaler, profiler)
        self.flops_per_image = arch_flops_per_image(arch, data.num_classes, data.image_shape)
        self.dp = any(isinstance(m, nn.DataParallel) for m in technique.model.modules())
        log.warn(slow_bf16(amp_dtype, info.device))
        if comm_hook is not None:
            log.warn(comm_hook.caveat(info.world_size, technique.scaler))
        self.peak, note = run_peak(peak_tflops, info.device, amp_dtype, fp32_math)
        log.warn(note)
        # The peak is one device's: under DataParallel one process drives every visible GPU.
        gpus = torch.cuda.device_count() if self.dp and info.device.type == "cuda" else 1
        self.devices = info.world_size * gpus
        self.train_seconds, self.train_flops, self.start = 0.0, 0.0, None

    def begin_epoch(self, epoch: int, info: DistInfo) -> StepFigures:
        """The epoch's clock and learning rate, its memory peak and wire bytes from zero;
        its steps' figures."""
        self.start = (time.perf_counter(), self.technique.optimizer.param_groups[0]["lr"],
                      reset_peak_memory(self.info.device, all_gpus=self.dp))
        if self.comm_hook is not None:
            self.comm_hook.reset_counts()
        return super().begin_epoch(epoch, info)

    def before(self, epoch: int) -> Optional[Dict[str, Any]]:
        """A resumed epoch's figures up to its stop (None: ``epoch`` starts afresh)."""
        return self.resumed.so_far_in(epoch)

    def profiler(self, epoch: int) -> Optional[StepProfiler]:
        """--profile: the recorder of this run's first epoch's first steps (else None)."""
        return self._profiler if epoch == self.resumed.epoch else None

    def row(self, epoch: int, stats, correct: int, seen: int) -> Dict[str, Any]:
        """The epoch's log row: ``stats`` (:class:`TrainStats`), validation's counts, and
        every rank's peak memory (and, with --skip_bad_images, the images each left out)
        gathered: every rank calls it."""
        # A resumed epoch's stats include its part before the stop, which the stopped run
        # trained: the run's time and FLOPs count this process's own part alone.
        before = self.resumed.so_far_in(epoch) or {}
        seconds_before, images_before = before.get("seconds", 0.0), before.get("images", 0)
        self.train_seconds += stats.seconds - seconds_before
        self.train_flops += (stats.images - images_before) * self.flops_per_image
        t0, lr, reset = self.start
        peak = peak_memory_mb(self.info.device, all_gpus=self.dp)
        mine = (round(peak, 1) if peak is not None else None, self.data.take_unreadable())
        ranks = gather_from_ranks([mine], self.info)
        peaks, unreadable = [peak for peak, _ in ranks], [u for _, left in ranks for u in left]
        # None: a device whose allocator keeps no peak.
        known = [peak for peak in peaks if peak is not None]
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
        return row | (wire_per_step(self.technique.model, self.comm_hook) if self.ddp else {})

    def mean(self) -> dict:
        """The run's achieved TFLOP/s over its training time (and share of the peak)."""
        return achieved(self.train_flops, self.train_seconds, self.peak, self.devices)


def wire_per_step(model: nn.Module, hook) -> Dict[str, Any]:
    """What this rank sent per all-reduce round (one an optimizer step) over DDP's ``model``,
    in MB, for the epoch's row: ``hook``'s count (--comm_hook; {} before its first round), or
    without one DDP's own all-reduce, which sends every gradient in float32 each round."""
    if hook is None:
        sent = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return {"comm_hook": "none", "wire_mb_per_step": sent / 1e6}
    if not hook.rounds:
        return {}
    return {"comm_hook": hook.name, "wire_mb_per_step": hook.bytes_sent / hook.rounds / 1e6}


def report_unreadable(say: Callable[[str], None], unreadable: list) -> int:
    """--skip_bad_images: name the images the loaders left out (every rank's, gathered from
    their ``Loaders.take_unreadable``); how many."""
    if unreadable:
        more = f"; and {len(unreadable) - 5} more" if len(unreadable) > 5 else ""
        say(f"skipped {len(unreadable)} unreadable image(s) this epoch: "
            + "; ".join(str(u) for u in unreadable[:5]) + more)
    return len(unreadable)


def achieved(flops: float, seconds: float, peak: Optional[float], devices: int) -> dict:
    """``{"tflops": achieved TFLOP/s, "utilisation": its share of peak x devices, or None}``."""
    tflops = flops / seconds / 1e12 if seconds > 0 else float("nan")
    return {"tflops": tflops, "utilisation": tflops / (peak * devices) if peak else None}


class StepProfiler:
    """``torch.profiler`` over training steps: ``wait`` steps skipped, ``warmup`` recorded and
    dropped (the profiler's own start-up), ``active`` recorded; then the Chrome trace is
    written to ``path`` and ``table`` holds the top operators by self time; ``say`` prints
    :meth:`report` at the end."""

    def __init__(self, path: Path, device: torch.device, wait: int = 1, warmup: int = 1,
                 active: int = 3, say: Optional[Callable[[str], None]] = None) -> None:
        self.say = say
        self.path, self.needed, self.table = Path(path), wait + warmup + active, ""
        # The device's own activity where the profiler has one (CUDA, XPU, MPS).
        device_activity = getattr(ProfilerActivity, device.type.upper(), None)
        self.on_device = (device.type != "cpu"
                          and device_activity in torch.profiler.supported_activities())
        activities = [ProfilerActivity.CPU] + ([device_activity] if self.on_device else [])
        # One recording cycle: acc_events changes nothing but the warning torch 2.11 gives.
        self.prof = profile(activities=activities, on_trace_ready=self._ready, acc_events=True,
                            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1))

    def _ready(self, prof) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        sort = "self_device_time_total" if self.on_device else "self_cpu_time_total"
        self.table = prof.key_averages().table(sort_by=sort, row_limit=12)

    def __enter__(self) -> "StepProfiler":
        self.prof.start()
        return self

    def step(self) -> None:
        self.prof.step()

    def __exit__(self, *exc) -> None:
        self.prof.stop()
        if self.say is not None and exc[0] is None:
            self.say(self.report())

    def report(self) -> str:
        """What to print once the steps are over."""
        if not self.table:
            return (f"--profile: fewer than the {self.needed} steps it records "
                    "(1 skipped, 1 warm-up, 3 traced): no trace written (more steps: a "
                    "smaller --batch_size)")
        return (f"{self.table}\ntrace: {self.path} (open it in https://ui.perfetto.dev or "
                "chrome://tracing)")
