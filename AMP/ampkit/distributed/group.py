"""Every collective of the shared code, and what is around the process group that a DDP or
FSDP2 script joins itself (``train_DDP.py``): torchrun's environment (under plain
``python``, a group of one on a free local port), a store that keeps a restarted attempt's
keys apart from the previous attempt's, this process's :class:`DistInfo`, the sums, maxima
and gathers the loop and the logs need, the ranks' stop vote, what is resumed (and an
FSDP2 optimizer's saved state, sharded again), and each rank's random streams. The backend
is the device's (``dist.get_default_backend_for_device``: NCCL on CUDA, XCCL on XPU, gloo
on the CPU).

Each function here that takes ``info`` is a collective in a process group: every rank
calls it, at the same point of the run, or the others wait (``GROUP_TIMEOUT``). In one
process each is a plain local call. No other module of ampkit calls torch.distributed.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .device import DistInfo, process_device
from .errors import UserError
from .randomness import random_state
from .signals import StopFlag, StopSignals

# How long a collective may wait for a peer (a slow rank 0 writing a checkpoint, say).
GROUP_TIMEOUT = datetime.timedelta(minutes=30)


def this_process(device: torch.device) -> DistInfo:
    """This process in the group it joined (a process of its own without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo(device=device)
    return DistInfo(device=device, rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")), distributed=True,
                    backend=dist.get_backend())


def barrier(info: DistInfo) -> None:
    """Every rank waits here for all the others."""
    if info.distributed:
        if info.device.type == "cuda":  # NCCL's barrier takes the device; gloo's none
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def sum_over_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """``t`` summed over the ranks, in place (on its device: no host sync)."""
    if info.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def max_over_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """``t``'s largest value over the ranks, elementwise, in place."""
    if info.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def gather_from_ranks(items: list, info: DistInfo) -> list:
    """Every rank's ``items`` (picklable), concatenated in rank order, on every rank."""
    if not info.distributed:
        return list(items)
    parts = [None] * info.world_size
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def any_rank(flag: bool, info: DistInfo) -> bool:
    """Whether ``flag`` is true on any rank (the same answer on every rank)."""
    return bool(max_over_ranks(torch.tensor(int(flag), device=info.device), info).item())


@contextlib.contextmanager
def local_main_first(info: DistInfo) -> Iterator[None]:
    """Local rank 0 of each node runs the block first (e.g. a download); the others wait.
    Local rank 0 reaches the barrier even when its block fails, so the others are released
    at once (and then fail in their own block) instead of waiting for the timeout."""
    if not info.is_local_main:
        barrier(info)
        yield
        return
    try:
        yield
    finally:
        barrier(info)


@contextlib.contextmanager
def stop_vote(info: DistInfo, say: Callable[[str], None]) -> Iterator["StopVote"]:
    """Within it SIGTERM, SIGINT and SIGUSR1 ask for a stop, which the vote makes at the same
    step on every rank (``ampkit/signals.py`` says the rule); the handlers go with it."""
    flag = StopFlag()
    with StopSignals(flag, say, exiting=info.world_size > 1):
        yield StopVote(flag, info)


class StopVote:
    """Whether to stop: the same answer on every rank, at the same step, and no wait for
    the device.

    A signal reaches each process at its own moment, or only some of them (one node's
    scheduler, Ctrl-C in one terminal); a rank that stopped alone would leave its peers
    waiting in their next collective. So after every optimizer step each rank puts its
    :class:`StopFlag`'s signal (0: none) into an all-reduce (MAX) that runs in the
    background, and reads the previous step's, which has long arrived: a stop asked for
    during step k ends step k + 1 on every rank. The first vote that finds a signal decides
    the stop (the highest signal number, if ranks got different ones), the same on every
    rank, and so the exit status (``StopFlag.agreed``). The vote travels on a gloo group of
    its own, as a CPU tensor, so reading it never waits for the GPU (a read of a CUDA tensor
    would sync the host every step). In one process: the flag itself, after the current
    step. The rule around it: ampkit/signals.py.
    """

    def __init__(self, flag: StopFlag, info: "DistInfo") -> None:
        self.flag = flag
        # Every rank creates the group (a collective), at the same point of the run.
        self.group = dist.new_group(backend="gloo") if info.distributed else None
        # One ballot, cast again once the last vote is read, filled in and read through
        # numpy: a vote dispatches a single op, its all-reduce.
        self._ballot = torch.zeros(1, dtype=torch.int32)
        self._pending: Optional[Tuple[dist.Work, torch.Tensor]] = None
        self._epochs_begun = 0

    def _send_vote(self) -> None:
        mine = self._ballot  # the previous vote on it has been read: _read_vote waited
        mine.numpy()[0] = self.flag.signum
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = work, mine

    def _read_vote(self) -> bool:
        """The pending vote's result (False if none), waited for; a stop that another rank
        asked for becomes this rank's too."""
        if self._pending is None:
            return False
        work, votes = self._pending
        self._pending = None
        work.wait()  # it arrived during the step since it was cast: no wait in practice
        signum = int(votes.numpy()[0])
        if signum:
            self.flag.agree(signal.Signals(signum).name)
        return bool(signum)

    def _alone(self) -> bool:
        if self.flag.requested:
            self.flag.agree(self.flag.signal_name)
        return self.flag.requested

    def after_step(self) -> bool:
        """After each optimizer step, with no wait: True when every rank stops now (on the
        vote cast after the step before)."""
        if self.group is None:
            return self._alone()
        stop = self._read_vote()
        self._send_vote()
        return stop

    def before_epoch(self) -> bool:
        """Before an epoch (blocking): whether any rank asked to stop since the previous
        epoch's last step, during its validation, save or log. The run's first epoch takes
        no such vote (a signal during the set-up stops the run after its first step)."""
        first, self._epochs_begun = not self._epochs_begun, self._epochs_begun + 1
        return False if first else self.any_rank_asked()

    def any_rank_asked(self) -> bool:
        """At an epoch's end and at the run's (blocking): whether any rank asked to stop by
        now; also takes the pending vote, so none is left in flight."""
        if self.group is None:
            return self._alone()
        stop = self._read_vote()
        self._send_vote()
        return self._read_vote() or stop


# How an optimizer was built to run, not what it learned: kept when a state is loaded.
_IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Dict[str, Any],
                         model: Optional[torch.nn.Module] = None) -> None:
    """``optimizer.load_state_dict(state)``, keeping the implementation this optimizer was
    built with (``model``: an FSDP2 model, whose full ``state`` is sharded again).
    ``load_state_dict`` also restores each param group's saved ``fused`` /
    ``foreach`` flags: a checkpoint written by a non-fused optimizer (another device, an
    older run) would silently turn a fused AdamW back into the foreach one. With a
    GradScaler that breaks outright: the scaler decided at construction that the
    optimizer handles inf/NaN itself (fused), and the foreach path then asserts."""
    built = [{k: g[k] for k in _IMPLEMENTATION_FLAGS if k in g} for g in optimizer.param_groups]
    if model is not None and is_sharded(model):  # full: sharded again on each rank
        # FSDP2's alone: imported here, it adds a second to every other script's start.
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)
        set_optimizer_state_dict(model, optimizer, state,
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, built):
        group.update(flags)


def rank_random_states(info: DistInfo) -> List[dict]:
    """Every rank's random streams (``randomness.random_state``), in rank order, on every
    rank (a collective): what a resumed rank goes on drawing dropout from."""
    return gather_from_ranks([random_state(info.device)], info)


def is_sharded(model: torch.nn.Module) -> bool:
    """FSDP2 (``fully_shard``): the parameters are DTensors, each process holding a shard."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def agree_on_resumed(loaded: Union[dict, str, None], info: DistInfo) -> None:
    """After each rank loaded the checkpoint rank 0 chose: every rank must have read the same
    bytes at the same point (``loaded``: its ``{"epoch", "step", "identity"}``; a string: why
    it could not load it; None on every rank: a new run). Else every rank stops with one
    line naming the first rank that differs (a collective)."""
    if not info.distributed:
        if isinstance(loaded, str):
            raise UserError(loaded)
        return
    seen = gather_from_ranks([(socket.gethostname(), loaded)], info)
    host0, first = seen[0]
    for rank, (host, theirs) in enumerate(seen):
        if isinstance(theirs, str):
            raise UserError(f"rank {rank} on {host}: {theirs}")
        if theirs != first:
            raise UserError(f"rank 0 on {host0} resumed {_where(first)}, but rank {rank} on "
                            f"{host} {_where(theirs)}: the checkpoint changed while the ranks "
                            "read it, or they read different files; resume again")


def _where(loaded: Optional[dict]) -> str:
    if loaded is None:
        return "started a new run"
    return (f"loaded epoch {loaded['epoch']}, step {loaded['step']} of a {loaded['identity'][0]}"
            f"-byte file (directory hash {loaded['identity'][1][:12]})")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(device_choice: str, *, loss_scaling: bool = False
                 ) -> Tuple[int, int, torch.device]:
    """``(RANK, WORLD_SIZE, device)`` as torchrun sets them; the device is this process's own,
    ``<type>:LOCAL_RANK`` of ``--device`` (or the CPU: ``device.process_device``, which
    refuses what the device cannot run, a GradScaler with ``loss_scaling`` too). Started
    by plain ``python``, the process is a group of one, on a free local port."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            process_device(device_choice, local_rank, loss_scaling=loss_scaling))


def elastic_store(rank: int, world_size: int) -> Optional[dist.Store]:
    """The store for ``init_process_group``: None on a first attempt (``env://``, torchrun's
    rendezvous). After a torchrun restart (``--max-restarts``) the agent's store still holds
    the previous attempt's keys, and a new rank can read a dead peer's address from them
    before its new peer overwrites it (gloo: "connectFullMesh failed ... Connection
    refused"): each attempt's keys are kept apart by a prefix."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=GROUP_TIMEOUT)
    return dist.PrefixStore(f"attempt_{restart}", store)
