"""Training: one driver for all nine variants (parallel mode x precision mode)."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from alexnet import alexnet

from . import checkpoint as ckpt_io
from .config import args_to_plain, parse_train_args
from .data import build_loaders
from .distributed import DistInfo, cleanup, setup
from .engine import StopFlag, evaluate, train_one_epoch
from .errors import UserError, report_user_errors
from .log import RunLogger, format_duration
from .precision import autocast_factory, cpu_has_fast_bf16, make_scaler, resolve_amp_dtype
from .variants import train_name


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far: allocated on the GPU, or max RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def wrap_model(model: nn.Module, parallel: str, info: DistInfo,
               dp_scope: str = "model") -> nn.Module:
    if parallel == "dp":
        # Over all visible GPUs; without CUDA, DataParallel calls the module directly.
        if dp_scope == "features":
            # pytorch/examples' ImageNet recipe for AlexNet/VGG: replicate only the conv
            # layers; the 54M-parameter classifier stays on one GPU (no per-step broadcast).
            model.features = nn.DataParallel(model.features)
            return model
        return nn.DataParallel(model)
    if parallel == "ddp":
        return DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    return model


def _install_signal_handlers(stop: StopFlag, logger: RunLogger) -> None:
    def handler(signum, frame):
        name = signal.Signals(signum).name
        if stop.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        stop.request(name)
        logger.print(f"\n{name} received: finishing the current step, then saving")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _resume_path(args, run_dir: Path) -> Optional[Path]:
    if args.resume == "auto":
        path = run_dir / ckpt_io.LAST
        if not path.is_file():
            raise UserError(f"--resume: no checkpoint to resume at {path}")
        return path
    if args.resume:
        return ckpt_io.resolve(Path(args.resume))
    # Restarted by torchrun (--max-restarts): continue from the latest checkpoint.
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and (run_dir / ckpt_io.LAST).is_file():
        return run_dir / ckpt_io.LAST
    return None


def run(args, parallel: str, precision: str, info: DistInfo) -> int:
    variant = train_name(parallel, precision)
    device = info.device
    torch.manual_seed(args.seed + info.rank)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input size: let cuDNN pick its fastest kernels

    amp_dtype = resolve_amp_dtype(args.amp_dtype, device) if precision != "fp32" else None
    run_dir = args.checkpoint / variant
    tb_dir = None
    if info.is_main:
        ckpt_io.prepare_run_dir(run_dir)
        ckpt_io.remove_stale_temps(run_dir)
        if args.tensorboard:  # checked now, created by the first write
            tb_dir = (ckpt_io.prepare_run_dir(args.tensorboard_log / variant)
                      / time.strftime("%Y%m%d-%H%M%S"))
    resume_path = _resume_path(args, run_dir)
    logger = RunLogger(info.is_main, tb_dir, run_dir / "log.jsonl", append=resume_path is not None)
    try:
        return _train(args, parallel, precision, info, variant, amp_dtype, run_dir, tb_dir,
                      resume_path, logger)
    finally:
        logger.close()


def _train(args, parallel, precision, info, variant, amp_dtype, run_dir, tb_dir, resume_path,
           logger: RunLogger) -> int:
    device = info.device
    if amp_dtype is torch.bfloat16 and device.type == "cpu" and cpu_has_fast_bf16() is False:
        logger.warn("this CPU has no native bfloat16 (AVX512-BF16/AMX): CPU autocast will be "
                    "several times slower than fp32 here")

    if args.compile and parallel == "dp":
        raise UserError("--compile is supported for single-device and DDP runs, not DataParallel")
    data = build_loaders(args.dataset, args.dataset_root, args.img_size, args.batch_size, info,
                         loader=args.loader, num_workers=args.num_workers, seed=args.seed,
                         channels_last=args.channels_last)
    train_dl, val_dl = data.train, data.val

    model = alexnet(pretrained=args.pretrained, num_classes=data.num_classes,
                    amp_dtype=amp_dtype)
    input_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=input_format)
    # fused: one kernel for all parameters; with a GradScaler it also takes the inf/NaN
    # flag on the device, so scaler.step() does not sync the host (it does otherwise).
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                  fused=True if device.type == "cuda" else None)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=3)
    scaler = make_scaler(device, enabled=precision == "grad_scaler")
    criterion = nn.CrossEntropyLoss()

    start_epoch, start_step, best_acc, best_epoch = 0, 0, -1.0, -1
    if resume_path is not None:
        state = ckpt_io.load(resume_path, map_location="cpu")
        if "optimizer" not in state:
            raise UserError(f"{resume_path}: holds weights only (no optimizer state); cannot resume")
        ckpt_io.load_weights(model, state, resume_path)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler.is_enabled() and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        start_epoch, start_step = int(state["epoch"]), int(state.get("step", 0))
        best_acc, best_epoch = float(state.get("best_acc", -1.0)), int(state.get("best_epoch", -1))
        if info.is_main and "rng" in state:  # other ranks keep their seed + rank streams
            torch.set_rng_state(state["rng"]["torch"])
            if device.type == "cuda" and state["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(state["rng"]["cuda"], device)
        if start_epoch >= args.epochs:
            logger.print(f"{variant}: {resume_path} has already trained {start_epoch} of "
                         f"--epochs {args.epochs}; nothing to do (raise --epochs to train on)")
            return 0
        logger.print(f"resumed from {resume_path}: epoch {start_epoch + 1}, step {start_step}")

    model = wrap_model(model, parallel, info, dp_scope=args.dp_scope)
    if args.compile:
        model = torch.compile(model)  # after DDP wrapping, as PyTorch recommends
    autocast = autocast_factory(device, amp_dtype)
    stop = StopFlag()
    _install_signal_handlers(stop, logger)

    logger.print(f"{variant}: {args.dataset} ({data.train_size} train / {data.val_size} val "
                 f"images, {data.num_classes} classes) at {args.img_size}px on {device}"
                 f"{f' x{info.world_size} processes' if info.distributed else ''}"
                 f"{f' x{torch.cuda.device_count()} GPUs' if parallel == 'dp' and device.type == 'cuda' else ''}, "
                 f"precision {precision}{f' ({str(amp_dtype)[6:]})' if amp_dtype else ''}, "
                 f"batch {args.batch_size}{' per process' if info.distributed else ''}, {data.kind} loader")

    def save(epoch: int, step: int, is_best: bool, val_acc: Optional[float]) -> None:
        if not info.is_main:
            return
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
        state = {"model": ckpt_io.model_state(model), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(),
                 "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                 "epoch": epoch, "step": step, "best_acc": best_acc, "best_epoch": best_epoch,
                 "val_acc": val_acc, "num_classes": data.num_classes, "variant": variant,
                 "args": args_to_plain(args), "rng": rng, "torch_version": str(torch.__version__)}
        if is_best:  # weights and metadata only; written first, so last.pth is the newest file
            best = {k: v for k, v in state.items() if k not in ("optimizer", "scheduler", "scaler", "rng")}
            ckpt_io.atomic_save(best, run_dir / ckpt_io.BEST)
        ckpt_io.atomic_save(state, run_dir / ckpt_io.LAST)

    t_start = time.perf_counter()
    train_seconds = 0.0
    for epoch in range(start_epoch, args.epochs):
        step0 = start_step if epoch == start_epoch else 0
        train_dl.sampler.set_epoch(epoch)  # a new permutation every epoch (same on every rank)
        train_dl.sampler.start_index = step0 * args.batch_size
        lr = optimizer.param_groups[0]["lr"]
        t_epoch = time.perf_counter()
        stats = train_one_epoch(model, train_dl, criterion, optimizer, scaler, autocast, info,
                                desc=f"epoch {epoch + 1}/{args.epochs}", start_step=step0,
                                log_every=args.log_every, stop=stop, input_format=input_format)
        train_seconds += stats.seconds
        if stats.stopped_at is not None:
            save(epoch, stats.stopped_at, False, None)
            logger.print(f"stopped by {stop.signal_name} at epoch {epoch + 1}, step "
                         f"{stats.stopped_at}; saved {run_dir / ckpt_io.LAST}. "
                         f"Continue with --resume")
            return 128 + int(getattr(signal, stop.signal_name or "SIGTERM"))
        correct, total = evaluate(model, val_dl, autocast, info, desc="val",
                                  input_format=input_format)
        val_acc = correct / total
        scheduler.step(val_acc)  # on the validation metric (mode="max")
        epoch_seconds = time.perf_counter() - t_epoch
        is_best = val_acc > best_acc
        if is_best:
            best_acc, best_epoch = val_acc, epoch + 1
        save(epoch + 1, 0, is_best, val_acc)

        scale = scaler.get_scale() if scaler.is_enabled() else None
        # The largest of all ranks (a collective: every rank computes it).
        peak_mem = info.all_reduce_max(torch.tensor(peak_memory_mb(device), device=device)).item()
        logger.print(
            f"epoch {epoch + 1}/{args.epochs}  train_loss {stats.loss:.4f}  "
            f"val_acc {val_acc:.4f} ({correct}/{total})  lr {lr:.2e}  "
            f"time {epoch_seconds:.1f}s  {stats.images_per_s:.0f} img/s"
            + (f"  skipped_steps {stats.skipped}  scale {scale:.0f}" if scale is not None else ""))
        row = {"epoch": epoch + 1, "train_loss": stats.loss, "val_acc": val_acc, "lr": lr,
               "epoch_time": epoch_seconds, "train_time": stats.seconds,
               "data_time": stats.data_seconds, "images_per_s": stats.images_per_s,
               "skipped_steps": stats.skipped, "peak_mem_mb": peak_mem,
               "peak_mem_kind": "cuda_allocated" if device.type == "cuda" else "max_rss"}
        logger.record(row | ({"grad_scale": scale} if scale is not None else {}))
        logger.scalars({"train/loss": stats.loss, "train/lr": lr, "val/accuracy": val_acc,
                        "time/epoch_seconds": epoch_seconds,
                        "throughput/images_per_second": stats.images_per_s}
                       | ({"amp/grad_scale": scale, "amp/skipped_steps": stats.skipped}
                          if scale is not None else {}), epoch + 1)

    total_seconds = time.perf_counter() - t_start
    logger.print(f"done: {variant}, {args.epochs} epochs, {format_duration(total_seconds)} "
                 f"(training alone {format_duration(train_seconds)}), best val_acc "
                 f"{max(best_acc, 0):.4f} at epoch {best_epoch}; checkpoints in {run_dir}"
                 + (f"; TensorBoard in {tb_dir}" if tb_dir else ""))
    return 0


@report_user_errors
def main(parallel: str, precision: str, argv: Optional[Sequence[str]] = None) -> None:
    variant = train_name(parallel, precision)
    args = parse_train_args(variant, ddp=parallel == "ddp", argv=argv)
    info = setup(parallel == "ddp", args.cuda)
    try:
        code = run(args, parallel, precision, info)
    finally:
        cleanup(info)
    if code:
        sys.exit(code)
