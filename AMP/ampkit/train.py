"""The training driver every train script shares: ``Trainer(...).fit(build)``.

A train script holds its technique in ``build(parts) -> Variant``: the wrapper
(none, ``nn.DataParallel``, ``DistributedDataParallel`` or FSDP2's ``fully_shard``), the
precision objects (``torch.autocast``, ``torch.amp.GradScaler``, FSDP2's
``MixedPrecisionPolicy``) and the step that uses them. The rest is here, the same for
every variant:

- ``Trainer.__init__``: flags, device and process group, the run folder and its lock,
  data, the network (``--arch``), and the weights and counters of a run being resumed;
- ``Trainer.fit``: calls ``build``, makes the LR schedule and loads the resumed optimizer,
  schedule and scaler states, then the epoch loop: ``train_one_epoch``
  (:mod:`ampkit.engine`) with the script's step, validation, the LR schedule,
  checkpoints (in the background), logs, signals and the summary line.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .machinery import checkpoint as ckpt_io
from .machinery.config import args_to_plain, parse_interval, parse_train_args
from .machinery.data import build_loaders, take_skipped
from .distributed import cleanup, setup
from .engine import EpochStats, Parts, StopFlag, Variant, count_correct, train_one_epoch
from .machinery.errors import UserError
from .machinery.log import RunLogger, format_duration
from .machinery.measure import StepProfiler, peak_memory_mb
from .models import build_model
from .precision import SkippedSteps, cpu_has_fast_bf16, set_tf32

# What only resuming needs: last.pth has it, best.pth (weights and metadata) does not.
RESUME_ONLY = ("optimizer", "scheduler", "scaler", "rng")


def _resume_path(args, run_dir: Path) -> Optional[Path]:
    if args.resume == "auto":
        path = run_dir / ckpt_io.LAST
        if not path.is_file():
            raise UserError(f"--resume: no checkpoint to resume at {path}")
        return path
    if args.resume:
        return ckpt_io.resolve(Path(args.resume), "--resume")
    # Restarted by torchrun (--max-restarts): continue from the latest checkpoint.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and (run_dir / ckpt_io.LAST).is_file():
        return run_dir / ckpt_io.LAST
    return None


def resume_mismatches(state: dict, args, variant: str, world_size: int) -> list:
    """What differs between a checkpoint and the run about to continue it, in words."""
    trained, diffs = state.get("args") or {}, []
    if state.get("variant", variant) != variant:
        diffs.append(f"it is a {state['variant']} run, this is {variant}")
    for key in ("dataset", "img_size"):
        if key in trained and trained[key] != getattr(args, key):
            diffs.append(f"--{key} {trained[key]} (this run: {getattr(args, key)})")
    root = trained.get("dataset_root")
    if root and args.dataset != "FakeData" and \
            Path(root).resolve() != Path(args.dataset_root).resolve():
        diffs.append(f"--dataset_root {root} (this run: {args.dataset_root})")
    world, batch = state.get("world_size"), trained.get("batch_size")
    if world is not None and batch is not None:
        if world * batch != world_size * args.batch_size:
            diffs.append(f"a global batch of {batch} x {world} processes (this run: "
                         f"{args.batch_size} x {world_size})")
        elif world != world_size and state.get("step", 0):
            diffs.append(f"{world} processes, stopped mid-epoch (this run: {world_size})")
    return diffs


class Trainer:
    """Set-up and epoch loop for one training variant (see the module docstring)."""

    def __init__(self, variant: str, argv: Optional[Sequence[str]] = None, *,
                 ddp: bool = False) -> None:
        self.variant = variant
        self.args = parse_train_args(variant, ddp=ddp, argv=argv)
        self.info = setup(ddp, self.args.cuda)
        try:
            self._set_up()
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------ set-up
    def _set_up(self) -> None:
        args, info = self.args, self.info
        device = info.device
        torch.manual_seed(args.seed + info.rank)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input size: let cuDNN pick its kernels
            self.fp32_math = set_tf32(args.tf32)
        self.writer, self.pending_best = ckpt_io.BackgroundWriter(), None
        self.snapshots = {"last": ckpt_io.Snapshot(), "best": ckpt_io.Snapshot()}
        self.last_save = time.perf_counter()
        self._prepare_folders()
        self.data = build_loaders(args.dataset, args.dataset_root, args.img_size, args.batch_size,
                                  info, loader=args.loader, num_workers=args.num_workers,
                                  seed=args.seed, channels_last=args.channels_last,
                                  skip_bad=args.skip_bad_images)
        self.input_format = torch.channels_last if args.channels_last else torch.contiguous_format
        model = build_model(args.arch, self.data.num_classes, pretrained=args.pretrained)
        if args.dp_scope == "features" and not isinstance(getattr(model, "features", None),
                                                          nn.Module):
            raise UserError(f"--dp_scope features: --arch {args.arch} has no .features block "
                            "(alexnet, vgg, densenet ... have one)")
        model = model.to(device, memory_format=self.input_format)
        self.parts = Parts(device, model, nn.CrossEntropyLoss(), args.amp_dtype, args.dp_scope,
                           lr=args.lr, arch=args.arch)
        self.epoch, self.step, self.best_acc, self.best_epoch = 0, 0, -1.0, -1
        self.resumed: dict = {}  # optimizer, scheduler, scaler: loaded once build() made them
        if self.resume_path is not None:
            self._load_resume_state()
        elif args.init_from is not None:
            path = ckpt_io.resolve(args.init_from, "--init_from")
            ckpt_io.load_weights(model, ckpt_io.load(path), path)
        self.logger = RunLogger(info.is_main, self.tb_dir, self.run_dir / "log.jsonl",
                                resume_epoch=self.epoch if self.resume_path else None)

    def _prepare_folders(self) -> None:
        """The run folder, owned by this run alone (rank 0, which writes); TensorBoard's."""
        args = self.args
        self.run_dir, self.tb_dir, self.lock = args.checkpoint / self.variant, None, None
        if self.info.is_main:
            ckpt_io.prepare_run_dir(self.run_dir)
            self.lock = ckpt_io.RunLock(self.run_dir)
            ckpt_io.remove_stale_temps(self.run_dir)  # the lock's holder: no live run owns them
            if args.tensorboard:  # checked now, created by the first write
                self.tb_dir = (ckpt_io.prepare_run_dir(args.tensorboard_log / self.variant)
                               / time.strftime("%Y%m%d-%H%M%S"))
        self.resume_path = _resume_path(args, self.run_dir)

    def _release(self, finished: bool = False) -> None:
        cleanup(self.info, finished)
        if getattr(self, "lock", None) is not None:
            self.lock.release()

    def _load_resume_state(self) -> None:
        """Load a checkpoint's weights (into the bare model), counters and RNG; the states of
        the optimizer, LR schedule and GradScaler wait for fit(), as the script's build()
        makes the optimizer (after FSDP2's sharding) and the scaler."""
        path, parts = self.resume_path, self.parts
        state = ckpt_io.load(path, map_location="cpu")
        if "optimizer" not in state:
            raise UserError(f"{path}: holds weights only (no optimizer state); cannot resume "
                            f"from it (--init_from {path} starts a new run from its weights)")
        diffs = resume_mismatches(state, self.args, self.variant, self.info.world_size)
        if diffs:
            raise UserError(f"--resume {path} does not fit this run: {'; '.join(diffs)}. Resume "
                            f"with the same settings, or start a new run from its weights with "
                            f"--init_from {path}")
        ckpt_io.load_weights(parts.model, state, path)
        self.resumed = {k: state.get(k) for k in ("optimizer", "scheduler", "scaler")}
        self.epoch, self.step = int(state["epoch"]), int(state.get("step", 0))
        self.best_acc = float(state.get("best_acc", -1.0))
        self.best_epoch = int(state.get("best_epoch", -1))
        if self.info.is_main and "rng" in state:  # other ranks keep their seed + rank streams
            torch.set_rng_state(state["rng"]["torch"])
            if parts.device.type == "cuda" and state["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(state["rng"]["cuda"], parts.device)

    # ------------------------------------------------------------------ the run
    def fit(self, build: Callable[[Parts], Variant]) -> None:
        """Build the variant with the script's ``build``, then train it for ``--epochs``."""
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        code = None
        try:
            code = self._fit(build)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            self.logger.close()
            self._release(finished=code is not None)
        if code:
            sys.exit(code)

    def _fit(self, build: Callable[[Parts], Variant]) -> int:
        args = self.args
        if self.epoch >= args.epochs:
            self.logger.print(f"{self.variant}: {self.resume_path} has already trained "
                              f"{self.epoch} of --epochs {args.epochs}; nothing to do "
                              "(raise --epochs to train on)")
            return 0
        v = self._start(build)
        t_start, train_seconds = time.perf_counter(), 0.0
        for epoch in range(self.epoch, args.epochs):
            stats = self._train_epoch(v, epoch)
            train_seconds += stats.seconds
            if stats.stopped_at is not None:
                self._save(v, epoch, stats.stopped_at, val_acc=None, now=True)
                self.logger.print(f"stopped by {self.stop.signal_name} at epoch {epoch + 1}, step "
                                  f"{stats.stopped_at}; saved {self.run_dir / ckpt_io.LAST}. "
                                  "Continue with --resume")
                return 128 + int(getattr(signal, self.stop.signal_name or "SIGTERM"))
            self._end_epoch(v, epoch, stats)
        self.writer.wait()  # the last save, which may still be in flight
        if self.info.is_main:
            ckpt_io.remove_spares(self.run_dir)
        self.logger.print(
            f"done: {self.variant}, {args.epochs} epochs, "
            f"{format_duration(time.perf_counter() - t_start)} (training alone "
            f"{format_duration(train_seconds)}), best val_acc {max(self.best_acc, 0):.4f} at "
            f"epoch {self.best_epoch}; checkpoints in {self.run_dir}"
            + (f"; TensorBoard in {self.tb_dir}" if self.tb_dir else ""))
        return 0

    def _start(self, build: Callable[[Parts], Variant]) -> Variant:
        args, info, parts = self.args, self.info, self.parts
        v = build(parts)
        if v.amp_dtype is torch.bfloat16 and parts.device.type == "cpu" and \
                cpu_has_fast_bf16() is False:
            self.logger.warn("this CPU has no native bfloat16 (AVX512-BF16/AMX): CPU autocast "
                             "will be several times slower than fp32 here")
        # Made by build() (FSDP2 scripts: after sharding), else here; then the resumed states.
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(parts.optimizer, mode="max",
                                                                    patience=3)
        if self.resumed:
            ckpt_io.load_optimizer_state(parts.optimizer, self.resumed["optimizer"], v.model)
            self.scheduler.load_state_dict(self.resumed["scheduler"])
            if v.scaler is not None and self.resumed["scaler"]:
                v.scaler.load_state_dict(self.resumed["scaler"])
            self.resumed = {}
        if args.compile:
            if isinstance(v.model, nn.DataParallel):
                raise UserError("--compile is supported for single-device and DDP runs, "
                                "not DataParallel")
            v.model.compile()  # in place, so the script's step calls the compiled model
        if self.resume_path is not None:
            self.logger.print(f"resumed from {self.resume_path}: epoch {self.epoch + 1}, "
                              f"step {self.step}")
        elif args.init_from is not None:
            self.logger.print(f"starting from the weights of {args.init_from} (epoch 1, a new "
                              "optimizer)")
        self.stop = StopFlag()
        self._install_signal_handlers()
        self.skipped = SkippedSteps(v.scaler, parts.device)
        d = self.data
        gpu = parts.device.type == "cuda"
        gpus = (f" x{torch.cuda.device_count()} GPUs" if isinstance(v.model, nn.DataParallel)
                and gpu else "")
        self.logger.print(
            f"{self.variant}: {args.dataset} ({d.train_size} train / {d.val_size} val images, "
            f"{d.num_classes} classes) at {args.img_size}px on {parts.device}"
            f"{f' x{info.world_size} processes' if info.distributed else ''}{gpus}, "
            f"precision {v.precision}{f' ({str(v.amp_dtype)[6:]})' if v.amp_dtype else ''}"
            f"{f' ({self.fp32_math})' if v.amp_dtype is None and gpu else ''}, "
            f"batch {args.batch_size}{' per process' if info.distributed else ''}, "
            f"{d.kind} loader")
        return v

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.stop.requested and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self.stop.request(name)
            self.logger.print(f"\n{name} received: stopping after the current step")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def _train_epoch(self, v: Variant, epoch: int) -> EpochStats:
        args, loader = self.args, self.data.train
        step0 = self.step if epoch == self.epoch else 0
        loader.sampler.set_epoch(epoch)  # a new permutation every epoch (same on every rank)
        loader.sampler.start_index = step0 * args.batch_size
        self.lr = self.parts.optimizer.param_groups[0]["lr"]
        self.t_epoch = time.perf_counter()
        v.model.train()
        profiler = None
        if args.profile and epoch == self.epoch:  # this run's first epoch
            profiler = StepProfiler(self.run_dir / "profile" / f"trace_rank{self.info.rank}.json",
                                    self.parts.device)
        stats = train_one_epoch(v.step, loader, self.info, desc=f"epoch {epoch + 1}/{args.epochs}",
                                start_step=step0, log_every=args.log_every,
                                max_nonfinite=None if v.scaler else 5, stop=self.stop,
                                skipped=self.skipped, input_format=self.input_format,
                                profiler=profiler)
        if profiler is not None:
            self.logger.print(profiler.report())
        return stats

    def _end_epoch(self, v: Variant, epoch: int, stats: EpochStats) -> None:
        """Validate, step the LR schedule, save, and log the epoch."""
        info = self.info
        counts = info.all_reduce_sum(count_correct(v.model, self.data.val, info, v.autocast,
                                                   desc="val", input_format=self.input_format))
        correct, total = counts.tolist()
        val_acc = correct / total
        self.scheduler.step(val_acc)  # on the validation metric (mode="max")
        epoch_seconds = time.perf_counter() - self.t_epoch
        if val_acc > self.best_acc:
            self.best_acc, self.best_epoch = val_acc, epoch + 1
        save = self._save(v, epoch + 1, 0, val_acc=val_acc)
        skipped = self._skipped_images()
        scale = v.scaler.get_scale() if v.scaler is not None else None
        # Every rank's (a collective: every rank takes part) and, under DataParallel, the
        # largest of the GPUs it uses; FSDP2's saving shows per rank.
        device = self.parts.device
        dp = any(isinstance(m, nn.DataParallel) for m in v.model.modules())
        per_rank = info.gather([round(peak_memory_mb(device, all_gpus=dp), 1)])
        peak_mem = max(per_rank)
        self.logger.print(
            f"epoch {epoch + 1}/{self.args.epochs}  train_loss {stats.loss:.4f}  "
            f"val_acc {val_acc:.4f} ({correct}/{total})  lr {self.lr:.2e}  "
            f"time {epoch_seconds:.1f}s  {stats.images_per_s:.0f} img/s"
            + (f"  skipped_steps {stats.skipped}  scale {scale:.0f}" if scale is not None else ""))
        row = {"epoch": epoch + 1, "train_loss": stats.loss, "val_acc": val_acc, "lr": self.lr,
               "epoch_time": epoch_seconds, "train_time": stats.seconds,
               "data_time": stats.data_seconds, "images_per_s": stats.images_per_s,
               "skipped_steps": stats.skipped, "skipped_images": skipped,
               "peak_mem_mb": peak_mem, "peak_mem_mb_per_rank": per_rank,
               "peak_mem_kind": "cuda_allocated" if device.type == "cuda" else "max_rss"} | save
        self.logger.record(row | ({"grad_scale": scale} if scale is not None else {}))
        self.logger.scalars({"train/loss": stats.loss, "train/lr": self.lr,
                             "val/accuracy": val_acc, "time/epoch_seconds": epoch_seconds,
                             "throughput/images_per_second": stats.images_per_s}
                            | ({"amp/grad_scale": scale, "amp/skipped_steps": stats.skipped}
                               if scale is not None else {}), epoch + 1)

    def _skipped_images(self) -> int:
        """--skip_bad_images: name the images left out this epoch, on every rank; how many."""
        if not self.args.skip_bad_images:
            return 0
        skipped = self.info.gather(take_skipped(self.data))
        if skipped:
            more = f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
            self.logger.print(f"skipped {len(skipped)} unreadable image(s) this epoch: "
                              + "; ".join(str(u) for u in skipped[:5]) + more)
        return len(skipped)

    def _save(self, v: Variant, epoch: int, step: int, val_acc: Optional[float],
              now: bool = False) -> dict:
        """Hand last.pth (the full state after ``epoch`` epochs and ``step`` steps) and, if this
        epoch's accuracy is the best so far, best.pth (weights and metadata) to the background
        writer: as --save_every says (epochs, or time since the last save), after the last
        epoch, and ``now`` (a stop, which also waits for the write). A best epoch between
        saves is kept in memory until the next save. Returns the save's timing for the
        epoch's log row (rank 0)."""
        every_epochs, every_seconds = parse_interval(self.args.save_every)
        is_best = val_acc is not None and self.best_epoch == epoch
        due = (now or epoch == self.args.epochs
               or (every_epochs and epoch % every_epochs == 0)
               or (every_seconds and self._time_to_save(every_seconds)))
        if not (is_best or due):
            return {}
        # The snapshot buffers are the ones the previous save is written from: wait for it.
        timing = {"save_wait_s": self.writer.wait(),  # 0: the previous save overlapped training
                  "save_write_s": self.writer.write_seconds}  # how long that write took
        t0 = time.perf_counter()
        # Every rank: an FSDP2 model's full state is gathered from all ranks' shards.
        state = self._state(v, epoch, step, val_acc, resume=due)
        if due:
            self.last_save = time.perf_counter()
        if not self.info.is_main:
            return {}
        if is_best:
            self.pending_best = self.snapshots["best"].take(
                {k: x for k, x in state.items() if k not in RESUME_ONLY})
        if due:  # last.pth first: a best.pth never stands without a last.pth to resume from
            best = [(self.pending_best, self.run_dir / ckpt_io.BEST)] if self.pending_best else []
            self.pending_best = None
            self.writer.submit([(self.snapshots["last"].take(state),
                                 self.run_dir / ckpt_io.LAST)] + best)
            if now:
                self.writer.wait()
        timing["save_snapshot_s"] = time.perf_counter() - t0
        return timing

    def _time_to_save(self, every_seconds: int) -> bool:
        """Whether --save_every's time has come, on any rank's clock: all ranks agree."""
        due = torch.tensor(int(time.perf_counter() - self.last_save >= every_seconds))
        return bool(self.info.all_reduce_max(due.to(self.parts.device)).item())

    def _state(self, v: Variant, epoch: int, step: int, val_acc: Optional[float],
               resume: bool) -> dict:
        """The checkpoint's content (live tensors); ``resume``: with what only resuming needs."""
        device = self.parts.device
        state = {"model": ckpt_io.model_state(v.model), "arch": self.args.arch,
                 "epoch": epoch, "step": step,
                 "best_acc": self.best_acc, "best_epoch": self.best_epoch, "val_acc": val_acc,
                 "num_classes": self.data.num_classes, "variant": self.variant,
                 "world_size": self.info.world_size,
                 "args": args_to_plain(self.args), "torch_version": str(torch.__version__)}
        if resume:
            state |= {"optimizer": ckpt_io.optimizer_state(self.parts.optimizer, v.model),
                      "scheduler": self.scheduler.state_dict(),
                      "scaler": v.scaler.state_dict() if v.scaler is not None else None,
                      "rng": {"torch": torch.get_rng_state(),
                              "cuda": (torch.cuda.get_rng_state(device)
                                       if device.type == "cuda" else None)}}
        return state
