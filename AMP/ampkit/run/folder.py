"""A run's folder, as a script holds it (``with RunFolder(...) as run``): created and writable,
one run in it at a time (:class:`RunLock`), rid of the temporary files a killed save left
behind; the TensorBoard folder beside it; the run's logger; and its last line (the summary,
or where a stop saved) with its exit status."""
from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from .checkpoint.files import LAST
from .checkpoint.writer import remove_stale_temps
from .distributed import StopVote, barrier, this_process
from .errors import UserError
from .log import RunLogger, summary_line
from .signals import exit_status, stopped_line

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
    """Make ``path`` this run's folder: created and writable, locked against a second run,
    and rid of the temporary files a killed save left (no live run owns them now)."""
    prepare_run_dir(path)
    lock = RunLock(path)
    remove_stale_temps(path)
    return lock


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
            os.close(self.fd)  # closing the file releases the lock
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
        except BaseException:  # a run that could not start leaves the folder to the next
            self.lock.release()
            raise

    def logger(self, resumed, epochs: int) -> RunLogger:
        """Rank 0's lines, log.jsonl and TensorBoard scalars here (``resumed``, a
        ``checkpoint.Resumed``: a resumed run's, after its epoch); ``epochs``: the run's, for
        the epoch lines; closed at the end of its ``with``."""
        return RunLogger(self.info.is_main, self.tb_dir, self.dir / "log.jsonl", epochs,
                         resume_epoch=resumed.epoch if resumed.path else None)

    def end(self, meters, saver, vote: StopVote, log: RunLogger) -> None:
        """After the epochs: the last save written, the run's last vote (a signal during the
        last epoch's end), then the last line: the summary, or where a stop saved."""
        saver.finish()  # the last save, which may still be in flight; no spare file left
        if saver.stopped_at is None and saver.resumed.epoch < saver.epochs:
            if vote.any_rank_asked():
                saver.stopped_at = (saver.epochs, 0)
            log.print(summary_line(self.dir.name, saver.epochs, time.perf_counter() - self.t_start,
                                   meters.train_seconds, saver.best_acc, saver.best_epoch,
                                   self.dir, self.tb_dir, meters.mean()))
        self.status = 0
        if saver.stopped_at is not None:
            log.print(stopped_line(vote.flag, *saver.stopped_at, self.dir / LAST, saver.epochs))
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
