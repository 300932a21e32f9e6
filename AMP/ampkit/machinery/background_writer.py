"""Checkpoints written while training goes on: :class:`Snapshot` copies a state's tensors
to CPU memory, :class:`BackgroundWriter` writes the copies (atomically, by
``checkpoint_writer``) in a thread, one save in flight at a time."""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

import torch

from .checkpoint_writer import Link, atomic_save, check_space, link_or_write


class Snapshot:
    """CPU copies of a state's tensors, in buffers kept from one save to the next.

    The background writer writes these copies while training goes on changing the live
    tensors. Reusing the buffers (pinned memory when the state is on a GPU: a fast,
    asynchronous device-to-host copy) means a save allocates no new memory after the
    first. A snapshot may only be taken while no write of the previous one is in flight.
    """

    def __init__(self) -> None:
        self._buffers: Dict[tuple, torch.Tensor] = {}

    def take(self, obj: Any) -> Any:
        """``obj`` with every tensor replaced by its copy in this snapshot's buffers."""
        out = self._copy(obj, ())
        if any(b.is_pinned() for b in self._buffers.values()):
            torch.cuda.synchronize()  # the asynchronous copies have landed
        return out

    def _copy(self, obj: Any, key: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                self._buffers[key] = buf
            return buf.copy_(t, non_blocking=t.is_cuda)
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
        self.write_seconds: Optional[float] = None  # duration of the last finished write
        self.landed = landed  # the label of the last first file written in full

    def submit(self, files: List[Any], label: str = "") -> None:
        """Start writing ``files`` (``(snapshot, path)``, or a :class:`Link` to make) in this
        order, once the previous save is done.
        A save that cannot fit on its disk fails here, in the caller's thread, at once.
        ``label`` says what the first file holds, for :attr:`landed`."""
        self.wait()
        for obj, path in (f for f in files if not isinstance(f, Link)):
            spare = path.with_name(f".{path.name}.spare")
            check_space(obj, path, spare if spare.is_file() else None)
        self._done.clear()
        self._thread = threading.Thread(target=self._write, args=(files, label),
                                        name="checkpoint")
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A save is being written right now. (Not ``Thread.is_alive``: after a join that a
        KeyboardInterrupt cut short, Python 3.11 may call a running thread dead.)"""
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
        except BaseException as e:  # raised in the training thread by the next wait()
            self._error = e
        finally:
            self.write_seconds = time.perf_counter() - t0
            self._done.set()
