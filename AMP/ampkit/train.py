"""The training driver every train script shares, around the script's own epoch loop.

A train script builds its technique in ``build(parts) -> Technique`` (the wrapper, the
optimizer, the precision objects and the step, in plain torch calls) and runs::

    with Trainer(args, device) as trainer:         # run folder, data, model, resume
        technique = trainer.start(build, sampler)   # DDP/FSDP2: the script's DistributedSampler
        for epoch in trainer.epochs():
            sampler.set_epoch(epoch)                # DDP/FSDP2 scripts
            trainer.train_epoch(technique, epoch)

- ``Trainer(args, device)``: :class:`Run`, what the run stands on -- the device (a
  one-process script's own; a DDP script's ``cuda:LOCAL_RANK``), the run folder and its
  lock, the logs, the data, and the network (``--arch``) with a resumed run's weights.
- ``start``: the training batches in the sampler's order (a one-process script: the
  trainer's own, reshuffled each epoch), ``build(parts)``, the LR schedule over the
  script's optimizer, the resumed states, ``--compile``, the signal handlers, the header.
- ``train_epoch``: :func:`ampkit.engine.train_one_epoch` with the script's step, then
  validation (counts all-reduced over the ranks), the LR schedule, the save policy
  (global rank 0 alone writes) and the epoch's logs.
- Leaving the ``with`` block: the last save waited for and the summary line, or, after a
  stop, the stop's line and exit status 128 + signal; handlers and lock released.
"""
from __future__ import annotations

import math
import sys
import time
from functools import partial
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import Sampler

from .distributed import DistInfo, StopVote, seed_streams, single_process_device
from .engine import EpochStats, Parts, Technique, count_correct, train_one_epoch
from .machinery import checkpoint as ckpt_io
from .machinery.data import build_loaders, report_skipped
from .machinery.errors import Interrupted
from .machinery.datasets import one_process_sampler
from .machinery.log import RunLogger, header_line, summary_line
from .machinery.memory import memory_kind, peak_memory_mb, reset_peak_memory
from .machinery.profiler import StepProfiler
from .machinery.resume import (Resumed, agreed_resume_path, load_resume, load_states,
                               where_it_starts)
from .machinery.saving import SavePolicy, checkpoint_state
from .machinery.signals import StopFlag, StopSignals, exit_status, stopped_line
from .models import build_model, check_dp_scope
from .precision import SkippedSteps, compile_in_place, set_tf32, slow_bf16


class Run:
    """What a training run stands on: device, run folder and lock, logs, data, the model."""

    def __init__(self, args, info: DistInfo) -> None:
        self.args, self.info, self.lock, self.logger = args, info, None, None
        try:
            self._set_up()
        except BaseException:
            self.close()
            raise

    def _set_up(self) -> None:
        args, info, device = self.args, self.info, self.info.device
        self.fp32_math = ""
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input size: let cuDNN pick its kernels
            self.fp32_math = set_tf32(args.tf32)
        self.run_dir = args.checkpoint / args.variant
        tb_dir = None
        if info.is_main:  # the run folder is this run's alone (rank 0 writes)
            self.lock = ckpt_io.claim_run_dir(self.run_dir)
            if args.tensorboard:  # checked now, created by the first write
                tb_dir = (ckpt_io.prepare_run_dir(args.tensorboard_log / args.variant)
                          / time.strftime("%Y%m%d-%H%M%S"))
        self.tb_dir = tb_dir
        path = agreed_resume_path(args, self.run_dir, info)
        self.data = build_loaders(args.dataset, args.dataset_root, args.img_size,
                                  args.batch_size, info, loader=args.loader,
                                  num_workers=args.num_workers, channels_last=args.channels_last,
                                  skip_bad=args.skip_bad_images)
        self.input_format = torch.channels_last if args.channels_last else torch.contiguous_format
        self.image_shape = (3, args.img_size, args.img_size)
        torch.manual_seed(args.seed)  # the same initial model on every rank, any world size
        model = build_model(args.arch, self.data.num_classes, pretrained=args.pretrained)
        seed_streams(args.seed, info.rank, device.type == "cuda")  # dropout: each its own
        check_dp_scope(model, args.dp_scope, args.arch)
        model = model.to(device, memory_format=self.input_format)
        self.parts = Parts(device, model, nn.CrossEntropyLoss(), args.amp_dtype, args.dp_scope,
                           lr=args.lr, arch=args.arch,
                           clip_grad=args.clip_grad if args.clip_grad else math.inf)
        self.resumed = Resumed()
        if path is not None:
            self.resumed = load_resume(path, args, model, device, info.world_size, info.is_main)
        elif args.init_from is not None:
            init = ckpt_io.resolve(args.init_from, "--init_from")
            ckpt_io.load_weights(model, ckpt_io.load(init), init)
        self.logger = RunLogger(info.is_main, tb_dir, self.run_dir / "log.jsonl",
                                resume_epoch=self.resumed.epoch if path else None)

    def close(self, finished: bool = False) -> None:
        """Close the logs and release the run folder. ``finished`` (every rank got to the
        end): first wait for all ranks, so that none tears down its connections while a
        peer still uses them. Not after a failure, when a peer may be gone."""
        if self.logger is not None:
            self.logger.close()
        if finished:
            self.info.barrier()
        if self.lock is not None:
            self.lock.release()


class Trainer:
    """A run's set-up, its epochs around the script's step, and its end (module docstring)."""

    def __init__(self, args, device: Optional[torch.device] = None) -> None:
        self.args = args
        self.info = DistInfo.of(device or single_process_device(args.cuda))
        self.run = Run(args, self.info)
        self.train_set = self.run.data.train_set  # what a DDP script's DistributedSampler draws
        r = self.run.resumed
        self.epoch, self.step, self.best_acc, self.best_epoch = \
            r.epoch, r.step, r.best_acc, r.best_epoch
        self.logger = self.run.logger
        self.saver = SavePolicy(self.run.run_dir, args.save_every, args.epochs, self.info, r)
        self.stop = StopFlag()
        self.signals = StopSignals(self.stop, self.logger.print)
        self.own_sampler: Optional[Sampler] = None
        self.stopped_at, self.train_seconds, self.t_start = None, 0.0, time.perf_counter()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        finished, code = False, 0
        try:
            if exc_type is None:
                code, finished = self._finish(), True
        finally:
            self.signals.restore()
            self.run.close(finished)
        if code:
            sys.exit(code)
        if exc_type is KeyboardInterrupt:  # a second Ctrl-C: say what was saved, and go
            raise Interrupted(*self.saver.abandon()) from None

    def start(self, build: Callable[[Parts], Technique],
              sampler: Optional[Sampler[int]] = None) -> Technique:
        """The script's technique, built and ready: ``sampler`` orders the training data
        (None: one process's order, reshuffled by the trainer every epoch)."""
        args, info, parts = self.args, self.info, self.run.parts
        if sampler is None:
            sampler = self.own_sampler = one_process_sampler(len(self.train_set), args.seed,
                                                             info.world_size)
        self.loader = self.run.data.train_loader(sampler)
        t = build(parts)
        self.logger.warn(slow_bf16(t.compute_dtype, parts.device))
        # Over the script's optimizer (FSDP2 scripts: made after sharding, over the shards).
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(t.optimizer, mode="max",
                                                                    patience=3)
        changed = load_states(self.run.resumed, t, self.scheduler, args)
        if args.compile:
            compile_in_place(t.model)
        self.logger.print(where_it_starts(self.run.resumed, args, changed))
        self.skipped = SkippedSteps(t.scaler, parts.device)
        self.vote = StopVote(self.stop, info)  # every rank's stop, agreed after each step
        self.signals.install()
        self.logger.print(header_line(args, info, t, self.run.data, self.run.fp32_math))
        return t

    def epochs(self) -> Iterator[int]:
        """The epochs left to train, from the resumed one on; none after a stop."""
        for epoch in range(self.epoch, self.args.epochs):
            yield epoch
            if self.stopped_at is not None:
                return

    def train_epoch(self, t: Technique, epoch: int) -> None:
        """Train one epoch (a resumed one from its step); then, unless a stop ended it,
        validate, step the LR schedule, save and log."""
        args, info = self.args, self.info
        step0 = self.step if epoch == self.epoch else 0
        if self.own_sampler is not None:
            self.own_sampler.set_epoch(epoch)  # a new order every epoch
        self.loader.sampler.start_index = step0 * args.batch_size * args.accum_steps
        lr = t.optimizer.param_groups[0]["lr"]
        dp = any(isinstance(m, nn.DataParallel) for m in t.model.modules())
        reset = reset_peak_memory(info.device, all_gpus=dp)  # this epoch's peak
        t0 = time.perf_counter()
        t.model.train()
        profiler = (StepProfiler(self.run.run_dir / "profile" / f"trace_rank{info.rank}.json",
                                 info.device) if args.profile and epoch == self.epoch else None)
        stats = train_one_epoch(t.step, self.loader, info, desc=f"epoch {epoch + 1}/{args.epochs}",
                                start_step=step0, log_every=args.log_every,
                                max_nonfinite=None if t.scaler else 5, stop=self.vote,
                                skipped=self.skipped, input_format=self.run.input_format,
                                profiler=profiler, accum_steps=args.accum_steps)
        self.train_seconds += stats.seconds
        if profiler is not None:
            self.logger.print(profiler.report())
        if stats.stopped_at is not None:  # saved mid-epoch: --resume continues at that step
            self.saver.save(partial(self._state, t, epoch, stats.stopped_at, None), epoch,
                            is_best=False, now=True, step=stats.stopped_at)
            self.stopped_at = (epoch, stats.stopped_at)
            return
        self._end_epoch(t, epoch, stats, lr, t0, dp, reset)

    def _end_epoch(self, t: Technique, epoch: int, stats: EpochStats, lr: float,
                   t_epoch: float, dp: bool, reset: bool) -> None:
        """Validate, step the LR schedule, save, and log the epoch."""
        info, device = self.info, self.info.device
        # Every rank counts its shard; the all_reduce sums them: exact for any world size.
        counts = info.all_reduce_sum(count_correct(
            t.model, self.run.data.val, info, t.autocast, desc="val",
            input_format=self.run.input_format, image_shape=self.run.image_shape))
        correct, total = counts.tolist()
        val_acc = correct / total
        self.scheduler.step(val_acc)  # on the validation metric (mode="max")
        epoch_seconds = time.perf_counter() - t_epoch  # training and validation
        if val_acc > self.best_acc:
            self.best_acc, self.best_epoch = val_acc, epoch + 1
        stop = self.vote.now() and epoch + 1 < self.args.epochs  # a signal in validation
        save = self.saver.save(partial(self._state, t, epoch + 1, 0, val_acc), epoch + 1,
                               is_best=self.best_epoch == epoch + 1, now=stop)
        self.stopped_at = (epoch + 1, 0) if stop else None
        skipped = report_skipped(self.logger, info, self.loader, self.run.data.val) \
            if self.args.skip_bad_images else 0
        scale = t.scaler.get_scale() if t.scaler is not None else None
        # Every rank's (a collective), the largest of the GPUs DataParallel uses.
        per_rank = info.gather([round(peak_memory_mb(device, all_gpus=dp), 1)])
        row = {"epoch": epoch + 1, "train_loss": stats.loss, "val_acc": val_acc, "lr": lr,
               "epoch_time": epoch_seconds, "train_time": stats.seconds,
               "data_time": stats.data_seconds, "images_per_s": stats.images_per_s,
               "optimizer_steps": stats.steps,
               "global_batch": self.args.batch_size * self.args.accum_steps * info.world_size,
               "grad_norm_mean": stats.grad_norm_mean, "grad_norm_max": stats.grad_norm_max,
               "skipped_steps": stats.skipped, "skipped_images": skipped,
               "peak_mem_mb": max(per_rank), "peak_mem_mb_per_rank": per_rank,
               "peak_mem_kind": memory_kind(device, reset)} | save
        self.logger.epoch(row | ({"grad_scale": scale} if scale is not None else {}),
                          self.args.epochs, (correct, total))

    def _state(self, t: Technique, epoch: int, step: int, val_acc: Optional[float],
               resume: bool) -> dict:
        counters = {"epoch": epoch, "step": step, "best_acc": self.best_acc,
                    "best_epoch": self.best_epoch, "val_acc": val_acc}
        return checkpoint_state(t, self.scheduler, self.args, self.info, counters,
                                self.run.data.num_classes, resume)

    def _finish(self) -> int:
        """The run's last line; the exit status (a stop: 128 + its signal)."""
        if self.stopped_at is not None:
            self.logger.print(stopped_line(self.stop, *self.stopped_at,
                                           self.run.run_dir / ckpt_io.LAST))
            return exit_status(self.stop.signal_name)
        if self.epoch >= self.args.epochs:  # nothing was trained
            return 0
        self.saver.finish()  # the last save, which may still be in flight
        self.logger.print(summary_line(self.args, time.perf_counter() - self.t_start,
                                       self.train_seconds, self.best_acc, self.best_epoch,
                                       self.run.run_dir, self.run.tb_dir))
        return 0
