"""The device a process trains on: ``--cuda`` / ``--no-cuda`` / neither, one device for a
script that runs in one process, ``cuda:LOCAL_RANK`` (or the CPU) for a process of a group.
"""
from __future__ import annotations

import os
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
