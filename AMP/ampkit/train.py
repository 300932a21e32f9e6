"""What a training run stands on around the set-up each script makes in view.

:class:`Run` (``with Run(args, device) as run``) is the run folder and its lock, the
resume (``run.resume(model)``: before ``build()`` wraps the network), and the end: the
last line, and after a stop ``run.status`` 128 + the signal, which the script returns after
its own teardown. The script makes its data, sampler, loader and network itself and hands
them to ``run.start``. :class:`EpochBook`, Run's base, is what the epoch loop calls
(``AMP/train_DDP.py``): ``begin_epoch``, ``save`` and ``log``; validation is the script's.
"""
from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from .distributed import (StopVote, agree_on_resumed, agreed_resume_path, any_rank, barrier,
                          gather_from_ranks, load_optimizer_state, rank_random_states,
                          this_process)
from .engine import EpochStats
from .machinery import checkpoint as ckpt_io
from .machinery.data import Loaders, report_skipped, take_skipped
from .machinery.errors import Interrupted, UserError
from .machinery.hardware_use import (StepProfiler, achieved, peak_memory_mb, reset_peak_memory,
                                     run_peak, training_flops_per_image)
from .machinery.log import RunLogger, epoch_row, header_line, summary_line
from .machinery.process import single_process_device
from .machinery.run_folder import claim_folders
from .machinery.resume import Resumed, load_resume, load_states, where_it_starts
from .machinery.saving import SavePolicy, checkpoint_state
from .machinery.signals import StopFlag, StopSignals, exit_status, stopped_line
from .precision import SkippedSteps, compile_in_place, cuda_math, slow_bf16
from .technique import Parts, Technique

Checkpoint = Callable[[], dict]  # a script's: {"model": the unwrapped weights, ...}


class EpochBook:
    """The bookkeeping around a script's epoch: the loop's options, validation, when to
    save, the epoch's log row. :class:`Run` sets its attributes."""

    def start(self, t: Technique, scheduler, data: Loaders, loader, parts: Parts) -> None:
        """What the script built: its technique and LR schedule (a resumed run's states
        loaded into them), its data and training loader, its parts; --compile; the logs, the
        save policy, the stop vote and signal handlers; the header line."""
        args, info = self.args, self.info
        self.t, self.dp = t, any(isinstance(m, nn.DataParallel) for m in t.model.modules())
        self.data, self.loader, self.parts = data, loader, parts
        self.logger = RunLogger(info.is_main, self.tb_dir, self.run_dir / "log.jsonl",
                                resume_epoch=self.resumed.epoch if self.resume_path else None)
        self.saver = SavePolicy(self.run_dir, args.save_every, args.epochs, info, self.resumed)
        self.signals = StopSignals(self.stop, self.logger.print)
        self.logger.warn(slow_bf16(t.compute_dtype, info.device))
        hook, saved_hook = self.parts.comm_hook, self.resumed.states.get("comm_hook")
        if self.resumed.states:  # every rank: FSDP2 shards the full saved state again
            load_optimizer_state(t.optimizer, self.resumed.states["optimizer"], t.model)
        changed = load_states(self.resumed, t, scheduler, args)  # the schedule's, the scaler's
        if self.resumed.path is not None:  # PowerSGD's step count; what restarts, in words
            changed = "\n".join(filter(None, [changed, hook.load_state_dict(saved_hook)]))
        self.logger.warn(hook.caveat(info.world_size, t.scaler))
        if args.compile:
            compile_in_place(t.model)
        self.logger.print(where_it_starts(self.resumed, args, changed))
        self.skipped, self.vote = SkippedSteps(t.scaler, info.device), StopVote(self.stop, info)
        self.peak, note = run_peak(args.peak_tflops, info.device, t.compute_dtype, self.fp32_math)
        self.logger.warn(note)
        gpus = torch.cuda.device_count() if self.dp and info.device.type == "cuda" else 1
        self.devices = info.world_size * gpus  # what the peak is multiplied by
        self.signals.install()
        self.logger.print(header_line(args, info, t, self.data, self.fp32_math))

    def epochs(self) -> Iterator[int]:
        """The epochs left to train, from the resumed one on; none after a stop."""
        for epoch in range(self.resumed.epoch, self.args.epochs):
            yield epoch
            if self.stopped_at is not None:
                return

    def begin_epoch(self, epoch: int) -> int:
        """Start ``epoch`` (after the script's ``sampler.set_epoch``): the clock, the memory
        peak, ``model.train()``; the step it starts from (a resumed epoch's, else 0), where
        the loader starts too."""
        step0 = self.resumed.step if epoch == self.resumed.epoch else 0
        self.loader.sampler.start_index = step0 * self.args.batch_size * self.args.accum_steps
        self.epoch_start = (time.perf_counter(), self.t.optimizer.param_groups[0]["lr"],
                            reset_peak_memory(self.info.device, all_gpus=self.dp))
        self.t.model.train()
        self.parts.comm_hook.reset_counts()  # the epoch's bytes on the wire
        return step0

    def so_far(self, epoch: int) -> Optional[EpochStats]:
        """A resumed epoch's figures up to the stop (None: the epoch starts here)."""
        so_far = self.resumed.so_far if epoch == self.resumed.epoch else None
        return EpochStats(**so_far) if so_far else None

    def profiler(self, epoch: int) -> Optional[StepProfiler]:
        """--profile: a recorder of the run's first epoch's first steps (else None)."""
        if not self.args.profile or epoch != self.resumed.epoch:
            return None
        return StepProfiler(self.run_dir / "profile" / f"trace_rank{self.info.rank}.json",
                            self.info.device, say=self.logger.print)

    def save(self, checkpoint: Checkpoint, epochs_done: int, val_acc: Optional[float] = None,
             stopped: Optional[EpochStats] = None) -> None:
        """After ``epochs_done`` epochs: last.pth as ``--save_every`` says, best.pth at a new
        best, then the epoch-end stop vote (a stop is saved now unless last.pth is this point).
        ``stopped``: the figures of an epoch a stop ended, saved at its step. Every rank calls
        ``checkpoint()`` (FSDP2 gathers there); rank 0 writes, in the background."""
        self.save_timing = {}
        if stopped is not None:
            step = stopped.stopped_at
            self.saver.save(partial(self._state, checkpoint, epochs_done, step, None, stopped),
                            epochs_done, is_best=False, now=True, step=step)
            self.stopped_at = (epochs_done, step)
            return
        if val_acc > self.best_acc:
            self.best_acc, self.best_epoch = val_acc, epochs_done
        state = partial(self._state, checkpoint, epochs_done, 0, val_acc, None)
        time_up = any_rank(self.saver.time_up_here(), self.info)  # --save_every 30m, say
        self.save_timing = self.saver.save(state, epochs_done, time_up=time_up,
                                           is_best=self.best_epoch == epochs_done)
        if self.vote.now():  # every rank, after every epoch's save
            if self.saver.last_saved == (epochs_done, 0):
                self.saver.wait()  # the save just made is the stop's
            else:
                self.saver.save(state, epochs_done, is_best=False, now=True)
            self.stopped_at = (epochs_done, 0)

    def _state(self, checkpoint: Checkpoint, epoch: int, step: int, val_acc: Optional[float],
               stopped: Optional[EpochStats], resume: bool) -> dict:
        counters = {"epoch": epoch, "step": step, "best_acc": self.best_acc,
                    "best_epoch": self.best_epoch, "val_acc": val_acc}
        if stopped is not None:
            counters["epoch_so_far"] = dataclasses.asdict(stopped)
        saved = checkpoint()  # every rank (FSDP2 gathers), then every rank's streams:
        streams = rank_random_states(self.info) if resume else None  # both collectives
        return checkpoint_state(saved, self.args, self.info, counters, self.data.num_classes,
                                streams)

    def log(self, epoch: int, stats: EpochStats, counts) -> None:
        """The epoch's line (rank 0), its row in log.jsonl, its TensorBoard scalars."""
        before = self.so_far(epoch)  # a resumed epoch's part before its stop
        seconds_before, images_before = (before.seconds, before.images) if before else (0.0, 0)
        self.train_seconds += stats.seconds - seconds_before  # this process's own
        self.train_flops += (stats.images - images_before) * self.flops_per_image
        t0, lr, reset = self.epoch_start
        skipped = (report_skipped(self.logger, gather_from_ranks(
            take_skipped(self.loader, self.data.val), self.info))
            if self.args.skip_bad_images else 0)
        seconds = time.perf_counter() - t0 + seconds_before
        peaks = gather_from_ranks([round(peak_memory_mb(self.info.device, all_gpus=self.dp), 1)],
                                  self.info)  # every rank's peak this epoch
        row = epoch_row(epoch, stats, [int(c) for c in counts], lr, seconds,
                        self.args, self.info, self.t.scaler, skipped, peaks, reset)
        row |= achieved(stats.images * self.flops_per_image, stats.seconds, self.peak,
                        self.devices) | self.parts.comm_hook.per_step()
        self.logger.epoch(row | self.save_timing, self.args.epochs, counts)


class Run(EpochBook):
    """What a training run stands on, from ``with`` to its end (module docstring)."""

    def __init__(self, args, device: Optional[torch.device] = None) -> None:
        self.args, self.lock, self.logger, self.signals, self.saver = args, None, None, None, None
        self.status = 1  # the exit status once the run ended: 0, or 128 + a stop's signal
        self.info = this_process(device or single_process_device(args.cuda))
        self.input_format = torch.channels_last if args.channels_last else torch.contiguous_format
        self.image_shape = (3, args.img_size, args.img_size)
        self.resumed, self.stop, self.stopped_at = Resumed(), StopFlag(), None
        self.train_seconds, self.t_start, self.save_timing = 0.0, time.perf_counter(), {}
        self.train_flops = 0.0
        try:
            self.fp32_math = cuda_math(args.tf32, self.info.device)  # --tf32; cuDNN's kernels
            self.run_dir, self.lock, self.tb_dir = claim_folders(args, self.info.is_main)
            # rank 0's choice of the file to resume from, every rank's to read
            self.resume_path = agreed_resume_path(args, self.run_dir, self.info)
        except BaseException:
            self._close(finished=False)
            raise

    def resume(self, model: nn.Module) -> None:
        """Before ``build()`` wraps the bare ``model``: a resumed run's weights, counters and
        random streams (or ``--init_from``'s weights) loaded into it; its training FLOPs
        per image counted (the epoch line's TFLOP/s). Every rank, together."""
        args, info = self.args, self.info
        self.flops_per_image = training_flops_per_image(model, self.image_shape)
        failed = None
        try:
            if self.resume_path is not None:
                self.resumed = load_resume(self.resume_path, args, model, info.device,
                                           info.world_size, info.rank)
        except UserError as e:  # this rank's: every rank stops, in one line
            failed = str(e)
        agree_on_resumed(failed or self.resumed.loaded, info)
        if self.resume_path is None and args.init_from is not None:  # another run's weights
            ckpt_io.load_weights_from(model, args.init_from, "--init_from")
        self.best_acc, self.best_epoch = self.resumed.best_acc, self.resumed.best_epoch

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        finished = False
        try:
            if exc_type is None:
                self.status, finished = self._finish(), True
        finally:
            self._close(finished)
        if exc_type is KeyboardInterrupt and self.saver is not None:  # a second Ctrl-C: say
            # what was saved, and go
            raise Interrupted(*self.saver.abandon()) from None

    def _finish(self) -> int:
        """The run's last lines; the exit status (a stop: 128 + its signal)."""
        trained = self.resumed.epoch < self.args.epochs
        if self.stopped_at is None and trained:
            self.saver.finish()  # the last save, which may still be in flight
            if self.vote.now():  # the run's last vote: a signal during the last epoch's end
                self.stopped_at = (self.args.epochs, 0)
            mean = achieved(self.train_flops, self.train_seconds, self.peak, self.devices)
            self.logger.print(summary_line(self.args, time.perf_counter() - self.t_start,
                                           self.train_seconds, self.best_acc, self.best_epoch,
                                           self.run_dir, self.tb_dir, mean))
        if self.stopped_at is not None:
            self.logger.print(stopped_line(self.stop, *self.stopped_at,
                                           self.run_dir / ckpt_io.LAST, self.args.epochs))
            return exit_status(self.stop.agreed)
        return 0

    def _close(self, finished: bool) -> None:
        """Handlers, logs and the run folder released; ``finished`` (every rank got to the end,
        so no peer is gone): first a barrier, so none tears down links a peer still uses."""
        if self.signals is not None:  # a rank of several ignores them as it exits, whatever
            self.signals.restore(exiting=self.info.world_size > 1)  # the end: its status stands
        if self.logger is not None:
            self.logger.close()
        if finished:
            barrier(self.info)
        if self.lock is not None:
            self.lock.release()
