"""A run as a process: its folder, what it says, and how it ends.

- The folder, as a script holds it (``with RunFolder(...) as run``): created and writable,
  one run in it at a time (:class:`RunLock`); the TensorBoard folder beside it; the run's
  logger and its stop; and its last line (the summary, or where a stop saved) with its exit
  status. Every rank makes the ``with`` and its calls together: the stop's group, and the
  barrier at the end.
- What it says, on global rank 0 only (:class:`RunLogger`): its first line
  (:func:`header_line`), an epoch's line, TensorBoard scalars and JSON row (``log.jsonl``),
  and its last line.
- How its process ends on a user's mistake or a fault (:func:`report_user_errors` around a
  script's ``main``): one line on stderr and a non-zero exit status, never a traceback. A
  :class:`~ampkit.errors.UserError` (bad input: the same on every rank) is said by rank 0; a
  :class:`~ampkit.errors.RankError` (a fault one process found) by its process; Ctrl-C before
  training starts, and a second Ctrl-C, by rank 0 (a terminal's reaches every rank); a peer
  lost under torchrun is one line and exit status 1, so that torchrun can restart or stop
  the job. The script has left its process group by then, in its own ``finally``."""
from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Optional

import torch

from .distributed import StopChannel, barrier, this_process
from .errors import UserError
from .stop import Stop, exit_status, stopped_line, stopping


def prepare_run_dir(path: Path) -> Path:
    """Create a folder the run will write into, or fail in one line if it cannot."""
    path = Path(path)
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{path}: {parent} is a file, but a folder is expected here")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UserError(f"{path}: cannot write here ({e.strerror or e})") from None
    return path


def claim_run_dir(path: Path) -> "RunLock":
    """Make ``path`` this run's folder: created and writable, locked against a second run."""
    prepare_run_dir(path)
    return RunLock(path)


class RunLock:
    """One run per run folder: an exclusive ``flock`` on ``<folder>/.lock``, which the OS
    releases when the process ends in any way (SIGKILL included), so a crashed run never
    leaves a stale lock behind. The file names its holder for the run that is refused."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / ".lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 500).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"{folder} is in use by another run ({holder}); let it finish, or "
                            "give this run another --checkpoint folder") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self.fd: Optional[int] = fd

    def release(self) -> None:
        if self.fd is not None:
            # The flock is the open file's: closing it releases the lock.
            os.close(self.fd)
            self.fd = None


class RunFolder:
    """The run folder of ``run_dir`` and its lock (global rank 0's; the other ranks write
    nothing), the TensorBoard folder ``<tensorboard_dir>/<time>/`` (None: no TensorBoard),
    this process's :class:`DistInfo` (``run.info``, on ``device``), the run's logger and its
    last line (``run.end``); ``run.status``: 0, or 128 + a stop's signal."""

    def __init__(self, run_dir: Path, device: torch.device,
                 tensorboard_dir: Optional[Path] = None) -> None:
        self.dir, self.status, self.t_start = Path(run_dir), 1, time.perf_counter()
        self.info = this_process(device)
        self.lock, self.tb_dir = None, None
        if not self.info.is_main:
            return
        self.lock = claim_run_dir(self.dir)
        try:
            if tensorboard_dir is not None:
                self.tb_dir = prepare_run_dir(tensorboard_dir) / time.strftime("%Y%m%d-%H%M%S")
        # A run that could not start leaves the folder to the next one.
        except BaseException:
            self.lock.release()
            raise

    def logger(self, epochs: int) -> RunLogger:
        """Rank 0's lines, log.jsonl and TensorBoard scalars here; ``epochs``: the run's, for
        the epoch lines; closed at the end of its ``with``."""
        return RunLogger(self.info.is_main, self.tb_dir, self.dir / "log.jsonl", epochs)

    def stop(self, say: Callable[[str], None]) -> ContextManager[Stop]:
        """Within it SIGTERM, SIGINT and SIGUSR1 ask for a stop, which every rank makes at the
        same step (:mod:`ampkit.stop`); every rank makes it, together."""
        return stopping(StopChannel(self.info), say, exiting=self.info.world_size > 1)

    def end(self, checkpoint, meters, stop: Stop, log: RunLogger) -> None:
        """After the epochs, on every rank together: the checkpoint's end (its last save
        written, a stop during the last epoch's end taken), then the last line: where a stop
        saved, or the summary of a run that trained."""
        progress, epochs = checkpoint.progress, checkpoint.epochs
        if checkpoint.end(stop):
            log.print(stopped_line(stop.request, progress.epoch, progress.step,
                                   checkpoint.last, epochs))
            self.status = exit_status(stop.request.agreed)
            return
        if checkpoint.started_at < epochs:
            log.print(summary_line(self.dir.name, epochs, time.perf_counter() - self.t_start,
                                   meters.train_seconds, progress.best_acc, progress.best_epoch,
                                   self.dir, self.tb_dir, meters.mean()))
        self.status = 0

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """The folder released; if every rank got to the end (so no peer is gone), first a
        barrier, so that none tears down links a peer still uses."""
        if exc_type is None:
            barrier(self.info)
        if self.lock is not None:
            self.lock.release()


def format_duration(seconds: float) -> str:
    """``1342.4`` -> ``0h22m22s`` (the article divided seconds by 60 with //)."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60}m{seconds % 60}s"


class RunLogger:
    """Prints, TensorBoard and ``log.jsonl`` for the main process; a no-op elsewhere."""

    def __init__(self, is_main: bool, tensorboard_dir: Optional[Path] = None,
                 jsonl_path: Optional[Path] = None, epochs: int = 0) -> None:
        """``epochs``: the run's (an epoch's line says "3/20")."""
        self.is_main, self.epochs = is_main, epochs
        # Files are opened on first use, so a run that fails before its first epoch
        # neither truncates the previous run's log nor leaves an empty TensorBoard run.
        self.tensorboard_dir = tensorboard_dir if is_main else None
        self.jsonl_path = jsonl_path if is_main else None
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
        most a partial last line, which the next run's first row drops. That row's epoch
        is where this run began: the log keeps the previous rows of the epochs before it
        (a resumed run's; none for a new run) and drops those after (logged by a stopped
        run, but not saved: trained again now)."""
        if self.jsonl is None and self.jsonl_path is not None:
            tmp = self.jsonl_path.with_name(f".{self.jsonl_path.name}.tmp")
            tmp.write_text(self._rows_before(row["epoch"]), encoding="utf-8")
            # Through a temporary file: the old log stays whole until the new one is.
            os.replace(tmp, self.jsonl_path)
            self.jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()

    def _rows_before(self, epoch: int) -> str:
        """The previous log's complete rows of the epochs before ``epoch``."""
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
                    and row["epoch"] < epoch:
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
                clip_grad: Optional[float], fp32_math: str, data_parallel: bool = False) -> str:
    """The run's first line: what trains, on what, in which precision, from which data
    (``technique``: ``engine.Technique``; ``data``: ``ampkit.data.Loaders``; ``info``: this
    process in its group; ``data_parallel``: a DataParallel script, which builds no
    DataParallel off CUDA). What the run computes in is read from the technique's objects: a
    DataParallel in the model, an autocast, FSDP2's MixedPrecisionPolicy, an enabled
    GradScaler."""
    device = info.device
    gpu = device.type == "cuda"
    dp = any(isinstance(m, torch.nn.DataParallel) for m in technique.model.modules())
    gpus = (f" x{torch.cuda.device_count()} GPUs" if dp else
            f" (DataParallel is CUDA's: on the {device.type} the model runs as it is)"
            if data_parallel else "")
    scaled = technique.scaler is not None and technique.scaler.is_enabled()
    low = ("autocast" if technique.autocast is not None else
           "MixedPrecisionPolicy" if technique.mp_policy is not None else None)
    precision = ("fp32" + (f" ({fp32_math})" if gpu else "") if low is None else
                 f"{low} ({str(technique.amp_dtype)[6:]})" + (" + GradScaler" if scaled else ""))
    batch = data.batch_size
    return (f"{variant}: {data.name} ({data.train_size} train / {data.val_size} val "
            f"images, {data.num_classes} classes) at {data.image_shape[-1]}px on {device}"
            f"{f' x{info.world_size} processes over {info.backend}' if info.distributed else ''}"
            f"{gpus}, precision {precision}, "
            f"batch {batch}{' per process' if info.distributed else ''}"
            + (f" x {accum_steps} micro-batches per optimizer step (global batch "
               f"{data.global_batch(accum_steps, info.world_size)})" if accum_steps > 1 else "")
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


EXIT_USER_ERROR = 2
EXIT_LOST_PEER = 1

# How a collective fails when another process of the group has died (gloo's and NCCL's words).
_LOST_PEER = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Connection refused|"
                        r"NCCL communicator was aborted|remote process exited|"
                        r"(?:gloo|NCCL).*?[Tt]imed out", re.S)


def lost_peer(error: BaseException) -> Optional[str]:
    """Why a collective failed, when it failed because a peer process died; else None."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    match = _LOST_PEER.search(text)
    if match is None:
        return None
    where = re.search(r"\[[\d.:a-f]+\]:\d+", text)
    return match.group(0).split("\n")[0] + (f" {where.group(0)}" if where else "")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _several() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def report_user_errors(main: Callable) -> Callable:
    """A script's ``main``, whose user errors, Ctrl-C and lost peers end in one line."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        prog = os.path.basename(sys.argv[0]) or "ampkit"
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if _rank() == 0 or e.every_rank:
                who = f"rank {_rank()}: " if e.every_rank and _several() else ""
                print(f"{prog}: error: {who}{e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        # A terminal's Ctrl-C reaches every rank: rank 0 alone says it.
        except KeyboardInterrupt as e:
            if _rank() == 0:
                print(f"{prog}: interrupted" + (f"; {e}" if str(e) else ""), file=sys.stderr,
                      flush=True)
            if getattr(e, "now", False):
                os._exit(130)
            sys.exit(130)
        except RuntimeError as e:
            reason = lost_peer(e) if _several() else None
            if reason is None:
                raise
            print(f"{prog}: error: rank {_rank()}: lost a peer process ({reason}); exiting so "
                  "torchrun can restart or stop", file=sys.stderr, flush=True)
            sys.exit(EXIT_LOST_PEER)

    return wrapper
