"""The three precision modes differ by two objects: an autocast context and a GradScaler.

- ``fp32``: autocast disabled, scaler disabled.
- ``autocast``: autocast on (float16 on CUDA, bfloat16 on the CPU by default), no scaler.
- ``grad_scaler``: autocast on plus ``torch.amp.GradScaler`` (loss scaling; needed for
  float16, harmless but unnecessary for bfloat16, which has fp32's exponent range).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, ContextManager, Optional

import torch

from .errors import UserError

PRECISIONS = ("fp32", "autocast", "grad_scaler")


def resolve_amp_dtype(name: Optional[str], device: torch.device) -> torch.dtype:
    if name is None:
        name = "float16" if device.type == "cuda" else "bfloat16"
    dtype = getattr(torch, name)
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError(f"--amp_dtype bfloat16: {torch.cuda.get_device_name(device)} does not "
                        "support bfloat16 (use --amp_dtype float16)")
    return dtype


def cpu_has_fast_bf16() -> Optional[bool]:
    """True/False from the CPU flags (AVX512-BF16 or AMX), None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def autocast_factory(device: torch.device, dtype: Optional[torch.dtype]) -> Callable[[], ContextManager]:
    """A zero-argument factory of the autocast context (``dtype=None``: fp32, no autocast)."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.amp.autocast(device_type=device.type, dtype=dtype)


def make_scaler(device: torch.device, enabled: bool) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device.type, enabled=enabled)
