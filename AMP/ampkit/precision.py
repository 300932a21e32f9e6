"""Precision helpers: which autocast dtype a run uses, the forward that enters autocast
itself, TF32, --compile, and GradScaler's skipped steps.

The precision objects themselves (``torch.autocast`` and ``torch.amp.GradScaler``) are
built by each training script, where a reader sees them.
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .machinery.process import UserError


def resolve_amp_dtype(name: Optional[str], device: torch.device) -> torch.dtype:
    """``--amp_dtype``, or the default: float16 on CUDA, bfloat16 on the CPU (where CPU
    autocast supports float16 only for some operators)."""
    if name is None:
        name = "float16" if device.type == "cuda" else "bfloat16"
    dtype = getattr(torch, name)
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError(f"--amp_dtype bfloat16: {torch.cuda.get_device_name(device)} does not "
                        "support bfloat16 (use --amp_dtype float16)")
    return dtype


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


def cuda_math(tf32: Optional[bool], device: torch.device) -> str:
    """A run's CUDA math: ``set_tf32(tf32)``, and cuDNN picks its convolution kernels for
    the run's fixed input size; the fp32 math's label ("" on the CPU)."""
    if device.type != "cuda":
        return ""
    torch.backends.cudnn.benchmark = True
    return set_tf32(tf32)


def compile_in_place(model: torch.nn.Module) -> None:
    """``model.compile()`` (in place: the script's step calls the compiled model), with the
    compiled backward outside autocast, where this project's loops run the backward. By
    default a compiled backward runs under the forward's autocast state, which torch's AMP
    notes warn against for code that, like ours, calls backward() outside autocast."""
    from torch._functorch import config as functorch_config

    if isinstance(model, torch.nn.DataParallel):
        raise UserError("--compile is supported for single-device, DDP and FSDP2 runs, not "
                        "DataParallel")
    if hasattr(functorch_config, "backward_pass_autocast"):  # not in every torch release
        functorch_config.backward_pass_autocast = "off"
    model.compile()


class SkippedSteps:
    """Counts the optimizer steps a GradScaler skipped (inf/NaN gradients), on the device.

    Why not ``scaler.get_scale()``: it returns a Python float, so calling it after every
    step would make the host wait for the GPU at every step. The scale is a tensor on the
    device (GradScaler's private ``_scale``; there is no public accessor for the tensor),
    and ``update()`` halves it exactly when ``step()`` was skipped, so comparing it
    before and after a step counts the skips without a sync. ``scaler=None`` or a
    disabled scaler: counts nothing.
    """

    def __init__(self, scaler: Optional[torch.amp.GradScaler], device: torch.device) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.last = torch.zeros((), dtype=torch.bool, device=device)  # the last step skipped
        self._scale: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around one optimizer step."""
        if self.scaler is None:
            yield
            return
        before = self._scale
        if before is None:  # before the first step the scale is still a float: no sync
            before = torch.tensor(self.scaler.get_scale(), device=self.count.device)
        yield
        after = self.scaler._scale
        self.last = (after < before).squeeze()
        self.count += self.last.long()
        self._scale = after.clone()
