"""Where this process runs: its device, its place among the processes, and the device's own
clock sync and memory peaks.

- The device: one for a script that runs in one process (``single_process_device``: CUDA,
  DataParallel's first GPU, or the CPU), ``cuda:LOCAL_RANK`` or the CPU for a process of a
  group (``process_device``); ``--cuda`` without CUDA is an error, not a CPU run.
- :class:`DistInfo`: the device, the rank among ``world_size`` (0 of 1 without a group),
  the local rank; ``ampkit.distributed.this_process`` makes it from the group.
- ``synchronize`` before a clock is read; the peak memory of a period (reset at its start,
  read at its end): on a GPU ``torch.cuda.max_memory_allocated`` (what the caching
  allocator handed out, not what it holds), on the CPU the peak resident memory
  (``VmHWM``), which Linux >= 4.0 lets a process reset through ``/proc/self/clear_refs``.
  Without a reset the figure would be the peak since the process started.
"""
from __future__ import annotations

import contextlib
import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .errors import UserError


def want_cuda(flag: Optional[bool]) -> bool:
    """``--cuda`` (True), ``--no-cuda`` (False) or neither (None: CUDA when available)."""
    if flag is None:
        return torch.cuda.is_available()
    if flag and not torch.cuda.is_available():
        raise UserError("--cuda was given but CUDA is not available on this machine "
                        "(use --no-cuda to run on the CPU)")
    return flag


def single_process_device(cuda_flag: Optional[bool]) -> torch.device:
    """The device of a script that runs in one process (one device, or DataParallel)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun started N copies of a single-process script: each would train the same
        # model on the same data and write the same files.
        raise UserError(f"this script runs in one process (one device or DataParallel), but "
                        f"torchrun started {os.environ['WORLD_SIZE']} (WORLD_SIZE): run it with "
                        "python, or use a DDP or FSDP script (train_DDP*, train_FSDP*, "
                        "eval_DDP) under torchrun")
    return torch.device("cuda" if want_cuda(cuda_flag) else "cpu")


def process_device(cuda_flag: Optional[bool], local_rank: int) -> torch.device:
    """The device this process of a group owns: ``cuda:LOCAL_RANK``, or the CPU."""
    if not want_cuda(cuda_flag):
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} "
                        "GPU(s) are visible: start at most one process per GPU")
    return torch.device("cuda", local_rank)


@dataclass
class DistInfo:
    """This process: its device, and its rank among ``world_size`` (0 of 1 without a group)."""
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    distributed: bool = False  # a process group is initialised

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that prints, logs and writes."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that prepares data."""
        return self.local_rank == 0


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def memory_kind(device: torch.device, reset: bool = True) -> str:
    """What :func:`peak_memory_mb` measures, for logs and tables."""
    if device.type == "cuda":
        return "cuda_allocated"
    return "max_rss" if reset else "max_rss_since_start"
