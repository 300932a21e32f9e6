"""The process group, and every collective of the shared code: this process's place in it
(:class:`DistInfo`), torchrun's ranks and the store to join it by (a restarted attempt's
keys kept apart from the previous attempt's; under plain ``python``, a group of one in
memory), the sums, maxima and gathers the loop, the meters and the saves need, the stop
vote's own group, an FSDP2 optimizer's saved state sharded again, and each rank's random
streams. The backend is the device's (``dist.get_default_backend_for_device``: NCCL on
CUDA, XCCL on XPU, gloo on the CPU).

Each function here that takes ``info`` is a collective in a process group: every rank
calls it, at the same point of the run, or the others wait (``GROUP_TIMEOUT``). In one
process each is a plain local call. No other module of ampkit calls torch.distributed.

And what DDP's all-reduce sends (:class:`CommHook`, ``--comm_hook``): PyTorch's own comm
hooks, which hold no collective of their own beyond PyTorch's, with their bytes counted."""
from __future__ import annotations

import contextlib
import datetime
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

from .randomness import random_state


# How long a collective may wait for a peer (a slow rank 0 writing a checkpoint, say).
GROUP_TIMEOUT = datetime.timedelta(minutes=30)


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


class Ballots:
    """The stop vote's transport (``ampkit.stop.StopVote``): every rank's ballot, an int, and
    their largest, by an all-reduce in the background on a gloo group of its own, as a CPU
    tensor: reading it never waits for a GPU. One ballot, cast again once the last vote is
    read, filled in and read through numpy: a vote dispatches a single op, its all-reduce.
    Every rank creates it (a collective: the group); in one process there is nothing to
    send (``group`` None)."""

    def __init__(self, info: DistInfo) -> None:
        self.group = dist.new_group(backend="gloo") if info.distributed else None
        self._ballot = torch.zeros(1, dtype=torch.int32)
        self._pending: Optional[dist.Work] = None

    def cast(self, value: int) -> None:
        """This rank's ballot, sent (the previous vote must have been read)."""
        self._ballot.numpy()[0] = value
        self._pending = dist.all_reduce(self._ballot, op=dist.ReduceOp.MAX, group=self.group,
                                        async_op=True)

    def read(self) -> Optional[int]:
        """The largest ballot of the pending vote, waited for (None: none pending)."""
        if self._pending is None:
            return None
        work, self._pending = self._pending, None
        work.wait()  # it arrived during the step since it was cast: no wait in practice
        return int(self._ballot.numpy()[0])


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
    if "RANK" not in os.environ:  # not started by torchrun
        return dist.HashStore()
    restart = torchrun_attempt()
    if restart == 0:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=GROUP_TIMEOUT)
    return dist.PrefixStore(f"attempt_{restart}", store)


HOOKS = ("none", "fp16", "bf16", "powersgd")
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CommHook:
    """One ``--comm_hook``: ``model.register_comm_hook(hook.state, hook.hook)``. Counts what
    this rank sends: ``bytes_sent`` and ``rounds`` (all-reduce rounds: buckets numbered 0).

    DDP hands each bucket of gradients (about 25 MB) to the hook as soon as backward has
    filled it; the hook all-reduces it and returns a future of the averaged bucket, which DDP
    copies into ``.grad``. Inside ``no_sync()`` no hook runs: with accumulation, one round a
    step, on the summed gradients.

    - ``none``: no hook: DDP's built-in all-reduce sends the fp32 gradients (in C++;
      PyTorch's Python ``allreduce_hook`` sends the same bytes at ~20 more ops a step).
    - ``fp16`` / ``bf16``: each bucket cast, all-reduced, cast back: half the bytes. float16
      ends at 65504: a scaled gradient past it is inf on the wire and in ``.grad``, which
      GradScaler finds (the step skipped, the scale lowered). bfloat16 has float32's range.
    - ``powersgd``: each matrix's gradient sent as its rank-r factors P and Q (Vogels et al.,
      2019), with error feedback and a plain all-reduce for the first
      ``start_powerSGD_iter`` steps (saved with the hook's state). Under a GradScaler the
      feedback follows the scale (:meth:`follow_scale`).
    """

    def __init__(self, name: str = "none", *, powersgd_rank: Optional[int] = None,
                 start_iter: Optional[int] = None, run_steps: int = 10_000,
                 seed: int = 0) -> None:
        """``powersgd_rank`` (None: 1) and ``start_iter`` (None: 10 % of the run's
        ``run_steps`` optimizer steps, at least 2) tune PowerSGD."""
        self.name, self.bytes_sent, self.rounds = name, 0, 0
        self._previous = None  # PowerSGD: the last bucket's future
        self._scaler, self._scale_then = None, None  # follow_scale's
        self._start_given = start_iter is not None  # --powersgd_start_iter, not the default
        self.state = None  # PyTorch's hooks take the process group: None is the default one
        if name == "powersgd":  # the same seed on every rank: the same random start for Q
            self.state = psgd.PowerSGDState(
                None, matrix_approximation_rank=powersgd_rank or 1, random_seed=seed,
                start_powerSGD_iter=start_iter or default_start_iter(run_steps))

    def follow_scale(self, scaler: Optional[torch.amp.GradScaler]) -> None:
        """Under a GradScaler the buckets hold scaled gradients, and PowerSGD's error feedback
        (what the factors missed, added to the next step's bucket) would be kept in the units
        of the scale it was made at. Followed, it is rescaled when the scale grows, and
        dropped after a skipped step (the scale then falls), whose gradients were never
        applied: the feedback stays in step with what the optimizer gets."""
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None

    def reset_counts(self) -> None:
        self.bytes_sent, self.rounds = 0, 0

    def hook(self, state, bucket):
        """DDP's hook (fp16, bf16, powersgd; ``none`` registers none): ``state`` is
        ``self.state``, ``bucket`` a ``dist.GradBucket``."""
        buffer = bucket.buffer()
        self.rounds += bucket.index() == 0
        if self.name in WIRE_DTYPES:
            self.bytes_sent += buffer.numel() * WIRE_DTYPES[self.name].itemsize
            compress = (default_hooks.fp16_compress_hook if self.name == "fp16"
                        else default_hooks.bf16_compress_hook)
            return compress(state, bucket)
        return self._powersgd(state, bucket)

    def _powersgd(self, state: psgd.PowerSGDState, bucket):
        if state.iter < state.start_powerSGD_iter:  # the warm-up: a plain all-reduce
            self.bytes_sent += bucket.buffer().numel() * bucket.buffer().element_size()
            return psgd.powerSGD_hook(state, bucket)
        if self._previous is not None and bucket.index() != 0:
            # PowerSGD all-reduces P and Q from the future's callbacks. NCCL runs those as the
            # work is queued, in this thread; gloo when it is done, in its own thread, where
            # they could reach the wire before or after the next bucket's first all-reduce:
            # an order that differs between the ranks. One bucket at a time keeps it.
            self._previous.wait()  # on a GPU the stream waits, not the host
        index, counted = bucket.index(), state.total_numel_after_compression
        if index == 0 and self._scaler is not None:
            self._rescale_memory(state)
        memory = state.error_dict.get(index)
        if memory is not None and memory.numel() != bucket.buffer().numel():
            # DDP re-makes its buckets after a process's first step: a resumed run that
            # compresses from its first step then finds other buckets; their memory anew.
            for kept in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                kept.clear()
        q_before = state.q_memory_dict.get(index)
        q_before = q_before.clone() if q_before is not None else None
        future = psgd.powerSGD_hook(state, bucket)
        sent = state.total_numel_after_compression - counted  # P, Q and the uncompressed
        self.bytes_sent += sent * bucket.buffer().element_size()

        def keep_memory_finite(fut):
            # An overflow (GradScaler's first steps, a spike) makes this bucket inf/NaN, and
            # PowerSGD would carry it in its memory into every later step, though GradScaler
            # skips this one. Checked on the device (no host sync): then the error feedback
            # is reset to zero and Q, the warm start, stays as it was before the step.
            averaged = fut.value()
            finite = torch.isfinite(averaged).all()
            if state.use_error_feedback:
                state.error_dict[index].masked_fill_(~finite, 0.0)
            q = state.q_memory_dict.get(index)
            if q is not None:
                fallback = q_before if q_before is not None else torch.ones_like(q)
                q.copy_(torch.where(finite, q, fallback))
            return averaged

        self._previous = future.then(keep_memory_finite)
        return self._previous

    def _rescale_memory(self, state: psgd.PowerSGDState) -> None:
        """At a step's first bucket: every bucket's error feedback, made at the previous
        step's scale, brought to this step's (x2 after a growth), or zero after a skip (the
        scale halved). On the device, no host sync (GradScaler's private ``_scale`` is the
        tensor its public ``get_scale()`` reads back to the host)."""
        now = self._scaler._scale
        if self._scale_then is not None and state.error_dict:
            factor = torch.where(now < self._scale_then, torch.zeros_like(now),
                                 now / self._scale_then)
            for memory in state.error_dict.values():
                memory.mul_(factor.to(memory.dtype))
        self._scale_then = now.clone()

    def per_step(self, model: torch.nn.Module) -> dict:
        """The epoch's figures for its log row: MB this rank sent per all-reduce round (one
        round an optimizer step) over ``model`` (DDP's); {} where no hook ran. ``none``: DDP's
        own all-reduce, which sends every gradient in float32 each round."""
        if self.name == "none":
            sent = sum(p.numel() * p.element_size() for p in model.parameters()
                       if p.requires_grad)
            return {"comm_hook": self.name, "wire_mb_per_step": sent / 1e6}
        if not self.rounds:
            return {}
        return {"comm_hook": self.name, "wire_mb_per_step": self.bytes_sent / self.rounds / 1e6}

    def caveat(self, world_size: int, scaler) -> Optional[str]:
        """A warning for a hook that cannot do here what it is for; None when it can."""
        if self.name == "none":
            return None
        if world_size == 1:
            return (f"--comm_hook {self.name} in a group of one process: nothing travels (the "
                    f"hook still runs on the gradients)")
        if self.name == "fp16" and (scaler is None or not scaler.is_enabled()):
            return ("--comm_hook fp16 without a GradScaler: gradients under 6e-8 reach the "
                    "wire as zero (whole tensors of small networks' first layers, measured); "
                    "train_DDP_GradScaler.py scales them first, bf16 keeps float32's range")
        return None

    def state_dict(self) -> dict:
        """What a checkpoint keeps: PowerSGD's step count and the step its warm-up ends at
        (a resume goes on where it was)."""
        if self.name != "powersgd":
            return {"name": self.name, "iter": 0}
        return {"name": self.name, "iter": self.state.iter,
                "start_iter": self.state.start_powerSGD_iter}

    def load_state_dict(self, saved: Optional[dict]) -> str:
        """A saved hook's state back; what restarts, in words ("" for nothing)."""
        if self.name != "powersgd":
            return ""
        if not saved or saved.get("name") != "powersgd":
            return (f"PowerSGD starts anew: its warm-up of {self.state.start_powerSGD_iter} "
                    f"plain all-reduce steps first")
        self.state.iter = int(saved["iter"])
        said = ("PowerSGD's error feedback and warm start restart from zero (not saved: a "
                f"full gradient per rank); its step count goes on at {self.state.iter}")
        saved_start = saved.get("start_iter")
        if saved_start is None or saved_start == self.state.start_powerSGD_iter:
            return said
        if self._start_given:  # the changed-flags line says --powersgd_start_iter moved
            return said + f"; its warm-up ends at step {self.state.start_powerSGD_iter}"
        # The default is 10 % of the run's steps: more --epochs would move it.
        self.state.start_powerSGD_iter = int(saved_start)
        return said + f"; its warm-up ends at step {saved_start}, as saved"


def default_start_iter(total_steps: int) -> int:
    """PyTorch's advice for ``start_powerSGD_iter``: 10 % of the training steps (at least 2)."""
    return max(2, math.ceil(0.1 * total_steps))
