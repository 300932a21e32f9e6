"""Writing checkpoints while training goes on: :class:`Snapshot` copies a state's tensors to
CPU memory, :class:`BackgroundWriter` writes the copies in a thread, each file atomically
(:func:`atomic_save`) or as a second name for another (:class:`Link`)."""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

import torch

from ..device import pinned
from ..errors import UserError, first_line
from .messages import DiskFull


def atomic_save(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` through a new temporary file, fsync'ed, then renamed over it:
    a kill at any instant leaves the previous file or the new one, and a reader that holds
    the previous one open (an evaluation, a copy) keeps reading the bytes it opened."""
    path = Path(path)
    f, tmp = new_temporary(path)
    try:
        with f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        # ENOSPC or EDQUOT, as an OSError or as the RuntimeError of torch.save's writer.
        if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or (
                isinstance(e, RuntimeError) and ("No space left" in str(e)
                                                 or "unexpected pos" in str(e))):
            needed, free = _nbytes(obj), _free(path.parent) or 0
            if free < needed or isinstance(e, OSError):
                raise DiskFull(path, needed, free) from None
            raise UserError(f"cannot save {path}: the write failed ({first_line(e)})") from None
        raise
    _fsync_folder(path.parent)


def new_temporary(path: Path) -> Tuple[BinaryIO, Path]:
    """A file beside ``path`` that this call creates, open for writing: never one that
    exists, nor through a symbolic link planted at its name (``O_EXCL``, ``O_NOFOLLOW``: a
    team's folder may let others write). Its mode is the umask's, as torch.save to a path
    would make it (that team's folder may grant its group)."""
    while True:
        tmp = _temporary_name(path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        return os.fdopen(fd, "wb"), tmp


def _temporary_name(path: Path) -> Path:
    # Unguessable: a name taken by someone else is passed over, never used.
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _fsync_folder(folder: Path) -> None:
    # A rename is durable once its folder's entry is.
    with contextlib.suppress(OSError):
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _nbytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj``, plus 1 MB for the rest of the file."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values()) + (2**20 if obj else 0)
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _free(folder: Path) -> Optional[int]:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


@dataclass
class Link:
    """``target`` made a second name for ``source``'s file, or where the file system has no
    hard links, ``fallback`` written to it."""
    source: Path
    target: Path
    fallback: Any


def link_or_write(link: Link) -> None:
    while True:
        tmp = _temporary_name(link.target)
        try:
            os.link(link.source, tmp)
            break
        except FileExistsError:
            continue
        # No hard links on this file system.
        except OSError:
            return atomic_save(link.fallback, link.target)
    os.replace(tmp, link.target)
    _fsync_folder(link.target.parent)


def remove_temporaries(folder: Path) -> None:
    """Delete the files a save cut short left behind (and the spare files earlier versions
    kept between saves)."""
    for left in [*Path(folder).glob(".*.pth.*.tmp"), *Path(folder).glob(".*.pth.spare")]:
        with contextlib.suppress(OSError):
            left.unlink()


class Snapshot:
    """CPU copies of a state's tensors, which the writer writes while training changes the
    live ones, in buffers kept from one save to the next (pinned for a GPU's: asynchronous).
    Take one only while no write of the last is in flight."""

    def __init__(self) -> None:
        self._buffers: Dict[tuple, torch.Tensor] = {}

    def take(self, obj: Any) -> Any:
        out = self._copy(obj, ())
        if any(b.is_pinned() for b in self._buffers.values()):
            # The asynchronous copies must have landed before the writer reads them.
            torch.accelerator.synchronize()
        return out

    def _copy(self, obj: Any, key: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            t, buf = obj.detach(), self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned(t.device))
                self._buffers[key] = buf
            # Asynchronous only into pinned memory: into pageable memory the copy could
            # still be landing when the writer reads the buffer.
            return buf.copy_(t, non_blocking=buf.is_pinned())
        if isinstance(obj, dict):
            return {k: self._copy(v, key + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, key + (i,)) for i, v in enumerate(obj))
        return obj


class BackgroundWriter:
    """Writes a save's files in a thread, one save in flight: a slow disk slows training
    rather than piling copies up in memory. The thread's error is raised by the next
    ``submit`` or ``wait``. Not a daemon: a run that ends, by an exception too, finishes its
    last save before the process exits."""

    def __init__(self, landed: str = "") -> None:
        self._thread: Optional[threading.Thread] = None
        self._done = threading.Event()
        self._done.set()
        self._error: Optional[BaseException] = None
        # What the last first file written in full holds: a second Ctrl-C says it.
        self.write_seconds: Optional[float] = None
        self.landed = landed

    def submit(self, files: List[Any], label: str = "") -> None:
        """Write ``files`` (``(snapshot, path)`` or a :class:`Link`) in this order, once the
        previous save is done; ``label``: what the first holds. A save that cannot fit on its
        disk fails here, at once."""
        self.wait()
        for obj, path in (f for f in files if not isinstance(f, Link)):
            needed, free = _nbytes(obj), _free(path.parent)
            if free is not None and free < needed:
                raise DiskFull(path, needed, free)
        self._done.clear()
        self._thread = threading.Thread(target=self._write, args=(files, label),
                                        name="checkpoint")
        self._thread.start()

    @property
    def busy(self) -> bool:
        # Not Thread.is_alive: after a join cut short by Ctrl-C, Python 3.11 may call a
        # running thread dead.
        return not self._done.is_set()

    def wait(self) -> float:
        """Wait for the save in flight, if any; the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return time.perf_counter() - t0

    def _write(self, files: List[Any], label: str) -> None:
        t0 = time.perf_counter()
        try:
            for i, item in enumerate(files):
                if isinstance(item, Link):
                    link_or_write(item)
                else:
                    atomic_save(*item)
                if i == 0:
                    self.landed = label
        # Raised in the training thread, by the next wait().
        except BaseException as e:
            self._error = e
        finally:
            self.write_seconds = time.perf_counter() - t0
            self._done.set()
