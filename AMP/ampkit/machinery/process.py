"""This process: the device it trains on (``--cuda`` / ``--no-cuda`` / neither: one device for a
script that runs in one process, ``cuda:LOCAL_RANK`` or the CPU for a process of a group), its
place in its process group as a record (:class:`DistInfo`), the device's sync before a clock
is read, and seeds derived per rank, epoch or device (``seed_streams``: each rank's own).

Nothing here talks to the group: the collectives are the scripts' and ``ampkit.distributed``'s
(which makes the record, ``this_process``), so the code under ``machinery/`` runs the same
in every process and a reader sees where every rank must make the same call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
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


def derived_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed mixing ``seed`` with ``parts`` (a rank, an epoch, a device): distinct,
    reproducible streams for each."""
    state = np.random.SeedSequence([seed % 2**64, *parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_streams(seed: int, rank: int, cuda: bool) -> None:
    """After the model is built from ``seed`` (the same weights on every rank, for any world
    size): this rank's own random streams, for dropout and the classic path's flips. With
    ``cuda``, each visible GPU gets a stream of its own too: ``torch.manual_seed`` gives
    every GPU the same one, so DataParallel's replicas would draw the same dropout masks on
    their chunks of the batch."""
    torch.manual_seed(derived_seed(seed, 1, rank))
    if cuda:
        torch.cuda.init()  # the generators exist once CUDA is initialised (no context yet)
        for index in range(torch.cuda.device_count()):
            torch.cuda.default_generators[index].manual_seed(derived_seed(seed, 2, rank, index))
