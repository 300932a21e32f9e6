"""Device choice and distributed setup, from torchrun's environment variables.

Under torchrun each process reads RANK / LOCAL_RANK / WORLD_SIZE (and the
rendezvous address) from its environment; under plain ``python`` a DDP script
runs as a one-process group on a free local port. With CUDA every process
owns one GPU (``LOCAL_RANK``) and the backend is NCCL; on the CPU it is gloo.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .machinery.errors import UserError


@dataclass
class DistInfo:
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


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def want_cuda(flag: Optional[bool]) -> bool:
    """``--cuda`` (True), ``--no-cuda`` (False) or neither (None: CUDA when available)."""
    if flag is None:
        return torch.cuda.is_available()
    if flag and not torch.cuda.is_available():
        raise UserError("--cuda was given but CUDA is not available on this machine "
                        "(use --no-cuda to run on the CPU)")
    return flag


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(ddp: bool, cuda_flag: Optional[bool]) -> DistInfo:
    """Pick the device; for DDP scripts also join (or create) the process group."""
    if not ddp and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun started N copies of a single-process script: each would train the same
        # model on the same data and write the same files.
        raise UserError(f"this script runs in one process (one device or DataParallel), but "
                        f"torchrun started {os.environ['WORLD_SIZE']} (WORLD_SIZE): run it with "
                        "python, or use a *_DDP script under torchrun")
    use_cuda = want_cuda(cuda_flag)
    if not ddp:
        return DistInfo(device=torch.device("cuda" if use_cuda else "cpu"))

    if "RANK" not in os.environ:  # plain `python AMP/train_DDP.py`: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])

    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} "
                            "GPU(s) are visible: start at most one process per GPU")
        # Before anything touches the GPU, or every rank would allocate on GPU 0.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    _init_process_group(backend, rank, world_size, datetime.timedelta(minutes=30),
                        device if use_cuda else None)
    return DistInfo(device=device, rank=rank, world_size=world_size,
                    local_rank=local_rank, distributed=True)


def _init_process_group(backend: str, rank: int, world_size: int,
                        timeout: datetime.timedelta, device: Optional[torch.device]) -> None:
    # device_id binds the process to its GPU: NCCL connects eagerly, and warns without it.
    kw = {"device_id": device} if device is not None else {}
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        dist.init_process_group(backend=backend, timeout=timeout, **kw)  # env:// from torchrun
        return
    # After a torchrun restart the agent's store still holds the previous attempt's
    # keys, and a new rank can read a dead peer's address from them before its new
    # peer overwrites it (gloo: "connectFullMesh failed ... Connection refused").
    # Keep each attempt's keys apart with a prefix.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"attempt_{restart}", store),
                            rank=rank, world_size=world_size, timeout=timeout, **kw)


def cleanup(info: DistInfo, finished: bool = False) -> None:
    """Leave the process group. ``finished`` (every rank got to the end): first wait for all
    ranks, so none tears its connections down while a peer still uses them. Not after a
    failure, when a peer may be gone."""
    if info.distributed and dist.is_initialized():
        if finished:
            info.barrier()
        dist.destroy_process_group()
