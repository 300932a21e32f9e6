"""Checkpoint IO: atomic writes in the background, safe loads, prefix-free weights.

- A wrapper's segment left in a key (``module.``, ``_orig_mod.``) is dropped on save and on
  load: any eval script loads any variant's checkpoint, older files included.
- A write goes to a temporary file beside the target, is fsync'ed and renamed over it: a
  kill at any instant leaves the previous file or the new one. :class:`Snapshot` copies the
  state to CPU memory and :class:`BackgroundWriter` writes it while training goes on.
- The free space is checked first: a full disk is one line, the previous files intact.
- ``torch.load(weights_only=True)``: pickled callables are refused unrun; every failure is
  one line naming the file. :class:`RunLock`: one run per run folder.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from .errors import UserError

LAST, BEST = "last.pth", "best.pth"
_WRAPPER_SEGMENTS = ("module", "_orig_mod")


def strip_prefixes(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Drop wrapper segments (``module.``, ``_orig_mod.``) wherever they occur in the keys:
    at the front for a wrapped model, inside for a wrapped submodule (DataParallel on
    ``model.features`` gives ``features.module.0.weight``)."""
    return {".".join(p for p in key.split(".") if p not in _WRAPPER_SEGMENTS): value
            for key, value in state_dict.items()}


def is_sharded(model: nn.Module) -> bool:
    """FSDP2 (``fully_shard``): the parameters are DTensors, each process holding a shard."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def atomic_save(obj: Any, path: Path, spare: bool = False) -> None:
    """Write ``obj`` to ``path`` atomically: into a temporary file, flushed and fsync'ed, then
    renamed over ``path``. A kill at any instant leaves the previous file or the new one.

    ``spare=True`` (the training loop's saves): the temporary file is ``.<name>.spare``, the
    version of ``path`` before the current one, overwritten in place; the current one then
    becomes the spare. Rewriting a file's existing pages costs the kernel far less than
    allocating new ones (on this project's 2-core test machine: 0.25 s instead of 1.2-1.8 s
    for 684 MB), which matters for a save that runs beside training every epoch. The spare
    is one more copy on disk until :func:`remove_spares` at the end of the run.
    """
    path = Path(path)
    spare_path = path.with_name(f".{path.name}.spare")
    if spare and spare_path.is_file() and spare_path.stat().st_nlink > 1:
        spare_path.unlink()  # its file is best.pth's too (link_or_write): not to be rewritten
    check_space(obj, path, spare_path if spare and spare_path.is_file() else None)
    if spare and spare_path.is_file():
        tmp, f = spare_path, open(spare_path, "r+b")
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp, f = Path(name), os.fdopen(fd, "wb")
    try:
        with f:
            torch.save(obj, f)
            f.truncate()  # a spare may be longer than this checkpoint
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
            raise UserError(f"cannot save {path}: the write failed ({_first_line(e)})") from None
        raise
    _fsync_folder(path.parent)


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
        super().__init__(f"cannot save {path}: it needs {_mb(needed)} and {path.parent} has "
                         f"{_mb(free)} free; {kept}. Free some space, or give --checkpoint a "
                         "folder on another disk, then --resume")


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB"


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


def check_space(obj: Any, path: Path, spare: Optional[Path] = None) -> None:
    """Fail fast, before writing, when ``obj`` cannot fit beside ``path`` (a spare that is
    rewritten in place already holds its size)."""
    needed, free = _nbytes(obj), _free(path.parent)
    if free is not None:
        free += spare.stat().st_size if spare is not None else 0
        if free < needed:
            raise DiskFull(path, needed, free)


def _replace(new: Path, path: Path, spare: Optional[Path]) -> None:
    """Rename ``new`` over ``path``; with ``spare``, keep ``path``'s current file as the spare."""
    keep = path.with_name(f".{path.name}.{os.getpid()}.keep.tmp")
    try:
        if spare is None or not path.is_file():
            raise OSError
        os.link(path, keep)  # a second name for the current file (no hard links: no spare)
    except OSError:
        os.replace(new, path)
        return
    os.replace(new, path)
    os.replace(keep, spare)


@dataclass
class Link:
    """A file the background writer makes a second name of: ``target`` for ``source``'s
    file (see :func:`link_or_write`)."""
    source: Path
    target: Path
    fallback: Any  # what ``target`` gets written with where there are no hard links


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


def remove_spares(folder: Path) -> None:
    """Delete the spare copies that ``atomic_save(spare=True)`` keeps between saves."""
    for spare in Path(folder).glob(".*.pth.spare"):
        with contextlib.suppress(OSError):
            spare.unlink()


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


def load(path: Path, map_location: Any = "cpu") -> Dict[str, Any]:
    """Load a checkpoint safely; return a dict with at least ``model`` (a state dict)."""
    return load_with_identity(path, map_location)[0]


def load_with_identity(path: Path, map_location: Any = "cpu"
                       ) -> Tuple[Dict[str, Any], Tuple[int, str]]:
    """:func:`load`, and the :func:`identity` of the very bytes it read (one open file)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file")
    try:
        with open(path, "rb") as f:
            ident = identity(f)
            f.seek(0)
            with warnings.catch_warnings():  # odd pickle protocols in a foreign file warn first
                warnings.simplefilter("ignore")
                obj = torch.load(f, map_location=map_location, weights_only=True)
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or _first_line(e)})") from None
    except Exception as e:  # whatever the unpickler raises on bytes that are not a checkpoint
        raise UserError(f"{path}: {_load_failure(e)}") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        ckpt = dict(obj)
    elif isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        ckpt = {"model": obj}  # a bare state_dict, as the article saved
    else:
        raise UserError(f"{path}: not a checkpoint (expected a dict with model weights, "
                        f"found {type(obj).__name__})")
    ckpt["model"] = strip_prefixes(ckpt["model"])
    return ckpt, ident


_END_OF_DIRECTORY = struct.Struct("<4s4H2LH")        # zip's end of central directory record
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")


def identity(f: BinaryIO) -> Tuple[int, str]:
    """What tells two checkpoints apart without reading them whole: the file's size and a
    hash of its zip central directory -- every record's name, size and CRC-32 (the
    weights', ``data.pkl``'s and the serialization id torch.save writes anew each time),
    found from the end record, whatever the number of records. A copy (scp, cp: a new
    modification time) is the same file; another save is not. A file that is not a zip:
    the hash of all of it. OSError if it cannot be read."""
    size = f.seek(0, os.SEEK_END)
    tail_at = max(0, size - (_END_OF_DIRECTORY.size + 0xFFFF + _ZIP64_LOCATOR.size))
    f.seek(tail_at)
    tail = f.read()
    end = tail.rfind(b"PK\x05\x06")
    digest = hashlib.sha256()
    if end < 0 or end + _END_OF_DIRECTORY.size > len(tail):
        f.seek(0)
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
        return size, digest.hexdigest()
    *_, dir_size, dir_at, _comment = _END_OF_DIRECTORY.unpack_from(tail, end)
    locator = end - _ZIP64_LOCATOR.size
    if locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07":  # zip64: its own record
        f.seek(_ZIP64_LOCATOR.unpack_from(tail, locator)[2])
        dir_size, dir_at = _ZIP64_END.unpack(f.read(_ZIP64_END.size))[-2:]
    f.seek(dir_at)
    digest.update(f.read(dir_size))
    return size, digest.hexdigest()


def _load_failure(e: Exception) -> str:
    """Why torch.load failed, in a few words (torch's weights_only advice is not the cause)."""
    text = str(e)
    lines = [ln.strip() for ln in text.split("WeightsUnpickler error:", 1)[-1].splitlines()
             if ln.strip() and not ln.startswith(("Weights only load failed", "Check the doc"))]
    unpickling = type(e).__name__ == "UnpicklingError" or "WeightsUnpickler error:" in text
    if unpickling and "global" in text.lower():
        # "unsupported GLOBAL": the file names a Python callable or class, refused unrun.
        return ("refused: it holds pickled Python objects, which weights_only loading does "
                "not run (not a plain checkpoint)")
    if unpickling:
        return f"not a PyTorch checkpoint ({(lines or [type(e).__name__])[0][:200]})"
    return f"truncated or corrupt checkpoint ({_first_line(e)})"


def checkpoint_num_classes(ckpt: Dict[str, Any]) -> Optional[int]:
    """The number of outputs of the network's last layer (the last 2-D weight), if any."""
    heads = [v for k, v in ckpt["model"].items()
             if k.endswith("weight") and isinstance(v, torch.Tensor) and v.dim() == 2]
    return int(heads[-1].shape[0]) if heads else None


def load_weights(model: nn.Module, ckpt: Dict[str, Any], path: Path) -> None:
    """Load ``ckpt['model']`` into the bare (not yet wrapped) model, with one-line errors on
    mismatch."""
    n_ckpt = checkpoint_num_classes(ckpt)
    n_model = checkpoint_num_classes({"model": model.state_dict()})
    if n_ckpt is not None and n_model is not None and n_ckpt != n_model:
        raise UserError(f"{path}: checkpoint is for {n_ckpt} classes, but the data set "
                        f"has {n_model}")
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        arch = ckpt.get("arch") or "alexnet"
        raise UserError(f"{path}: weights do not fit this network ({arch} in the checkpoint; "
                        f"{_first_line(e)})") from None


# How an optimizer was built to run, not what it learned: kept when a state is loaded.
_IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Dict[str, Any],
                         model: Optional[nn.Module] = None) -> None:
    """``optimizer.load_state_dict(state)``, keeping the implementation this optimizer was
    built with (``model``: an FSDP2 model, whose full ``state`` is sharded again).
    ``load_state_dict`` also restores each param group's saved ``fused`` /
    ``foreach`` flags: a checkpoint written by a non-fused optimizer (another device, an
    older run) would silently turn a fused AdamW back into the foreach one. With a
    GradScaler that breaks outright: the scaler decided at construction that the
    optimizer handles inf/NaN itself (fused), and the foreach path then asserts."""
    built = [{k: g[k] for k in _IMPLEMENTATION_FLAGS if k in g} for g in optimizer.param_groups]
    if model is not None and is_sharded(model):  # a full state, sharded again on every rank
        set_optimizer_state_dict(model, optimizer, state,
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, built):
        group.update(flags)


def newest(folder: Path, flag: str = "--checkpoint") -> Path:
    """The most recently written ``last.pth`` under ``folder`` (recursively): the end of the
    newest run; or, where there is none, the newest ``.pth``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{flag} {folder}: no such file or folder")
    files = [p for p in folder.rglob("*.pth") if p.is_file() and not p.name.startswith(".")]
    if not files:
        raise UserError(f"{flag} {folder}: no .pth checkpoint in this folder "
                        f"(train first, or pass {flag} FILE)")
    last = [p for p in files if p.name == LAST]
    return max(last or files, key=lambda p: p.stat().st_mtime_ns)


def resolve(path: Path, flag: str = "--checkpoint") -> Path:
    """A checkpoint flag's value: a file, or a folder whose newest last.pth is used."""
    path = Path(path)
    return path if path.is_file() else newest(path, flag)


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


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
