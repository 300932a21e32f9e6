"""What a run says, on global rank 0 only: its first line, its progress bars, an epoch's line,
TensorBoard scalars and JSON row (``log.jsonl``), and its last line."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from tqdm import tqdm


# Seconds between redraws of a progress bar where stderr is not a terminal (a log file,
# SLURM's, compare.py's children): a few lines a log keeps, not one redraw per step.
LOG_REDRAW_S = 30.0

def progress_bar(iterable=None, **kw) -> tqdm:
    """tqdm on stderr, which clears itself when done (``leave=False``). In a terminal it
    redraws as tqdm does; elsewhere every ``LOG_REDRAW_S`` seconds at most."""
    interactive = sys.stderr.isatty()
    return tqdm(iterable, leave=False, dynamic_ncols=interactive,
                mininterval=0.1 if interactive else LOG_REDRAW_S, **kw)


def format_duration(seconds: float) -> str:
    """``1342.4`` -> ``0h22m22s`` (the article divided seconds by 60 with //)."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60}m{seconds % 60}s"


class RunLogger:
    """Prints, TensorBoard and ``log.jsonl`` for the main process; a no-op elsewhere."""

    def __init__(self, is_main: bool, tensorboard_dir: Optional[Path] = None,
                 jsonl_path: Optional[Path] = None, epochs: int = 0,
                 resume_epoch: Optional[int] = None) -> None:
        """``epochs``: the run's (an epoch's line says "3/20"). ``resume_epoch``: a resumed
        run, whose checkpoint holds that many epochs; the log's rows of later epochs (logged,
        but not saved before the run stopped) are dropped, as the run trains those epochs
        again. None: a new run, a new log."""
        self.is_main, self.epochs = is_main, epochs
        # Files are opened on first use, so a run that fails before its first epoch
        # neither truncates the previous run's log nor leaves an empty TensorBoard run.
        self.tensorboard_dir = tensorboard_dir if is_main else None
        self.jsonl_path = jsonl_path if is_main else None
        self.resume_epoch = resume_epoch
        self.writer = None
        self.jsonl = None

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print on rank 0 (a lone None: nothing to say)."""
        if self.is_main and args != (None,):
            print(*args, **kwargs, flush=True)

    def warn(self, message: Optional[str]) -> None:
        """A warning line on stderr (None: nothing to say)."""
        if self.is_main and message:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        if self.writer is None and self.tensorboard_dir is not None:
            # Imported here: TensorBoard is only needed when it is used.
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.tensorboard_dir))
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def record(self, row: Dict[str, Any]) -> None:
        """One JSON line per epoch, written with one write() call: a kill mid-write leaves at
        most a partial last line, which the next resume drops."""
        if self.jsonl is None and self.jsonl_path is not None:
            kept = "" if self.resume_epoch is None else self._kept_rows()
            tmp = self.jsonl_path.with_name(f".{self.jsonl_path.name}.tmp")
            tmp.write_text(kept, encoding="utf-8")
            os.replace(tmp, self.jsonl_path)  # the old log stays whole until the new one is
            self.jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()

    def _kept_rows(self) -> str:
        """The previous log's complete rows of the epochs the resumed checkpoint holds."""
        kept = []
        try:
            lines = self.jsonl_path.read_text(encoding="utf-8").splitlines(keepends=True)
        except OSError:
            return ""
        for line in lines:
            try:
                row = json.loads(line) if line.endswith("\n") else None
            except ValueError:
                row = None
            if isinstance(row, dict) and isinstance(row.get("epoch"), int) \
                    and row["epoch"] <= self.resume_epoch:
                kept.append(line)
        return "".join(kept)

    def epoch(self, row: Dict[str, Any]) -> None:
        """An epoch's results (``meters.Meters.row``): its line on the console, its row in
        log.jsonl, its scalars in TensorBoard."""
        scale, util = row.get("grad_scale"), row.get("utilisation")
        self.print(f"epoch {row['epoch']}/{self.epochs}  train_loss {row['train_loss']:.4f}  "
                   f"val_acc {row['val_acc']:.4f} ({row['val_correct']}/{row['val_seen']})  "
                   f"lr {row['lr']:.2e}  "
                   f"time {row['epoch_time']:.1f}s  {row['images_per_s']:.0f} img/s  "
                   + achieved_text(row.get("tflops"), util)
                   + f"  grad_norm {row['grad_norm_mean']:.3g} (max {row['grad_norm_max']:.3g})"
                   + (f"  skipped_steps {row['skipped_steps']}  scale {scale:.0f}"
                      if scale is not None else "")
                   + (f"  wire {row['wire_mb_per_step']:.2f} MB/step ({row['comm_hook']})"
                      if "wire_mb_per_step" in row else ""))
        self.record(row)
        self.scalars({"train/loss": row["train_loss"], "train/lr": row["lr"],
                      "val/accuracy": row["val_acc"], "time/epoch_seconds": row["epoch_time"],
                      "train/grad_norm_mean": row["grad_norm_mean"],
                      "train/grad_norm_max": row["grad_norm_max"],
                      "throughput/images_per_second": row["images_per_s"],
                      "throughput/tflops": row.get("tflops", float("nan"))}
                     | ({"throughput/utilisation": util} if util is not None else {})
                     | ({"amp/grad_scale": scale, "amp/skipped_steps": row["skipped_steps"]}
                        if scale is not None else {}), row["epoch"])

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None


def header_line(variant: str, technique, data, info, *, accum_steps: int,
                clip_grad: Optional[float], fp32_math: str) -> str:
    """The run's first line: what trains, on what, in which precision, from which data
    (``data``: ``ampkit.data.Loaders``; ``info``: ``ampkit.device.DistInfo``)."""
    device, amp_dtype = info.device, technique.amp_dtype
    gpu = device.type == "cuda"
    dp = any(isinstance(m, torch.nn.DataParallel) for m in technique.model.modules())
    dp_script = variant.startswith("train_DP") and not variant.startswith("train_DDP")
    gpus = (f" x{torch.cuda.device_count()} GPUs" if dp else
            f" (DataParallel is CUDA's: on the {device.type} the model runs as it is)"
            if dp_script else "")
    dtype = f" ({str(amp_dtype)[6:]})" if amp_dtype is not None else (f" ({fp32_math})" if gpu
                                                                        else "")
    batch = data.batch_size
    return (f"{variant}: {data.name} ({data.train_size} train / {data.val_size} val "
            f"images, {data.num_classes} classes) at {data.image_shape[-1]}px on {device}"
            f"{f' x{info.world_size} processes over {info.backend}' if info.distributed else ''}"
            f"{gpus}, "
            f"precision {technique.precision}{dtype}, "
            f"batch {batch}{' per process' if info.distributed else ''}"
            + (f" x {accum_steps} micro-batches per optimizer step (global batch "
               f"{batch * accum_steps * info.world_size})" if accum_steps > 1 else "")
            + (f", gradients clipped to norm {clip_grad:g}" if clip_grad else "")
            + f", {data.kind} loader; progress in optimizer steps")


def achieved_text(tflops: Optional[float], utilisation: Optional[float]) -> str:
    """``0.52 TFLOP/s (31.0% of peak)``; the share left out where no peak is known."""
    if tflops is None:
        return ""
    return f"{tflops:.3g} TFLOP/s" + (f" ({100 * utilisation:.1f}% of peak)"
                                      if utilisation is not None else "")


def summary_line(variant: str, epochs: int, seconds: float, train_seconds: float,
                 best_acc: float, best_epoch: int, run_dir: Path, tb_dir: Optional[Path],
                 mean: Optional[dict] = None) -> str:
    """The run's last line; ``mean``: the run's achieved TFLOP/s (and share of peak)."""
    rate = (f", {achieved_text(mean['tflops'], mean['utilisation'])} on average"
            if mean and train_seconds > 0 else "")
    return (f"done: {variant}, {epochs} epochs, {format_duration(seconds)} (training "
            f"alone {format_duration(train_seconds)}{rate}), best val_acc "
            f"{max(best_acc, 0):.4f} at epoch {best_epoch}; checkpoints in {run_dir}"
            + (f"; TensorBoard in {tb_dir}" if tb_dir else ""))
