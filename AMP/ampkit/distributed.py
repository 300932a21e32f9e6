"""The process group, and every collective of the shared code: this process's place in it
(:class:`DistInfo`), torchrun's ranks and the store to join it by (a restarted attempt's
keys kept apart from the previous attempt's; under plain ``python``, a group of one in
memory), the sums, maxima and gathers the loop, the meters and the saves need, the stop's
own channel, an FSDP2 optimizer's saved state sharded again, and each rank's random
streams. The backend is the device's (``dist.get_default_backend_for_device``: NCCL on
CUDA, XCCL on XPU, gloo on the CPU).

Each function here that takes ``info`` is a collective in a process group: every rank
calls it, at the same point of the run, or the others wait (``GROUP_TIMEOUT``). In one
process each is a plain local call. No other module of ampkit calls torch.distributed."""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .randomness import random_state


# How long a collective may wait for a peer (a slow rank 0 writing a checkpoint, say).
GROUP_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class DistInfo:
    """This process: its device, and its rank among ``world_size`` (0 of 1 without a group);
    ``distributed``: a process group is initialised, of ``backend`` (nccl, xccl, gloo)."""
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    distributed: bool = False
    backend: str = ""

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that prints, logs and writes."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that prepares data."""
        return self.local_rank == 0


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
        # NCCL's barrier takes the device; gloo's none.
        if info.device.type == "cuda":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


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


class StopChannel:
    """How the ranks' stop (``ampkit.stop.Stop``) travels: every rank's signal number, an int,
    and their largest, by an all-reduce in the background on a gloo group of its own, as a
    CPU tensor: receiving it never waits for a GPU. One tensor, sent again once the last
    round is received, filled in and read through numpy: a round dispatches a single op, its
    all-reduce. Every rank creates it (a collective: the group); in one process there is
    nothing to send (``group`` None)."""

    def __init__(self, info: DistInfo) -> None:
        self.group = dist.new_group(backend="gloo") if info.distributed else None
        self._value = torch.zeros(1, dtype=torch.int32)
        self._pending: Optional[dist.Work] = None

    def send(self, value: int) -> None:
        """This rank's value, sent (the previous round must have been received)."""
        self._value.numpy()[0] = value
        self._pending = dist.all_reduce(self._value, op=dist.ReduceOp.MAX, group=self.group,
                                        async_op=True)

    def receive(self) -> Optional[int]:
        """The largest value of the round in flight, waited for (None: none in flight)."""
        if self._pending is None:
            return None
        work, self._pending = self._pending, None
        # It arrived during the step since it was sent: no wait in practice.
        work.wait()
        return int(self._value.numpy()[0])


# How an optimizer was built to run, not what it learned: kept when a state is loaded.
IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def _full_options(**kw):
    # FSDP2's alone: imported here, it adds a second to every other script's start.
    from torch.distributed.checkpoint import state_dict as dcp_state

    return dcp_state, dcp_state.StateDictOptions(full_state_dict=True, **kw)


def state_dicts(state: Dict[str, Any]) -> Dict[str, Any]:
    """Each entry's ``state_dict()``, by name (None: no such object in this run, not saved).
    Over an FSDP2 ``state["model"]`` a collective: a sharded module's and the optimizer's
    full state, gathered to rank 0's CPU (the other ranks get empty dicts)."""
    model, states = state["model"], {}
    dcp_state, full = _full_options(cpu_offload=True) if is_sharded(model) else (None, None)
    for name, obj in state.items():
        if obj is None:
            continue
        if full is not None and isinstance(obj, torch.optim.Optimizer):
            states[name] = dcp_state.get_optimizer_state_dict(model, obj, options=full)
        elif full is not None and isinstance(obj, torch.nn.Module) and is_sharded(obj):
            states[name] = dcp_state.get_model_state_dict(obj, options=full)
        else:
            states[name] = obj.state_dict()
    return states


def load_state(obj: Any, saved: Dict[str, Any], model: torch.nn.Module) -> Any:
    """``obj.load_state_dict(saved)``; what it returns. A full state into an FSDP2 module or
    the optimizer over an FSDP2 ``model`` is sharded again, on each rank; an optimizer keeps
    the implementation it was built with (:func:`load_optimizer_state`)."""
    if isinstance(obj, torch.optim.Optimizer):
        return load_optimizer_state(obj, saved, model)
    if isinstance(obj, torch.nn.Module) and is_sharded(obj):
        dcp_state, full = _full_options()
        return dcp_state.set_model_state_dict(obj, saved, options=full)
    return obj.load_state_dict(saved)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Dict[str, Any],
                         model: Optional[torch.nn.Module] = None) -> None:
    """``optimizer.load_state_dict(state)`` (over an FSDP2 ``model``: its full ``state``
    sharded again), keeping the implementation it was built with. ``load_state_dict``
    restores each param group's saved ``fused`` / ``foreach`` flags too: a checkpoint of a
    non-fused optimizer (another device, an older run) would turn a fused AdamW back into
    the foreach one, whose path then asserts under a GradScaler (which decided at
    construction that the fused optimizer handles inf/NaN itself)."""
    built = [{k: g[k] for k in IMPLEMENTATION_FLAGS if k in g} for g in optimizer.param_groups]
    if model is not None and is_sharded(model):
        dcp_state, full = _full_options()
        dcp_state.set_optimizer_state_dict(model, optimizer, state, options=full)
    else:
        optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, built):
        group.update(flags)


def rank_random_states(info: DistInfo) -> List[dict]:
    """Every rank's random streams (``randomness.random_state``), in rank order, on every
    rank (a collective): what a resumed rank goes on drawing dropout from."""
    return gather_from_ranks([random_state(info.device)], info)


def settle_buckets(model: torch.nn.Module, image_shape: Tuple[int, ...], info: DistInfo,
                   comm_hook: Any = None) -> None:
    """One throwaway backward through a DDP ``model`` at every start, fresh or resumed, so that
    the first real step already all-reduces in the buckets of every later one.

    DDP buckets the gradients in the parameters' order for a start's first backward, then
    rebuilds the buckets once, in the order the gradients became ready. Over 3 or more ranks
    a ring all-reduce adds an element's terms in an order set by its place in its bucket, so
    without this a resumed run's first step would round otherwise than the uninterrupted
    run's step there. Eval mode (no dropout draw, no BatchNorm update), one zero image, the
    loss times 0, the gradients dropped: nothing of the run changes. Not at 1 or 2 ranks
    (two terms add the same either way), nor under PowerSGD, which counts every backward
    as a step of its warm-up."""
    if info.world_size < 3 or getattr(comm_hook, "name", None) == "powersgd":
        return
    training = model.training
    model.eval()
    model(torch.zeros(1, *image_shape, device=info.device)).float().sum().mul(0).backward()
    model.train(training)
    for p in model.parameters():
        p.grad = None


def is_sharded(model: torch.nn.Module) -> bool:
    """FSDP2 (``fully_shard``): the parameters are DTensors, each process holding a shard."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def torchrun_ranks() -> Tuple[int, int, int]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` as torchrun sets them; under plain ``python``, a
    group of one: (0, 1, 0)."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def torchrun_attempt() -> int:
    """Which attempt of a torchrun job this process is: 0 the first, N after N restarts
    (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def group_store(rank: int, world_size: int) -> Optional[dist.Store]:
    """The store ``init_process_group`` joins by: torchrun's (``env://``: None) on a first
    attempt; under plain ``python`` one in memory, for a group of one. After a torchrun
    restart (``--max-restarts``) the agent's store still holds the previous attempt's keys,
    and a new rank can read a dead peer's address from them before its new peer
    overwrites it (gloo: "connectFullMesh failed ... Connection refused"): each attempt's
    keys are kept apart by a prefix."""
    if "RANK" not in os.environ:
        return dist.HashStore()
    restart = torchrun_attempt()
    if restart == 0:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=GROUP_TIMEOUT)
    return dist.PrefixStore(f"attempt_{restart}", store)
