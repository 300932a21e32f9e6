"""Checkpoint files, read: their names and what they hold, finding one, loading it safely
(``torch.load(weights_only=True)``: pickled callables are refused unrun; every failure is one
line naming the file), and its :func:`identity`, which the ranks compare as they resume.
A wrapper's segment in a key (``module.``, ``_orig_mod.``) is dropped on save and on load:
any eval script loads any variant's checkpoint, older files included.
"""
from __future__ import annotations

import copy
import hashlib
import io
import os
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from ..distributed import load_state
from ..errors import UserError, first_line
from .messages import load_failure
from .validate import record_fault

LAST, BEST = "last.pth", "best.pth"


# A checkpoint is each entry of the script's state by name ("model": the unwrapped weights;
# "progress": where the run stands) beside the run's RECORD (what the run was) and what only
# a resume reads (RESUMING: every rank's random streams, the weights of a best epoch best.pth
# does not hold yet). Older checkpoints kept where the run stood at the top (PROGRESS).
RECORD = ("arch", "num_classes", "variant", "world_size", "args", "torch_version")
RESUMING = ("rng", "best_model")
PROGRESS = ("epoch", "step", "best_acc", "best_epoch", "val_acc", "epoch_so_far")


def progress_of(ckpt: Dict[str, Any]) -> Dict[str, Any]:
    """Where the checkpoint's run stood: its progress entry, or an older file's fields."""
    if isinstance(ckpt.get("progress"), dict):
        return ckpt["progress"]
    old = {k: ckpt[k] for k in PROGRESS if k in ckpt}
    return old | ({"so_far": old.pop("epoch_so_far")} if "epoch_so_far" in old else {})


def weights_of(ckpt: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint's weights, record and progress: best.pth's content."""
    return {k: x for k, x in ckpt.items() if k in ("model", "progress", *RECORD)}


def unsaveable(state: Mapping[str, Any]) -> str:
    """Why the script's ``state`` (name -> object; None: not in this run) cannot be
    checkpointed, in one line; "" if it can. Each entry needs ``state_dict()`` and
    ``load_state_dict()``, and what it saves must load back under ``weights_only=True``,
    tried at once on a copy with empty tensors, so that a run learns it at its start."""
    clash = sorted(set(state) & set(RECORD + RESUMING + PROGRESS))
    if "model" not in state or clash:
        return (f"the checkpoint's state must name the weights 'model' and no entry the run's "
                f"record keeps ({', '.join(RECORD + RESUMING + PROGRESS)})"
                + (f": it names {', '.join(clash)}" if clash else ""))
    for name, obj in ((n, o) for n, o in state.items() if o is not None):
        what = f"the checkpoint's {name!r} ({type(obj).__name__})"
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            return f"{what} has no state_dict() and load_state_dict()"
        buffer = io.BytesIO()
        # torch.serialization's own names: a check in memory, which a wrapper of torch.save
        # (a test's fault, a profiler) must not count as a checkpoint write.
        torch.serialization.save(_skeleton(obj.state_dict()), buffer)
        buffer.seek(0)
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(buffer)
        if unsafe:
            return (f"{what} cannot be saved and loaded back with torch.load(weights_only=True):"
                    f" its state_dict() holds {', '.join(unsafe)}")
    return ""


def _skeleton(obj: Any) -> Any:
    """``obj`` with every tensor an empty one of its dtype: what the unpickler judges."""
    if isinstance(obj, torch.Tensor):
        return torch.empty(0, dtype=obj.dtype)
    if type(obj) in (list, tuple):
        return type(obj)(_skeleton(v) for v in obj)
    if isinstance(obj, dict):
        # Of its own type (OrderedDict, defaultdict), which the unpickler judges too.
        out = copy.copy(obj)
        out.update((k, _skeleton(v)) for k, v in obj.items())
        return out
    return obj


def args_to_plain(args) -> Dict[str, Any]:
    """The run's flags (an argparse Namespace) as a checkpoint stores them, and as a resumed
    run's are compared with them: str, int, float, bool or None (not which were given)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
            if k != "given"}


def strip_prefixes(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Keys without wrapper segments, at the front or inside (DataParallel on
    ``model.features`` gives ``features.module.0.weight``)."""
    return {".".join(p for p in key.split(".") if p not in ("module", "_orig_mod")): value
            for key, value in state_dict.items()}


def load(path: Path, map_location: Any = "cpu") -> Dict[str, Any]:
    """A checkpoint, safely: a dict with at least ``model`` (a state dict)."""
    return load_with_identity(path, map_location)[0]


def load_with_identity(path: Path, map_location: Any = "cpu"
                       ) -> Tuple[Dict[str, Any], Tuple[int, str]]:
    """:func:`load`, and the :func:`identity` of the very bytes it read, checked first."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file")
    try:
        with open(path, "rb") as f:
            ident = identity(f)
            f.seek(0)
            unsafe = _unsafe_globals(f)
            if unsafe:
                raise UserError(f"{path}: refused: it holds pickled Python objects "
                                f"({', '.join(unsafe[:3])}), which weights_only loading does "
                                "not run (not a plain checkpoint)")
            f.seek(0)
            # Odd pickle protocols in a foreign file warn before they fail.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = torch.load(f, map_location=map_location, weights_only=True)
    except UserError:
        raise
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or first_line(e)})") from None
    except Damaged as e:
        raise UserError(f"{path}: corrupt: {e}; nothing was loaded from it (use another copy, "
                        "or an earlier checkpoint)") from None
    # Whatever the unpickler raises on bytes that are not a checkpoint.
    except Exception as e:
        raise UserError(f"{path}: {load_failure(e)}") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        ckpt = dict(obj)
    elif isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        ckpt = {"model": obj}  # a bare state_dict, as the article saved
    else:
        raise UserError(f"{path}: not a checkpoint (expected a dict with model weights, "
                        f"found {type(obj).__name__})")
    fault = record_fault(ckpt) or next((f"its weights hold {key!r}, not a tensor" for key, value
                                        in ckpt["model"].items()
                                        if not (isinstance(key, str)
                                                and isinstance(value, torch.Tensor))), "")
    if fault:
        raise UserError(f"{path}: not a checkpoint a run of this project writes: {fault}")
    ckpt["model"] = strip_prefixes(ckpt["model"])
    return ckpt, ident


def _unsafe_globals(f: BinaryIO) -> list:
    """What weights_only loading would refuse to run, by torch's own reading of the pickle
    (none listed for a file torch.save did not write as a zip: torch.load says what it is)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(f)
    # Whatever a damaged or foreign pickle raises: torch.load says it next.
    except Exception:
        return []


class Damaged(Exception):
    """A checkpoint's bytes are not those it was written with."""


CHUNK = 1 << 24


def identity(f: BinaryIO) -> Tuple[int, str]:
    """The file's size and a hash of what it holds, each record's bytes checked on the way.
    torch.load never checks a zip record's CRC-32, so a flipped byte would load as other
    weights: here zipfile reads every record and checks it (a :class:`Damaged` names the
    first that fails), and the hash is of each record's name, size and CRC-32, now known to
    be its bytes'. A file written without CRCs (``set_crc32_options(False)``: each is 0)
    has nothing to check against, and is hashed whole, as is a file that is not a zip."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    try:
        archive = zipfile.ZipFile(f)
    except zipfile.BadZipFile:
        archive = None
    records = archive.infolist() if archive else []
    try:
        for record in (r for r in records if r.CRC):
            with archive.open(record) as data:
                while data.read(CHUNK):
                    pass
    except (zipfile.BadZipFile, EOFError, NotImplementedError, zlib.error) as e:
        raise Damaged(first_line(e)) from None
    digest = hashlib.sha256()
    if records and all(r.CRC for r in records):
        for record in records:
            digest.update(f"{record.filename} {record.file_size} {record.CRC}\n".encode())
    else:
        f.seek(0)
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return size, digest.hexdigest()


def _classes(weights: Dict[str, Any]) -> Optional[int]:
    """The outputs of the network's last layer (its last 2-D weight), if any."""
    heads = [v for k, v in weights.items()
             if k.endswith("weight") and isinstance(v, torch.Tensor) and v.dim() == 2]
    return int(heads[-1].shape[0]) if heads else None


def load_weights(model: nn.Module, ckpt: Dict[str, Any], path: Path) -> None:
    """``ckpt['model']`` (bare names) into the network, by the names it has now, whatever
    wrapper it holds (DataParallel on ``model.features``: ``features.module.0.weight``); a
    sharded (FSDP2) one's shards from the full weights. A mismatch is one line."""
    own = model.state_dict()
    n_ckpt, n_model = _classes(ckpt["model"]), _classes(own)
    if None not in (n_ckpt, n_model) and n_ckpt != n_model:
        raise UserError(f"{path}: checkpoint is for {n_ckpt} classes, but the data set "
                        f"has {n_model}")
    named = dict(zip(strip_prefixes(own), own))
    try:
        load_state(model, {named.get(k, k): v for k, v in ckpt["model"].items()}, model)
    except RuntimeError as e:
        raise UserError(f"{path}: weights do not fit this network ({ckpt.get('arch', 'alexnet')}"
                        f" in the checkpoint; {first_line(e)})") from None


def resolve(path: Path, flag: str = "--checkpoint") -> Path:
    """A checkpoint flag's value: a file, or a folder whose newest ``last.pth`` (the end of
    its newest run; else its newest ``.pth``), searched recursively, is used."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise UserError(f"{flag} {path}: no such file or folder")
    files = [p for p in path.rglob("*.pth") if p.is_file() and not p.name.startswith(".")]
    if not files:
        raise UserError(f"{flag} {path}: no .pth checkpoint in this folder "
                        f"(train first, or pass {flag} FILE)")
    last = [p for p in files if p.name == LAST]
    return max(last or files, key=lambda p: p.stat().st_mtime_ns)
