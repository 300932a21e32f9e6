"""A run's folder: created and writable, one run in it at a time (:class:`RunLock`), and rid
of the temporary files a killed save left behind."""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

from .process import UserError


def remove_stale_temps(folder: Path) -> None:
    """Delete temporary files left by a save that was killed (they never replaced a
    checkpoint), and spares left by a run that was killed."""
    for tmp in [*Path(folder).glob(".*.pth.*.tmp"), *Path(folder).glob(".*.pth.spare")]:
        with contextlib.suppress(OSError):
            tmp.unlink()


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


def claim_folders(args, is_main: bool) -> tuple:
    """(the run folder, its lock, the TensorBoard folder) of ``args.variant``: global rank 0
    (``is_main``) claims the run folder (one run in it at a time) and checks the TensorBoard
    one, which its first write creates; the other ranks write nothing (no lock, no folder)."""
    run_dir = args.checkpoint / args.variant
    if not is_main:
        return run_dir, None, None
    lock = claim_run_dir(run_dir)
    try:
        tb_dir = (prepare_run_dir(args.tensorboard_log / args.variant)
                  / time.strftime("%Y%m%d-%H%M%S")) if args.tensorboard else None
    except BaseException:
        lock.release()
        raise
    return run_dir, lock, tb_dir
