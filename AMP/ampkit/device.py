"""Where this process runs: its device, its place among the processes, and the device's own
clock sync and memory peaks, by PyTorch's device-generic calls (``torch.accelerator``).

- The device (``--device``): ``auto`` is the accelerator this machine has --
  ``torch.accelerator.current_accelerator(check_available=True)``: CUDA (and ROCm, which
  PyTorch calls cuda), Intel's XPU or Apple's MPS -- else the CPU; a named one that is not
  there is one line. ``--cuda`` / ``--no-cuda`` spell ``--device cuda`` / ``cpu``. A
  script of one process takes the device whole (:func:`single_process_device`); a
  process of a group takes ``<type>:LOCAL_RANK`` (:func:`process_device`).
- What a device cannot run is refused in one line (:func:`refusal`): DataParallel is
  CUDA's (on the CPU it just calls the model, as the article's comparison had it); c10d,
  PyTorch's collectives, cannot move MPS tensors, so no DDP or FSDP2 there; no GradScaler
  where its kernels are missing or, on MPS, not yet trusted.
- :class:`DistInfo`: the device, the rank among ``world_size`` (0 of 1 without a group),
  the local rank; ``ampkit.distributed.this_process`` makes it from the group.
- ``synchronize`` before a clock is read; the peak memory of a period (reset at its start,
  read at its end): an accelerator's allocator peak (``torch.accelerator.memory``: what it
  handed out, not what it holds), where the device keeps one ("n/a" where not); on the
  CPU the peak resident memory (``VmHWM``), which Linux >= 4.0 lets a process reset
  through ``/proc/self/clear_refs``. Without a reset the figure would be the peak since
  the process started.
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

DEVICES = ("auto", "cuda", "xpu", "mps", "cpu")
NAMES = {"cuda": "CUDA (or ROCm) GPU", "xpu": "Intel XPU", "mps": "Apple MPS device",
         "cpu": "CPU"}


def accelerator() -> Optional[str]:
    """The type of this machine's accelerator that is there to use (None: none)."""
    found = torch.accelerator.current_accelerator(check_available=True)
    return found.type if found is not None else None


def device_type(choice: str) -> str:
    """``--device``'s type: ``auto`` -> this machine's accelerator, else ``cpu``; a named
    accelerator must be there (one line if not: a silent CPU run would be many times
    slower than the user asked for)."""
    there = accelerator()
    if choice == "auto":
        return there or "cpu"
    if choice != "cpu" and choice != there:
        sees = f"it has {NAMES[there]}s (--device {there})" if there else "it has no accelerator"
        raise UserError(f"--device {choice}: this machine has no {NAMES[choice]} that torch "
                        f"{torch.__version__.split('+')[0]} can use ({sees}); leave --device "
                        "out to use what it has, or give --device cpu")
    return choice


# GradScaler's own kernels: a build has them for a device, or it cannot scale losses there.
_SCALER_OPS = ("aten::_amp_foreach_non_finite_check_and_unscale_", "aten::_amp_update_scale_")


def refusal(kind: str, *, data_parallel: bool = False, process_group: bool = False,
            loss_scaling: bool = False) -> Optional[str]:
    """Why a script cannot run on a device of type ``kind`` (None if it can): with
    ``data_parallel``, ``process_group`` (DDP, FSDP2) or ``loss_scaling`` (a GradScaler)."""
    if data_parallel and kind not in ("cuda", "cpu"):
        return (f"nn.DataParallel is CUDA's: it cannot replicate over {NAMES[kind]}s; "
                "train_DDP*.py runs one process per device")
    if process_group and kind == "mps":
        return ("DDP and FSDP2 cannot run on MPS: c10d, PyTorch's collectives, cannot move "
                "MPS tensors; train_without.py or train_autocast.py run on it")
    if loss_scaling and kind == "mps":
        return ("torch.amp.GradScaler on MPS: its kernels (torch 2.8 on) had silent-correctness "
                "fixes merged as late as June 2026 (pytorch#184286: fp16 gradients zeroed, "
                "#186360: fused AdamW ignoring a skipped step); on MPS, train_autocast.py "
                "(--amp_dtype bfloat16 needs no scaler)")
    # Looked up in this build's dispatcher (torch has no public call that says it).
    if loss_scaling and not all(torch._C._dispatch_has_kernel_for_dispatch_key(
            op, kind.upper()) for op in _SCALER_OPS):
        return (f"torch {torch.__version__.split('+')[0]} has no GradScaler kernels for "
                f"{NAMES[kind]}s: train_autocast.py, or --amp_dtype bfloat16 without a scaler")
    return None


def single_process_device(choice: str, *, data_parallel: bool = False,
                          loss_scaling: bool = False) -> torch.device:
    """The device of a script that runs in one process (one device, or ``data_parallel``),
    ``--device`` ``choice``; ``loss_scaling``: the script has a GradScaler."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun started N copies of a single-process script: each would train the same
        # model on the same data and write the same files.
        raise UserError(f"this script runs in one process (one device or DataParallel), but "
                        f"torchrun started {os.environ['WORLD_SIZE']} (WORLD_SIZE): run it with "
                        "python, or use a DDP or FSDP script (train_DDP*, train_FSDP*, "
                        "eval_DDP) under torchrun")
    kind = device_type(choice)
    why = refusal(kind, data_parallel=data_parallel, loss_scaling=loss_scaling)
    if why is not None:
        raise UserError(why)
    return torch.device(kind)


def process_device(choice: str, local_rank: int, *, loss_scaling: bool = False) -> torch.device:
    """The device this process of a group owns: ``<type>:LOCAL_RANK``, or the CPU."""
    kind = device_type(choice)
    why = refusal(kind, process_group=True, loss_scaling=loss_scaling)
    if why is not None:
        raise UserError(why)
    if kind == "cpu":
        return torch.device("cpu")
    count = torch.accelerator.device_count()
    if local_rank >= count:
        raise UserError(f"LOCAL_RANK {local_rank} but only {count} {NAMES[kind]}(s) are "
                        "visible: start at most one process per device")
    return torch.device(kind, local_rank)


@dataclass
class DistInfo:
    """This process: its device, and its rank among ``world_size`` (0 of 1 without a group)."""
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    distributed: bool = False  # a process group is initialised
    backend: str = ""          # its backend: nccl, xccl, gloo

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that prints, logs and writes."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that prepares data."""
        return self.local_rank == 0


def pinned(device: torch.device) -> bool:
    """Whether host buffers for copies from/to ``device`` are pinned (page-locked: the copy
    runs asynchronously): on CUDA and XPU; MPS shares the host's memory, the CPU is it."""
    return device.type in ("cuda", "xpu")


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.accelerator.current_device_index()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock); a no-op on the CPU."""
    if device.type != "cpu":
        torch.accelerator.synchronize(_index(device))


def _devices(device: torch.device, all_devices: bool) -> range:
    """The accelerator indices a period's peak covers (``all_devices``: DataParallel's)."""
    return range(torch.accelerator.device_count()) if all_devices else range(
        _index(device), _index(device) + 1)


def reset_peak_memory(device: torch.device, all_gpus: bool = False) -> bool:
    """Start a new peak: the memory in use now. ``all_gpus``: every visible device (as
    DataParallel uses them). False where the peak cannot be reset."""
    if device.type != "cpu":
        try:
            for i in _devices(device, all_gpus):
                torch.accelerator.reset_peak_memory_stats(i)
            return True
        except (RuntimeError, NotImplementedError, AttributeError):  # no allocator stats
            return False
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
        return True
    except OSError:
        return False


def peak_memory_mb(device: torch.device, all_gpus: bool = False) -> Optional[float]:
    """Peak memory since the last :func:`reset_peak_memory`: what the accelerator's
    allocator handed out (``all_gpus``: the largest over the visible devices; None where
    the device keeps no such figure), or peak RSS on the CPU."""
    if device.type != "cpu":
        try:
            peak = max(torch.accelerator.max_memory_allocated(i)
                       for i in _devices(device, all_gpus))
        except (RuntimeError, NotImplementedError, AttributeError):
            return None
        # A device whose allocator keeps no statistics answers 0: a training period always
        # holds its weights.
        return peak / 2**20 if peak > 0 else None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def memory_kind(device: torch.device, reset: bool = True) -> str:
    """What :func:`peak_memory_mb` measures, for logs and tables."""
    if device.type != "cpu":
        return f"{device.type}_allocated"
    return "max_rss" if reset else "max_rss_since_start"
