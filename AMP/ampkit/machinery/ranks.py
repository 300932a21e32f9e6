"""This process in its process group, as the shared code asks of it: :class:`DistInfo`
(rank, world size, device, and the few collectives the loop and the logs use), the
device's sync before a clock is read, and seeds derived per rank, epoch or device.

The group itself is made and left by the scripts (``ampkit.distributed`` has what is
around those calls); this module only looks at it.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    distributed: bool = False  # a process group is initialised

    @classmethod
    def of(cls, device: torch.device) -> "DistInfo":
        """This process in the group it joined (a process of its own without one)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(device=device)
        return cls(device=device, rank=dist.get_rank(), world_size=dist.get_world_size(),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")), distributed=True)

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that prints, logs and writes."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that prepares data."""
        return self.local_rank == 0

    def barrier(self) -> None:
        if self.distributed:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def gather(self, items: list) -> list:
        """Every rank's ``items`` (picklable), concatenated in rank order, on every rank."""
        if not self.distributed:
            return list(items)
        parts = [None] * self.world_size
        dist.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    @contextlib.contextmanager
    def local_main_first(self) -> Iterator[None]:
        """Local rank 0 of each node runs the block first (e.g. a download); the others wait.
        Local rank 0 reaches the barrier even when its block fails, so the others are released
        at once (and then fail in their own block) instead of waiting for the timeout."""
        if not self.is_local_main:
            self.barrier()
            yield
            return
        try:
            yield
        finally:
            self.barrier()


def derived_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed mixing ``seed`` with ``parts`` (a rank, an epoch, a device): distinct,
    reproducible streams for each."""
    state = np.random.SeedSequence([seed % 2**64, *parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
