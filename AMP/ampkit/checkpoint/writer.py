"""Writing checkpoint files while training goes on: :class:`Snapshot` copies a state's
tensors to CPU memory, :class:`BackgroundWriter` writes the copies in a thread, one save in
flight at a time, each file by :func:`atomic_save`; best.pth is a second name (a hard link)
for the best epoch's last.pth (:class:`Link`).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ..device import pinned
from ..errors import UserError, first_line
from .messages import DiskFull

def atomic_save(obj: Any, path: Path, spare: bool = False) -> None:
    """Write ``obj`` to ``path`` through a temporary file, fsync'ed, then renamed over it: a
    kill at any instant leaves the previous file or the new one.

    ``spare=True`` (the background writer's saves): the temporary file is ``.<name>.spare``,
    the version before the current one, rewritten in place, and the current one becomes the
    spare. Rewriting a file's pages costs the kernel less than allocating new ones (684 MB:
    docs/results.md), which matters for a save beside training every epoch."""
    path = Path(path)
    spare_path = _spare(path)
    # A spare that is best.pth's file too (a hard link) must not be rewritten.
    if spare and spare_path.is_file() and spare_path.stat().st_nlink > 1:
        spare_path.unlink()
    if spare and spare_path.is_file():
        tmp, f = spare_path, open(spare_path, "r+b")
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        # mkstemp makes it 0600; a team's shared folder may grant its group what the umask does.
        os.fchmod(fd, 0o666 & ~_umask())
        tmp, f = Path(name), os.fdopen(fd, "wb")
    try:
        with f:
            torch.save(obj, f)
            # A spare may be longer than this checkpoint.
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
        # The current file's second name becomes the spare (none without hard links).
        keep = path.with_name(f".{path.name}.{os.getpid()}.keep.tmp")
        kept = spare and path.is_file() and _linked(path, keep)
        os.replace(tmp, path)
        if kept:
            os.replace(keep, spare_path)
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


def _umask() -> int:
    """The umask, read where Linux's /proc says it: setting it to read it would race threads."""
    try:
        return int(re.search(r"Umask:\s*(\d+)", Path("/proc/self/status").read_text())[1], 8)
    except (OSError, TypeError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _spare(path: Path) -> Path:
    return path.with_name(f".{path.name}.spare")


def _fsync_folder(folder: Path) -> None:
    """Persist a rename in ``folder`` (its directory entry)."""
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


def _linked(source: Path, name: Path) -> bool:
    """Whether ``name`` could be made a second name for ``source``'s file (a hard link)."""
    try:
        os.link(source, name)
        return True
    except OSError:
        return False


@dataclass
class Link:
    """``target`` to be made a second name for ``source``'s file (:func:`link_or_write`), or
    written with ``fallback`` where there are no hard links."""
    source: Path
    target: Path
    fallback: Any


def link_or_write(link: Link) -> None:
    tmp = link.target.with_name(f".{link.target.name}.{os.getpid()}.link.tmp")
    if not _linked(link.source, tmp):
        return atomic_save(link.fallback, link.target, spare=True)
    os.replace(tmp, link.target)
    _fsync_folder(link.target.parent)


def remove_spares(folder: Path, temps: bool = False) -> None:
    """Delete the spares ``atomic_save(spare=True)`` keeps between saves; with ``temps``, a
    killed save's temporary files too (they never replaced a checkpoint)."""
    for left in [*Path(folder).glob(".*.pth.spare"),
                 *(Path(folder).glob(".*.pth.*.tmp") if temps else [])]:
        with contextlib.suppress(OSError):
            left.unlink()


class Snapshot:
    """CPU copies of a state's tensors, in buffers kept from one save to the next (pinned
    for a GPU's state: a fast, asynchronous copy), which the writer writes while training
    changes the live tensors. Take one only while no write of the last is in flight."""

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
    """Writes a save's files in a thread while training goes on, one save in flight: a slow
    disk slows training rather than piling copies up in memory. An error in the thread is
    raised by the next ``submit`` or ``wait``. Not a daemon thread: a run that ends, by an
    exception too, finishes its last save before the process exits."""

    def __init__(self, landed: str = "") -> None:
        self._thread: Optional[threading.Thread] = None
        self._done = threading.Event()
        self._done.set()
        self._error: Optional[BaseException] = None
        # The last write's seconds; what the last first file written in full holds (what a
        # second Ctrl-C says last.pth holds).
        self.write_seconds: Optional[float] = None
        self.landed = landed

    def submit(self, files: List[Any], label: str = "") -> None:
        """Write ``files`` (``(snapshot, path)`` or a :class:`Link`) in this order, once the
        previous save is done; ``label``: what the first holds. A save that cannot fit on its
        disk fails here, at once (a spare is rewritten in place: its size counts as free)."""
        self.wait()
        for obj, path in (f for f in files if not isinstance(f, Link)):
            spare, needed, free = _spare(path), _nbytes(obj), _free(path.parent)
            reused = spare.stat().st_size if spare.is_file() and spare.stat().st_nlink == 1 else 0
            if free is not None and free + reused < needed:
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
                    atomic_save(*item, spare=True)
                if i == 0:
                    self.landed = label
        # Raised in the training thread, by the next wait().
        except BaseException as e:
            self._error = e
        finally:
            self.write_seconds = time.perf_counter() - t0
            self._done.set()
