"""Peak memory, per period: reset at its start, read at its end, the same way on any device.

On a GPU the peak is ``torch.cuda.max_memory_allocated`` (what the caching allocator handed
out, not what it holds); on the CPU the process's peak resident memory (``VmHWM``), which
Linux >= 4.0 lets a process reset through ``/proc/self/clear_refs``. Without a reset the
figure would be the peak since the process started: the first epoch's cuDNN autotuning
workspaces, say, in every later epoch's figure.
"""
from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path

import torch


def reset_peak_memory(device: torch.device, all_gpus: bool = False) -> bool:
    """Start a new peak: the memory in use now. ``all_gpus``: every visible GPU (as
    DataParallel uses them). False where the CPU's peak cannot be reset (not Linux)."""
    if device.type == "cuda":
        for i in (range(torch.cuda.device_count()) if all_gpus else [device]):
            torch.cuda.reset_peak_memory_stats(i)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
        return True
    except OSError:
        return False


def peak_memory_mb(device: torch.device, all_gpus: bool = False) -> float:
    """Peak memory since the last :func:`reset_peak_memory`: allocated on the GPU
    (``all_gpus``: the largest over the visible GPUs), or peak RSS on the CPU."""
    if device.type == "cuda":
        ids = range(torch.cuda.device_count()) if all_gpus else [device]
        return max(torch.cuda.max_memory_allocated(i) for i in ids) / 2**20
    return _host_peak_mb()


def memory_kind(device: torch.device, reset: bool = True) -> str:
    """What :func:`peak_memory_mb` measures, for logs and tables."""
    if device.type == "cuda":
        return "cuda_allocated"
    return "max_rss" if reset else "max_rss_since_start"


def _host_peak_mb() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)
