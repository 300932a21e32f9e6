"""Checkpoint IO: atomic writes, safe loads, prefix-free weights.

- Weights are saved from the unwrapped model (no ``module.`` / ``_orig_mod.``
  prefixes), so any eval script loads any variant's checkpoint; prefixes in
  older files are stripped on load.
- Writes go to a temporary file in the same folder, are flushed and fsync'ed,
  then ``os.replace``d over the target: a kill at any instant leaves either the
  previous file or the new one, never a truncated one.
- Loads use ``torch.load(weights_only=True)``: a file carrying pickled callables
  is refused without running them. Every failure is one line naming the file.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from .errors import UserError

LAST, BEST = "last.pth", "best.pth"
_WRAPPER_SEGMENTS = ("module", "_orig_mod")


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside DataParallel / DDP / torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def strip_prefixes(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Drop wrapper segments (``module.``, ``_orig_mod.``) wherever they occur in the keys:
    at the front for a wrapped model, inside for a wrapped submodule (DataParallel on
    ``model.features`` gives ``features.module.0.weight``)."""
    return {".".join(p for p in key.split(".") if p not in _WRAPPER_SEGMENTS): value
            for key, value in state_dict.items()}


def model_state(model: nn.Module) -> Dict[str, Any]:
    """The model's weights without any wrapper prefix: loadable by every variant."""
    return strip_prefixes(unwrap(model).state_dict())


def atomic_save(obj: Any, path: Path) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # Persist the rename itself (the directory entry).
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def load(path: Path, map_location: Any = "cpu") -> Dict[str, Any]:
    """Load a checkpoint safely; return a dict with at least ``model`` (a state dict)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # "Unsupported global": the file names a Python callable/class, refused unrun.
        # Anything else (bad opcode, garbage bytes) means the file is not a checkpoint.
        # torch's message opens with advice about weights_only; the cause follows the marker.
        detail = str(e).split("WeightsUnpickler error:", 1)[-1]
        if "global" in detail.lower():
            raise UserError(f"{path}: refused: it holds pickled Python objects, which "
                            "weights_only loading does not run (not a plain checkpoint)") from None
        reason = detail.strip().splitlines()[0][:200] if detail.strip() else _first_line(e)
        raise UserError(f"{path}: not a PyTorch checkpoint ({reason})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise UserError(f"{path}: truncated or corrupt checkpoint ({_first_line(e)})") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        ckpt = dict(obj)
    elif isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        ckpt = {"model": obj}  # a bare state_dict, as the article saved
    else:
        raise UserError(f"{path}: not a checkpoint (expected a dict with model weights, "
                        f"found {type(obj).__name__})")
    ckpt["model"] = strip_prefixes(ckpt["model"])
    return ckpt


def checkpoint_num_classes(ckpt: Dict[str, Any]) -> Optional[int]:
    w = ckpt["model"].get("classifier.6.weight")
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def load_weights(model: nn.Module, ckpt: Dict[str, Any], path: Path) -> None:
    """Load ``ckpt['model']`` into the bare model, with one-line errors on mismatch."""
    bare = unwrap(model)
    n_ckpt, n_model = checkpoint_num_classes(ckpt), getattr(bare, "num_classes", None)
    if n_ckpt is not None and n_model is not None and n_ckpt != n_model:
        raise UserError(f"{path}: checkpoint is for {n_ckpt} classes, but the data set "
                        f"has {n_model}")
    try:
        bare.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UserError(f"{path}: weights do not fit this AlexNet ({_first_line(e)})") from None


def newest(folder: Path) -> Path:
    """The most recently written ``.pth`` under ``folder`` (recursively)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--checkpoint {folder}: no such file or folder")
    files = [p for p in folder.rglob("*.pth") if p.is_file() and not p.name.startswith(".")]
    if not files:
        raise UserError(f"--checkpoint {folder}: no .pth checkpoint in this folder "
                        "(train first, or pass --checkpoint FILE)")
    return max(files, key=lambda p: p.stat().st_mtime_ns)


def resolve(path: Path) -> Path:
    """``--checkpoint`` of an eval script: a file, or a folder whose newest .pth is used."""
    path = Path(path)
    return path if path.is_file() else newest(path)


def remove_stale_temps(folder: Path) -> None:
    """Delete temporary files left by a save that was killed (they never replaced a checkpoint)."""
    for tmp in Path(folder).glob(".*.pth.*.tmp"):
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
