"""What a training run stands on, and the bookkeeping around each script's own epochs.

A train script builds its technique and runs its epochs in view, in the shape of DeiT's
``main.py`` (``AMP/train_DDP.py``): ``with Run(args, device) as run``, its loader, its
``build(run.parts)``, its LR schedule, ``run.start(t, scheduler)``, then for each of
``run.epochs()``: ``run.begin_epoch``, ``train_one_epoch`` with its options named at the
call, ``run.validate`` (summed over the ranks by the script), the schedule's step,
``run.save`` and ``run.log``.

:class:`Run` is the set-up and the end: device and seed, run folder and lock, logs, data,
the network built from ``--seed``, what is resumed, signal handlers, and the last line (a
stop: the stop's line, and ``run.status`` 128 + signal, which the script returns after its
own teardown). :class:`EpochBook`, its base, is the bookkeeping the loop calls.
"""
from __future__ import annotations

import dataclasses
import math
import time
from functools import partial
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import Sampler

from .comm_hooks import CommHook, default_start_iter
from .distributed import (StopVote, agree_on_resumed, agreed_resume_path, any_rank, barrier,
                          gather_from_ranks, load_optimizer_state, local_main_first,
                          rank_random_states, this_process)
from .engine import EpochStats, Parts, Technique, count_correct
from .machinery import checkpoint as ckpt_io
from .machinery.data import build_loaders, report_skipped, take_skipped
from .machinery.devices import single_process_device
from .machinery.errors import Interrupted, UserError
from .machinery.flops import achieved, run_peak, training_flops_per_image
from .machinery.log import RunLogger, epoch_row, header_line, summary_line
from .machinery.memory import peak_memory_mb, reset_peak_memory
from .machinery.profiler import StepProfiler
from .machinery.ranks import DistInfo, seed_streams
from .machinery.run_folder import claim_run_dir, prepare_run_dir
from .machinery.resume import Resumed, load_resume, load_states, where_it_starts
from .machinery.saving import SavePolicy, checkpoint_state
from .machinery.samplers import one_process_sampler
from .machinery.signals import StopFlag, StopSignals, exit_status, stopped_line
from .models import build_model, check_dp_scope
from .precision import SkippedSteps, compile_in_place, set_tf32, slow_bf16

Checkpoint = Callable[[], dict]  # the script's: {"model": the unwrapped weights, ...}


class EpochBook:
    """The bookkeeping around a script's epoch: the loop's options, validation, when to
    save, the epoch's log row. :class:`Run` sets its attributes."""

    def train_loader(self, sampler: Optional[Sampler[int]] = None):
        """The training batches in ``sampler``'s order (None: one process's, reshuffled
        every epoch by :meth:`loop`)."""
        if sampler is None:
            sampler = self.own_sampler = one_process_sampler(len(self.train_set),
                                                             self.args.seed, self.info.world_size)
        self.loader = self.data.train_loader(sampler)
        return self.loader

    def start(self, t: Technique, scheduler) -> None:
        """The script's technique and LR schedule, with a resumed run's states; --compile;
        the stop vote and signal handlers; the header line."""
        args, info = self.args, self.info
        self.t, self.dp = t, any(isinstance(m, nn.DataParallel) for m in t.model.modules())
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
        """Start ``epoch``: one process's new order (a DDP script sets its sampler's), the
        clock, the memory peak, ``model.train()``; the step it starts from (a resumed
        epoch's, else 0), where the loader starts too."""
        step0 = self.resumed.step if epoch == self.resumed.epoch else 0
        if self.own_sampler is not None:
            self.own_sampler.set_epoch(epoch)  # a new order every epoch
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

    def validate(self, t: Technique) -> torch.Tensor:
        """``tensor([correct, seen])`` of this rank's shard of the validation split (every
        rank runs as many forwards: see ``count_correct``)."""
        return count_correct(t.model, self.data.val, self.info, t.autocast, desc="val",
                             input_format=self.input_format, image_shape=self.image_shape)

    def save(self, checkpoint: Checkpoint, epochs_done: int, val_acc: Optional[float] = None,
             stopped: Optional[EpochStats] = None) -> None:
        """After ``epochs_done`` epochs: last.pth as ``--save_every`` says, best.pth at a new
        best; then the ranks' epoch-end stop vote (a signal during validation or this save):
        a stop is saved now, unless last.pth is this point already. ``stopped``: the
        figures of an epoch a stop ended, saved at its step now. Every rank calls
        ``checkpoint()`` when something is saved (FSDP2 gathers its shards there); rank 0
        writes, in the background."""
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
        self.args, self.lock, self.logger, self.signals = args, None, None, None
        self.status = 1  # the exit status once the run ended: 0, or 128 + a stop's signal
        self.info = this_process(device or single_process_device(args.cuda))
        try:
            self._set_up()
        except BaseException:
            self._close(finished=False)
            raise

    def _set_up(self) -> None:
        args, info, device = self.args, self.info, self.info.device
        self.fp32_math = set_tf32(args.tf32) if device.type == "cuda" else ""
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # a fixed input size: let cuDNN pick kernels
        self.run_dir, self.lock, self.tb_dir = _folders(args, info)
        path = agreed_resume_path(args, self.run_dir, info)  # rank 0's choice, every rank's file
        with local_main_first(info):  # a download: one process per node, the others after
            self.data = build_loaders(args.dataset, args.dataset_root, args.img_size,
                                      args.batch_size, info, loader=args.loader,
                                      num_workers=args.num_workers,
                                      channels_last=args.channels_last,
                                      skip_bad=args.skip_bad_images)
        self.train_set = self.data.train_set  # what a DDP script's DistributedSampler draws
        self.input_format = torch.channels_last if args.channels_last else torch.contiguous_format
        self.image_shape = (3, args.img_size, args.img_size)
        self.parts = _parts(args, info, self.data.num_classes, self.input_format,
                            len(self.train_set))
        self.flops_per_image = training_flops_per_image(self.parts.model, self.image_shape)
        self.resumed, failed = Resumed(), None
        try:
            if path is not None:
                self.resumed = load_resume(path, args, self.parts.model, device,
                                           info.world_size, info.rank)
        except UserError as e:  # this rank's: every rank stops, in one line
            failed = str(e)
        agree_on_resumed(failed or self.resumed.loaded, info)
        if path is None and args.init_from is not None:
            init = ckpt_io.resolve(args.init_from, "--init_from")
            ckpt_io.load_weights(self.parts.model, ckpt_io.load(init), init)
        self.logger = RunLogger(info.is_main, self.tb_dir, self.run_dir / "log.jsonl",
                                resume_epoch=self.resumed.epoch if path else None)
        self.best_acc, self.best_epoch = self.resumed.best_acc, self.resumed.best_epoch
        self.saver = SavePolicy(self.run_dir, args.save_every, args.epochs, info, self.resumed)
        self.stop, self.own_sampler, self.stopped_at = StopFlag(), None, None
        self.signals = StopSignals(self.stop, self.logger.print)
        self.train_seconds, self.t_start, self.save_timing = 0.0, time.perf_counter(), {}
        self.train_flops = 0.0

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        finished = False
        try:
            if exc_type is None:
                self.status, finished = self._finish(), True
        finally:
            self._close(finished)
        if exc_type is KeyboardInterrupt:  # a second Ctrl-C: say what was saved, and go
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
        """Handlers, logs and the run folder released. ``finished`` (every rank got to the
        end): first all ranks wait for each other, so that none tears down its connections
        while a peer still uses them. Not after a failure, when a peer may be gone."""
        if self.signals is not None:  # a rank of several ignores them as it exits, whatever
            self.signals.restore(exiting=self.info.world_size > 1)  # the end: its status stands
        if self.logger is not None:
            self.logger.close()
        if finished:
            barrier(self.info)
        if self.lock is not None:
            self.lock.release()


def _folders(args, info: DistInfo) -> tuple:
    """(the run folder, its lock, the TensorBoard folder): global rank 0 claims the run
    folder (one run in it at a time) and checks the TensorBoard one, which its first write
    creates; the other ranks write nothing."""
    run_dir = args.checkpoint / args.variant
    if not info.is_main:
        return run_dir, None, None
    lock = claim_run_dir(run_dir)
    try:
        tb_dir = (prepare_run_dir(args.tensorboard_log / args.variant)
                  / time.strftime("%Y%m%d-%H%M%S")) if args.tensorboard else None
    except BaseException:
        lock.release()
        raise
    return run_dir, lock, tb_dir


def _parts(args, info: DistInfo, num_classes: int, memory_format: torch.memory_format,
           train_size: int) -> Parts:
    """The network, built from ``--seed`` alone (the same initial weights on every rank, for
    any world size; then this rank's own random streams), on the device; and the rest of
    what a script's ``build()`` starts from (the comm hook's warm-up: from the run's steps)."""
    torch.manual_seed(args.seed)
    model = build_model(args.arch, num_classes, pretrained=args.pretrained)
    seed_streams(args.seed, info.rank, info.device.type == "cuda")  # dropout: each its own
    check_dp_scope(model, args.dp_scope, args.arch)
    model = model.to(info.device, memory_format=memory_format)
    steps = math.ceil(math.ceil(math.ceil(train_size / info.world_size) / args.batch_size)
                      / args.accum_steps) * args.epochs  # a DistributedSampler's shards
    hook = CommHook(args.comm_hook, powersgd_rank=args.powersgd_rank or 1, seed=args.seed,
                    start_iter=args.powersgd_start_iter or default_start_iter(steps))
    return Parts(info.device, model, nn.CrossEntropyLoss(), args.amp_dtype, args.dp_scope,
                 lr=args.lr, arch=args.arch, clip_grad=args.clip_grad, comm_hook=hook,
                 reduce_dtype=getattr(torch, args.reduce_dtype))
