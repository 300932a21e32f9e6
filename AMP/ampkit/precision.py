"""What precision a run computes in, beside the objects each script builds in view
(``torch.autocast``, ``torch.amp.GradScaler``, FSDP2's ``MixedPrecisionPolicy``): the
``--amp_dtype`` a device takes, the forward that enters autocast itself (for DataParallel's
replica threads), whether this CPU has native bfloat16, and CUDA's fp32 math (TF32).
"""
from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from .errors import UserError


def resolve_amp_dtype(name: Optional[str], device: torch.device) -> torch.dtype:
    """``--amp_dtype``, or the device's default: float16 on an accelerator (its fast low
    precision: CUDA's and ROCm's tensor cores, XPU's, MPS's), bfloat16 on the CPU (where
    CPU autocast supports float16 only for some operators). A dtype the device cannot
    compute in is one line."""
    if name is None:
        name = "bfloat16" if device.type == "cpu" else "float16"
    dtype = getattr(torch, name)
    if dtype is torch.bfloat16 and not _bf16_supported(device):
        module = torch.get_device_module(device.type)
        what = (module.get_device_name(device) if hasattr(module, "get_device_name")
                else f"this {device.type} device")
        raise UserError(f"--amp_dtype bfloat16: {what} does not support bfloat16 (use "
                        "--amp_dtype float16)")
    return dtype


def _bf16_supported(device: torch.device) -> bool:
    """CUDA and XPU say so themselves, counting no emulation: by default
    ``is_bf16_supported()`` says yes on a V100 or T4 too, where bfloat16 is emulated and
    slower than float32. MPS computes in bfloat16 from macOS 14 on, and an older one refuses
    a bfloat16 tensor."""
    if device.type == "cpu":
        return True
    check = getattr(torch.get_device_module(device.type), "is_bf16_supported", None)
    if check is not None:
        if "including_emulation" in inspect.signature(check).parameters:
            return bool(check(including_emulation=False))
        return bool(check())
    try:
        torch.ones(1, dtype=torch.bfloat16, device=device).add_(1)
        return True
    except (RuntimeError, TypeError):
        return False


def autocast_forward(forward: Callable) -> Callable:
    """A module's ``forward`` that runs under ``torch.autocast(input.device.type,
    self.amp_dtype)`` in whatever thread calls it (``amp_dtype`` None: as called): the
    article's ``@autocast()`` on AlexNet's forward, with the dtype chosen at run time.
    DataParallel runs each replica in a thread of its own, where autocast's dtype is not
    the caller's."""

    @functools.wraps(forward)
    def wrapper(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any):
        dtype = getattr(self, "amp_dtype", None)
        if dtype is None:
            return forward(self, x, *args, **kwargs)
        with torch.amp.autocast(device_type=x.device.type, dtype=dtype):
            return forward(self, x, *args, **kwargs)

    return wrapper


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


def slow_bf16(dtype: Optional[torch.dtype], device: torch.device) -> Optional[str]:
    """A warning when a run computes in bfloat16 on a CPU without native bfloat16."""
    if dtype is torch.bfloat16 and device.type == "cpu" and cpu_has_fast_bf16() is False:
        return ("this CPU has no native bfloat16 (AVX512-BF16/AMX): CPU autocast will be "
                "several times slower than fp32 here")
    return None


def set_tf32(enabled: Optional[bool]) -> str:
    """Apply --tf32 / --no-tf32 to CUDA's fp32 convolutions and matmuls; None keeps PyTorch's
    defaults. Returns what fp32 math then is, for labels: on Ampere and newer GPUs TF32
    (10-bit mantissa) is several times faster than fp32, so an "fp32" baseline is only
    fp32 where it says so.

    Convolutions take cuDNN's ``fp32_precision`` (torch >= 2.9; the legacy ``allow_tf32``
    flags warn there). Matmuls take ``torch.set_float32_matmul_precision``, not
    ``torch.backends.cuda.matmul.fp32_precision``: after the latter, reading the matmul
    precision (``torch.get_float32_matmul_precision()``, as inductor's autotuning cache
    does under --compile) raises on torch 2.14, the former keeps every reading consistent."""
    if enabled is not None:
        conv = getattr(torch.backends.cudnn, "conv", None)
        if conv is not None and hasattr(conv, "fp32_precision"):  # torch >= 2.9
            conv.fp32_precision = "tf32" if enabled else "ieee"
        else:
            torch.backends.cudnn.allow_tf32 = enabled
        torch.set_float32_matmul_precision("high" if enabled else "highest")
    return {True: "tf32", False: "fp32"}.get(enabled, "tf32 conv, fp32 matmul")


def set_cuda_math(tf32: Optional[bool], device: torch.device) -> str:
    """A run's CUDA math: ``set_tf32(tf32)``, and cuDNN picks its convolution kernels for
    the run's fixed input size; the fp32 math's label ("" off CUDA, where --tf32 and
    --no-tf32 would change nothing: refused in one line)."""
    if device.type != "cuda":
        if tf32 is not None:
            flag = "--tf32" if tf32 else "--no-tf32"
            raise UserError(f"{flag} chooses CUDA's fp32 math (TF32 tensor cores or full "
                            f"fp32); this run is on the {device.type}, whose fp32 is fp32: "
                            "leave it out")
        return ""
    torch.backends.cudnn.benchmark = True
    return set_tf32(tf32)
