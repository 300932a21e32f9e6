"""Checkpoints on disk, read: their names and layout (the script's state beside the run's
record), what may be in one, finding one, loading it safely, its identity.

- A wrapper's segment left in a key (``module.``, ``_orig_mod.``) is dropped on save and on
  load: any eval script loads any variant's checkpoint, older files included.
- ``torch.load(weights_only=True)``: pickled callables are refused unrun; every failure is
  one line naming the file.
- :func:`identity`: a file's size and a hash of its zip directory, what the ranks compare
  before and after they resume. Writing is :mod:`.writer`'s.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import os
import re
import struct
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from ..errors import UserError, first_line

LAST, BEST = "last.pth", "best.pth"


# A checkpoint is each entry of the script's state by name -- "model" (the unwrapped
# weights), and whatever else it names -- beside the run's record: where the run stands and
# what it was (Record), and what only a resume needs (RESUMING: every rank's random streams,
# a stopped epoch's figures so far, the weights of a best epoch best.pth does not hold yet).
@dataclasses.dataclass
class Record:
    epoch: int
    step: int
    best_acc: float
    best_epoch: int
    val_acc: Optional[float]
    arch: str
    num_classes: int
    variant: str
    world_size: int
    args: dict
    torch_version: str


RECORD = tuple(f.name for f in dataclasses.fields(Record))
RESUMING = ("rng", "epoch_so_far", "best_model")


def weights_of(state: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint's weights and record: best.pth's content."""
    return {k: x for k, x in state.items() if k == "model" or k in RECORD}


def entries_of(state: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint's entries but its weights (loaded before ``build()``) and its record."""
    return {k: x for k, x in state.items() if k != "model" and k not in RECORD + RESUMING}


def refusal(state: Mapping[str, Any]) -> str:
    """Why the script's ``state`` (name -> object) cannot be checkpointed, in one line; ""
    if it can. Each entry needs ``state_dict()`` and ``load_state_dict()``, and what it
    saves must load back under ``weights_only=True`` (tried at once on a copy whose tensors
    are empty, so a run learns it at its start, not at its first save)."""
    clash = sorted(set(state) & set(RECORD + RESUMING))
    if "model" not in state or clash:
        return (f"the checkpoint's state must name the weights 'model' and no entry the run's "
                f"record keeps ({', '.join(RECORD + RESUMING)})"
                + (f": it names {', '.join(clash)}" if clash else ""))
    for name, obj in state.items():
        if obj is None:  # no such object in this run (a scaler that does not run)
            continue
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            return (f"the checkpoint's {name!r} ({type(obj).__name__}) has no state_dict() "
                    "and load_state_dict()")
        buffer = io.BytesIO()
        try:
            # torch.serialization's own names: a check in memory, not a checkpoint write
            # (what a wrapper of torch.save, a test's fault or a profiler's, would count).
            torch.serialization.save(_skeleton(obj.state_dict()), buffer)
            buffer.seek(0)
            torch.serialization.load(buffer, weights_only=True)
        except Exception as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            why = f"holds {found[1]}" if found else first_line(e)
            return (f"the checkpoint's {name!r} ({type(obj).__name__}) cannot be saved and "
                    f"loaded back with torch.load(weights_only=True): its state_dict() {why}")
    return ""


def _skeleton(obj: Any) -> Any:
    """``obj`` with every tensor an empty one of its dtype: what the unpickler judges."""
    if isinstance(obj, torch.Tensor):
        return torch.empty(0, dtype=obj.dtype)
    if type(obj) in (list, tuple):
        return type(obj)(_skeleton(v) for v in obj)
    if isinstance(obj, dict):
        # Its own type (OrderedDict, defaultdict, ...), which the unpickler judges too.
        out = copy.copy(obj)
        out.update((k, _skeleton(v)) for k, v in obj.items())
        return out
    return obj


def args_to_plain(args) -> dict:
    """The run's flags (an argparse Namespace) as plain data (str/int/float/bool/None): safe
    to store in a checkpoint, and to compare with a resumed run's."""
    return {k: plain(v) for k, v in vars(args).items()}


def plain(value):
    return str(value) if isinstance(value, Path) else value


_WRAPPER_SEGMENTS = ("module", "_orig_mod")


def strip_prefixes(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Drop wrapper segments (``module.``, ``_orig_mod.``) wherever they occur in the keys:
    at the front for a wrapped model, inside for a wrapped submodule (DataParallel on
    ``model.features`` gives ``features.module.0.weight``)."""
    return {".".join(p for p in key.split(".") if p not in _WRAPPER_SEGMENTS): value
            for key, value in state_dict.items()}


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
            # Odd pickle protocols in a foreign file warn before they fail.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = torch.load(f, map_location=map_location, weights_only=True)
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or first_line(e)})") from None
    # Whatever the unpickler raises on bytes that are not a checkpoint.
    except Exception as e:
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


# Zip's end of central directory record, and zip64's locator and end record.
_END_OF_DIRECTORY = struct.Struct("<4s4H2LH")
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
    # Zip64 keeps the directory's size and offset in a record of its own.
    if locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07":
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
    return f"truncated or corrupt checkpoint ({first_line(e)})"


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
                        f"{first_line(e)})") from None


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


def load_weights_from(model: nn.Module, path: Path, flag: str) -> None:
    """``flag``'s checkpoint (a file, or a folder's newest last.pth): its weights alone, into
    the bare model (``--init_from``: a new run from another run's weights)."""
    path = resolve(path, flag)
    load_weights(model, load(path), path)
