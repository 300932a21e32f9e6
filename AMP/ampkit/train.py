"""What a training run stands on, in the calls each script makes in view (``AMP/train_DDP.py``).

- :class:`RunFolder` (``with RunFolder(args, device) as run``): the folder and its lock, the
  checkpoint to resume, the logger of its files (``run.logger``) and the run's last line
  (``run.end``); ``run.status``: 0, or 128 + a stop's signal.
- :func:`stop_vote` (``with stop_vote(run.info, log.print) as vote``): the signal handlers
  that ask for a stop, and the vote that makes it at the same step on every rank.
- :func:`resume` (before ``build()`` wraps the network) and :func:`restore` (after it): a
  resumed run's weights and random streams, then its optimizer, schedule, scaler and comm
  hook states.
- :class:`Saver` (a ``with`` too): last.pth as ``--save_every`` says, best.pth at a new
  best, a stop's save; after a second Ctrl-C, what was saved, in one line.
- :class:`EpochFigures`: an epoch's clock, memory peak and TFLOP/s; its log row.

Every rank calls every function and method here, in the same order: the resume's agreement,
the save's time and random streams, the row's peaks are collectives. What rank 0 alone does
(print, write) is the logger's and the background writer's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from .distributed import (StopVote, agree_on_resumed, agreed_resume_path, any_rank, barrier,
                          gather_from_ranks, load_optimizer_state, rank_random_states,
                          this_process)
from .engine import EpochStats
from .machinery import checkpoint_files
from .machinery.data import report_skipped, take_skipped
from .machinery.process import DistInfo, Interrupted, UserError, single_process_device
from .machinery.hardware_use import (StepProfiler, achieved, peak_memory_mb, reset_peak_memory,
                                     run_peak)
from .machinery.log import RunLogger, epoch_row, summary_line
from .machinery.run_folder import claim_folders
from .machinery.resume import Resumed, load_resume, load_states, start_message
from .machinery.saving import SavePolicy, checkpoint_state
from .machinery.signals import StopFlag, StopSignals, exit_status, stopped_line
from .precision import SkippedSteps, cuda_math, slow_bf16
from .technique import Parts, Technique

Checkpoint = Callable[[], dict]  # a script's: {"model": the unwrapped weights, ...}


class RunFolder:
    """The run folder and its lock, the checkpoint to resume, and the run's last line
    (module docstring)."""

    def __init__(self, args, device: Optional[torch.device] = None) -> None:
        self.args, self.status, self.t_start, self.lock = args, 1, time.perf_counter(), None
        self.info = this_process(device or single_process_device(args.cuda))
        try:
            self.fp32_math = cuda_math(args.tf32, self.info.device)  # --tf32; cuDNN's kernels
            self.dir, self.lock, self.tb_dir = claim_folders(args, self.info.is_main)
            # rank 0's choice of the file to resume from, every rank's to read
            self.resume_path = agreed_resume_path(args, self.dir, self.info)
        except BaseException:  # a run that could not start leaves the folder to the next
            if self.lock is not None:
                self.lock.release()
            raise

    def logger(self, resumed: Resumed) -> RunLogger:
        """Rank 0's lines, log.jsonl and TensorBoard scalars here (a resumed run's after its
        epoch); closed at the end of its ``with``."""
        return RunLogger(self.info.is_main, self.tb_dir, self.dir / "log.jsonl",
                         resume_epoch=resumed.epoch if resumed.path else None)

    def end(self, figures: "EpochFigures", saver: "Saver", vote: StopVote,
            log: RunLogger) -> None:
        """After the epochs: the last save written, the run's last vote (a signal during the
        last epoch's end), then the last line: the summary, or where a stop saved."""
        args = self.args
        if saver.stopped_at is None and saver.resumed.epoch < args.epochs:
            saver.policy.finish()  # the last save, which may still be in flight
            if vote.any_rank_asked():
                saver.stopped_at = (args.epochs, 0)
            log.print(summary_line(args, time.perf_counter() - self.t_start,
                                   figures.train_seconds, saver.best_acc, saver.best_epoch,
                                   self.dir, self.tb_dir, figures.mean()))
        self.status = 0
        if saver.stopped_at is not None:
            log.print(stopped_line(vote.flag, *saver.stopped_at, self.dir / checkpoint_files.LAST,
                                   args.epochs))
            self.status = exit_status(vote.flag.agreed)

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """The folder released; if every rank got to the end (so no peer is gone), first a
        barrier, so that none tears down links a peer still uses."""
        if exc_type is None:
            barrier(self.info)
        if self.lock is not None:
            self.lock.release()


@contextlib.contextmanager
def stop_vote(info: DistInfo, say: Callable[[str], None]) -> Iterator[StopVote]:
    """Within it SIGTERM, SIGINT and SIGUSR1 ask for a stop, which the vote makes at the same
    step on every rank (machinery/signals.py says the rule); the handlers go with it."""
    flag = StopFlag()
    with StopSignals(flag, say, exiting=info.world_size > 1):
        yield StopVote(flag, info)


def resume(path: Optional[Path], model: nn.Module, args, info: DistInfo) -> Resumed:
    """Before ``build()`` wraps the bare ``model``: the weights of the checkpoint at ``path``
    (None: a new run; then ``--init_from``'s, if given) loaded into it, and this rank's random
    streams as they were saved; where the run starts. Every rank together: each must have
    read the same bytes, or every rank stops with one line."""
    resumed, failed = Resumed(), None
    try:
        if path is not None:
            resumed = load_resume(path, args, model, info.device, info.world_size, info.rank)
    except UserError as e:  # this rank's: every rank stops, in one line
        failed = str(e)
    agree_on_resumed(failed or resumed.loaded, info)
    if path is None and args.init_from is not None:  # another run's weights
        checkpoint_files.load_weights_from(model, args.init_from, "--init_from")
    return resumed


def restore(resumed: Resumed, technique: Technique, scheduler, comm_hook, args,
            log: RunLogger) -> None:
    """After ``build()``: a resumed run's optimizer (FSDP2: sharded again), LR schedule,
    GradScaler and comm hook states loaded into the objects the script made; where the run
    starts and what it changes against the checkpoint's run, said."""
    saved_hook = resumed.states.get("comm_hook")
    if resumed.states:
        load_optimizer_state(technique.optimizer, resumed.states["optimizer"], technique.model)
    changed = load_states(resumed, technique, scheduler, args)  # the schedule's, the scaler's
    if resumed.path is not None:  # PowerSGD's step count; what restarts, in words
        changed = "\n".join(filter(None, [changed, comm_hook.load_state_dict(saved_hook)]))
    log.print(start_message(resumed, args, changed))


class Saver:
    """When to write last.pth and best.pth (``machinery.saving.SavePolicy``), the best
    validation accuracy so far, and a stop's save. ``checkpoint()`` is the script's; every
    rank calls it (FSDP2 gathers there), then every rank's random streams are gathered;
    rank 0 writes, in the background."""

    def __init__(self, run_dir: Path, args, info: DistInfo, resumed: Resumed,
                 num_classes: int) -> None:
        self.args, self.info, self.resumed, self.num_classes = args, info, resumed, num_classes
        self.policy = SavePolicy(run_dir, args.save_every, args.epochs, info, resumed)
        self.best_acc, self.best_epoch = resumed.best_acc, resumed.best_epoch
        self.val_acc: Optional[float] = None  # the last epoch's
        self.timing: dict = {}  # the last save's, for its epoch's row
        self.stopped_at: Optional[tuple] = None  # (epochs done, step) where a stop saved

    def __enter__(self) -> "Saver":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is KeyboardInterrupt:  # a second Ctrl-C: say what was saved; go
            raise Interrupted(*self.policy.abandon()) from None

    def save(self, checkpoint: Checkpoint, epochs_done: int, val_acc: float) -> None:
        """After ``epochs_done`` epochs: last.pth as ``--save_every`` says (its time: on any
        rank's clock), best.pth at a new best."""
        self.val_acc = val_acc
        if val_acc > self.best_acc:
            self.best_acc, self.best_epoch = val_acc, epochs_done
        time_up = any_rank(self.policy.time_up_here(), self.info)  # --save_every 30m, say
        self.timing = self.policy.save(
            partial(self._state, checkpoint, epochs_done, 0, val_acc, None), epochs_done,
            time_up=time_up, is_best=self.best_epoch == epochs_done)

    def save_stop(self, checkpoint: Checkpoint, epochs_done: int,
                  stopped: Optional[EpochStats] = None) -> None:
        """A stop's last.pth, written before the run goes on to its end: at the step where
        ``stopped`` (the figures of the epoch it ended, saved with it) stopped, else after
        ``epochs_done`` epochs (nothing more written if last.pth is that point already)."""
        step = stopped.stopped_at if stopped is not None else 0
        self.stopped_at, self.timing = (epochs_done, step), {}
        if stopped is None and self.policy.last_saved == (epochs_done, 0):
            self.policy.wait()  # the save just made is the stop's
            return
        val_acc = None if stopped is not None else self.val_acc
        self.policy.save(partial(self._state, checkpoint, epochs_done, step, val_acc, stopped),
                         epochs_done, is_best=False, now=True, step=step)

    def _state(self, checkpoint: Checkpoint, epoch: int, step: int, val_acc: Optional[float],
               stopped: Optional[EpochStats], resume: bool) -> dict:
        counters = {"epoch": epoch, "step": step, "best_acc": self.best_acc,
                    "best_epoch": self.best_epoch, "val_acc": val_acc}
        if stopped is not None:
            counters["epoch_so_far"] = dataclasses.asdict(stopped)
        saved = checkpoint()  # every rank (FSDP2 gathers), then every rank's streams:
        streams = rank_random_states(self.info) if resume else None  # both collectives
        return checkpoint_state(saved, self.args, self.info, counters, self.num_classes,
                                streams)


class EpochFigures:
    """An epoch's figures for its row, and the run's for the summary: the clock, the learning
    rate, the memory peak (reset at the epoch's start), the steps a GradScaler skipped,
    TFLOP/s against the device's peak, the bytes on the wire; --profile's recorder. What
    would make them mean less than they say (bf16 emulated on this CPU, no known peak, a comm
    hook with nothing to send) is said once, here."""

    def __init__(self, args, run: RunFolder, technique: Technique, parts: Parts,
                 resumed: Resumed, loaders: tuple, log: RunLogger) -> None:
        info, scaler, dtype = run.info, technique.scaler, technique.compute_dtype
        self.args, self.info, self.technique, self.parts = args, info, technique, parts
        self.resumed, self.loaders, self.log = resumed, loaders, log
        self.profile_dir = run.dir / "profile"
        self.dp = any(isinstance(m, nn.DataParallel) for m in technique.model.modules())
        self.skipped = SkippedSteps(scaler, info.device)  # train_one_epoch counts them
        log.warn(slow_bf16(dtype, info.device))
        log.warn(parts.comm_hook.caveat(info.world_size, scaler))
        self.peak, note = run_peak(args.peak_tflops, info.device, dtype, run.fp32_math)
        log.warn(note)
        gpus = torch.cuda.device_count() if self.dp and info.device.type == "cuda" else 1
        self.devices = info.world_size * gpus  # what the peak is multiplied by
        self.train_seconds, self.train_flops, self.start = 0.0, 0.0, None

    def begin_epoch(self) -> None:
        """The epoch's clock and learning rate; its memory peak and wire bytes from zero."""
        self.start = (time.perf_counter(), self.technique.optimizer.param_groups[0]["lr"],
                      reset_peak_memory(self.info.device, all_gpus=self.dp))
        self.parts.comm_hook.reset_counts()

    def profiler(self, epoch: int) -> Optional[StepProfiler]:
        """--profile: a recorder of this run's first epoch's first steps (else None)."""
        if not self.args.profile or epoch != self.resumed.epoch:
            return None
        return StepProfiler(self.profile_dir / f"trace_rank{self.info.rank}.json",
                            self.info.device, say=self.log.print)

    def row(self, epoch: int, stats: EpochStats, counts: tuple) -> dict:
        """The epoch's row for ``RunLogger.epoch``; every rank's peak memory (and, with
        --skip_bad_images, the images each left out) gathered: every rank calls it."""
        before = self.resumed.so_far_in(epoch) or {}  # a resumed epoch's part before its stop
        seconds_before, images_before = before.get("seconds", 0.0), before.get("images", 0)
        self.train_seconds += stats.seconds - seconds_before  # this process's own
        self.train_flops += (stats.images - images_before) * self.parts.flops_per_image
        t0, lr, reset = self.start
        skipped = (report_skipped(self.log, gather_from_ranks(take_skipped(*self.loaders),
                                                              self.info))
                   if self.args.skip_bad_images else 0)
        seconds = time.perf_counter() - t0 + seconds_before
        peaks = gather_from_ranks([round(peak_memory_mb(self.info.device, all_gpus=self.dp), 1)],
                                  self.info)  # every rank's peak this epoch
        row = epoch_row(epoch, stats, [int(c) for c in counts], lr, seconds,
                        self.args, self.info, self.technique.scaler, skipped, peaks, reset)
        return row | achieved(stats.images * self.parts.flops_per_image, stats.seconds,
                              self.peak, self.devices) | self.parts.comm_hook.per_step()

    def mean(self) -> dict:
        """The run's achieved TFLOP/s over its training time (and share of the peak)."""
        return achieved(self.train_flops, self.train_seconds, self.peak, self.devices)
