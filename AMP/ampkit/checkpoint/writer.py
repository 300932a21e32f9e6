"""Writing checkpoint files while training goes on: :class:`Snapshot` copies a state's
tensors to CPU memory, :class:`BackgroundWriter` writes the copies in a thread, one save in
flight at a time, each file by :func:`atomic_save`.

- A write goes to a temporary file beside the target, is fsync'ed and renamed over it: a
  kill at any instant leaves the previous file or the new one. The file's mode follows
  the umask, as ``torch.save`` to a path would (a teammate's group may read it).
- best.pth is a second name (a hard link) for the best epoch's last.pth (:class:`Link`).
- The free space is checked as a save is submitted: a full disk is one line, at once.
"""
from __future__ import annotations

import contextlib
import errno
import os
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


def atomic_save(obj: Any, path: Path, spare: bool = False) -> None:
    """Write ``obj`` to ``path`` atomically: into a temporary file, flushed and fsync'ed, then
    renamed over ``path``. A kill at any instant leaves the previous file or the new one.

    ``spare=True`` (the background writer's saves): the temporary file is ``.<name>.spare``,
    the version before the current one, rewritten in place; the current one becomes the
    spare. Rewriting a file's pages costs the kernel less than allocating new ones (684 MB:
    see docs/results.md), which matters for a save beside training every epoch.
    The spare is one more copy on disk until :func:`remove_spares` at the end of the run.
    """
    path = Path(path)
    spare_path = _spare(path)
    # A spare whose file is best.pth's too (link_or_write) must not be rewritten.
    if spare and spare_path.is_file() and spare_path.stat().st_nlink > 1:
        spare_path.unlink()
    if spare and spare_path.is_file():
        tmp, f = spare_path, open(spare_path, "r+b")
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        # mkstemp's file is 0600: made as open() would make it.
        os.fchmod(fd, 0o666 & ~_umask())
        tmp, f = Path(name), os.fdopen(fd, "wb")
    try:
        with f:
            torch.save(obj, f)
            # A spare may be longer than this checkpoint.
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
        _replace(tmp, path, spare_path if spare else None)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if _out_of_space(e):
            needed, free = _nbytes(obj), _free(path.parent) or 0
            if free < needed or isinstance(e, OSError):
                raise DiskFull(path, needed, free) from None
            raise UserError(f"cannot save {path}: the write failed ({first_line(e)})") from None
        raise
    _fsync_folder(path.parent)


def _umask() -> int:
    """This process's umask, read without changing it (Linux's /proc), else by setting it
    and back: a team's shared folder may grant its group what the user's umask grants."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
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


class DiskFull(UserError):
    """A checkpoint does not fit on its disk: one line, how much is needed and free, where."""

    def __init__(self, path: Path, needed: int, free: int) -> None:
        kept = f"the previous {path.name} is unchanged" if path.is_file() else \
            f"nothing was written to {path.name}"
        super().__init__(f"cannot save {path}: it needs {needed / 2**20:,.0f} MB and "
                         f"{path.parent} has {free / 2**20:,.0f} MB free; {kept}. Free some "
                         "space, or give --checkpoint a folder on another disk, then --resume")


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
    """Free bytes on ``folder``'s file system; None where that cannot be known."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _out_of_space(e: BaseException) -> bool:
    """ENOSPC or EDQUOT, as an OSError, or as the RuntimeError torch.save's writer raises."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, RuntimeError) and ("No space left" in str(e) or "unexpected pos" in str(e))


def _replace(new: Path, path: Path, spare: Optional[Path]) -> None:
    """Rename ``new`` over ``path``; with ``spare``, keep ``path``'s current file as the spare."""
    keep = path.with_name(f".{path.name}.{os.getpid()}.keep.tmp")
    try:
        if spare is None or not path.is_file():
            raise OSError
        # A second name for the current file (no hard links: no spare).
        os.link(path, keep)
    except OSError:
        os.replace(new, path)
        return
    os.replace(new, path)
    os.replace(keep, spare)


@dataclass
class Link:
    """``target`` to be made a second name for ``source``'s file (:func:`link_or_write`), or
    written with ``fallback`` where there are no hard links."""
    source: Path
    target: Path
    fallback: Any


def link_or_write(link: Link) -> None:
    """``link.target`` as a second name for ``link.source``'s file, atomically, nothing
    written (a hard link, renamed over the target); where the file system has no hard
    links, ``link.fallback`` written to it instead."""
    tmp = link.target.with_name(f".{link.target.name}.{os.getpid()}.link.tmp")
    try:
        os.link(link.source, tmp)
    except OSError:
        atomic_save(link.fallback, link.target, spare=True)
        return
    os.replace(tmp, link.target)
    _fsync_folder(link.target.parent)


def remove_spares(folder: Path, temps: bool = False) -> None:
    """Delete the spare copies that ``atomic_save(spare=True)`` keeps between saves; with
    ``temps``, the temporary files of a save that was killed too (they never replaced a
    checkpoint)."""
    for left in [*Path(folder).glob(".*.pth.spare"),
                 *(Path(folder).glob(".*.pth.*.tmp") if temps else [])]:
        with contextlib.suppress(OSError):
            left.unlink()


class Snapshot:
    """CPU copies of a state's tensors, in buffers kept from one save to the next.

    The background writer writes these copies while training changes the live tensors.
    Reused buffers (pinned memory for a GPU's state: a fast, asynchronous copy) mean a save
    allocates no memory after the first. Take one only while no write of the last is in flight.
    """

    def __init__(self) -> None:
        self._buffers: Dict[tuple, torch.Tensor] = {}

    def take(self, obj: Any) -> Any:
        """``obj`` with every tensor replaced by its copy in this snapshot's buffers."""
        out = self._copy(obj, ())
        if any(b.is_pinned() for b in self._buffers.values()):
            # The asynchronous copies must have landed before the writer reads them.
            torch.accelerator.synchronize()
        return out

    def _copy(self, obj: Any, key: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned(t.device))
                self._buffers[key] = buf
            # Asynchronous only into pinned memory: from the device into pageable memory
            # the copy could still be landing when the writer reads the buffer.
            return buf.copy_(t, non_blocking=buf.is_pinned())
        if isinstance(obj, dict):
            return {k: self._copy(v, key + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, key + (i,)) for i, v in enumerate(obj))
        return obj


class BackgroundWriter:
    """Writes checkpoint files in a thread while training goes on, at most one save in flight.

    ``submit`` first waits for the previous save, so a slow disk slows training down
    rather than piling up copies in memory. An error in the thread (a full disk, say) is
    raised by the next ``submit`` or ``wait``. The thread is not a daemon: a run that ends,
    even by an exception, finishes its last save before the process exits; a SIGKILL
    mid-write leaves the previous file, as every write is atomic.
    """

    def __init__(self, landed: str = "") -> None:
        self._thread: Optional[threading.Thread] = None
        self._done = threading.Event()
        self._done.set()
        self._error: Optional[BaseException] = None
        # How long the last finished write took; the label of the last first file written
        # in full (what a second Ctrl-C says last.pth holds).
        self.write_seconds: Optional[float] = None
        self.landed = landed

    def submit(self, files: List[Any], label: str = "") -> None:
        """Start writing ``files`` (``(snapshot, path)``, or a :class:`Link` to make) in this
        order, once the previous save is done; ``label`` says what the first file holds, for
        :attr:`landed`. A save that cannot fit on its disk (beside a spare of its own, which
        is rewritten in place and so already holds its size) fails here, at once."""
        self.wait()
        for obj, path in (f for f in files if not isinstance(f, Link)):
            needed, free, spare = _nbytes(obj), _free(path.parent), _spare(path)
            # A spare that is also best.pth's file is set aside, not rewritten: no room.
            reused = spare.stat().st_size if spare.is_file() and spare.stat().st_nlink == 1 else 0
            if free is not None and free + reused < needed:
                raise DiskFull(path, needed, free)
        self._done.clear()
        self._thread = threading.Thread(target=self._write, args=(files, label),
                                        name="checkpoint")
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A save is being written right now. (Not ``Thread.is_alive``: after a join cut short
        by a KeyboardInterrupt, Python 3.11 may call a running thread dead.)"""
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
