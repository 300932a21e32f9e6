"""What DDP's all-reduce sends (``--comm_hook``): PyTorch's own comm hooks, wrapped so that
they count their bytes and, under a GradScaler, PowerSGD's error feedback follows the scale.
``--comm_hook none`` builds no :class:`CommHook`: DDP's all-reduce runs in C++, untouched. The
hooks hold no collective of their own beyond PyTorch's; :func:`wire_per_step` is what a step sends."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

HOOKS = ("none", "fp16", "bf16", "powersgd")
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CommHook:
    """One ``--comm_hook``: ``model.register_comm_hook(hook.state, hook.hook)``. Counts what
    this rank sends: ``bytes_sent`` and ``rounds`` (all-reduce rounds: buckets numbered 0).

    DDP hands each bucket of gradients (about 25 MB) to the hook as soon as backward has
    filled it; the hook all-reduces it and returns a future of the averaged bucket, which DDP
    copies into ``.grad``. Inside ``no_sync()`` no hook runs: with accumulation, one round a
    step, on the summed gradients.

    - ``fp16`` / ``bf16``: each bucket cast, all-reduced, cast back: half the bytes. float16
      ends at 65504: a scaled gradient past it is inf on the wire and in ``.grad``, which
      GradScaler finds (the step skipped, the scale lowered). bfloat16 has float32's range.
    - ``powersgd``: each matrix's gradient sent as its rank-r factors P and Q (Vogels et al.,
      2019), with error feedback and a plain all-reduce for the first
      ``start_powerSGD_iter`` steps (saved with the hook's state). Under a GradScaler the
      feedback follows the scale (:meth:`follow_scale`).
    """

    def __init__(self, name: str, *, powersgd_rank: Optional[int] = None,
                 start_iter: Optional[int] = None, run_steps: int = 10_000,
                 seed: int = 0) -> None:
        """``powersgd_rank`` (None: 1) and ``start_iter`` (None: 10 % of the run's
        ``run_steps`` optimizer steps, at least 2) tune PowerSGD."""
        self.name, self.bytes_sent, self.rounds = name, 0, 0
        # PowerSGD: the last bucket's future, which the next bucket waits for (_powersgd).
        self._previous = None
        self._scaler, self._scale_then = None, None
        # A warm-up given by --powersgd_start_iter is this run's; the default may be the saved.
        self._start_given = start_iter is not None
        # PyTorch's hooks take the process group: None is the default one.
        self.state = None
        # The same seed on every rank: the same random start for Q.
        if name == "powersgd":
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
        """DDP's hook: ``state`` is ``self.state``, ``bucket`` a ``dist.GradBucket``."""
        buffer = bucket.buffer()
        self.rounds += bucket.index() == 0
        if self.name in WIRE_DTYPES:
            self.bytes_sent += buffer.numel() * WIRE_DTYPES[self.name].itemsize
            compress = (default_hooks.fp16_compress_hook if self.name == "fp16"
                        else default_hooks.bf16_compress_hook)
            return compress(state, bucket)
        return self._powersgd(state, bucket)

    def _powersgd(self, state: psgd.PowerSGDState, bucket):
        if state.iter < state.start_powerSGD_iter:
            self.bytes_sent += bucket.buffer().numel() * bucket.buffer().element_size()
            return psgd.powerSGD_hook(state, bucket)
        if self._previous is not None and bucket.index() != 0:
            # PowerSGD all-reduces P and Q from the future's callbacks. NCCL runs those as the
            # work is queued, in this thread; gloo when it is done, in its own thread, where
            # they could reach the wire before or after the next bucket's first all-reduce:
            # an order that differs between the ranks. One bucket at a time keeps it.
            # On a GPU the stream waits, not the host.
            self._previous.wait()
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
        # What went on the wire: P, Q and the tensors sent uncompressed.
        sent = state.total_numel_after_compression - counted
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

    def caveat(self, world_size: int, scaler) -> Optional[str]:
        """A warning for a hook that cannot do here what it is for; None when it can."""
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
        if saved.get("name") != "powersgd":
            return (f"PowerSGD starts anew: its warm-up of {self.state.start_powerSGD_iter} "
                    f"plain all-reduce steps first")
        self.state.iter = int(saved["iter"])
        said = ("PowerSGD's error feedback and warm start restart from zero (not saved: a "
                f"full gradient per rank); its step count goes on at {self.state.iter}")
        saved_start = saved.get("start_iter")
        if saved_start is None or saved_start == self.state.start_powerSGD_iter:
            return said
        # The changed-flags line already says --powersgd_start_iter moved.
        if self._start_given:
            return said + f"; its warm-up ends at step {self.state.start_powerSGD_iter}"
        # The default is 10 % of the run's steps: more --epochs would move it.
        self.state.start_powerSGD_iter = int(saved_start)
        return said + f"; its warm-up ends at step {saved_start}, as saved"


def default_start_iter(total_steps: int) -> int:
    """PyTorch's advice for ``start_powerSGD_iter``: 10 % of the training steps (at least 2)."""
    return max(2, math.ceil(0.1 * total_steps))


def wire_per_step(model: torch.nn.Module, hook) -> Dict[str, Any]:
    """What this rank sent per all-reduce round (one an optimizer step) over DDP's ``model``,
    in MB, for the epoch's row: ``hook``'s count (--comm_hook; {} before its first round), or
    without one DDP's own all-reduce, which sends every gradient in float32 each round."""
    if hook is None:
        sent = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return {"comm_hook": "none", "wire_mb_per_step": sent / 1e6}
    if not hook.rounds:
        return {}
    return {"comm_hook": hook.name, "wire_mb_per_step": hook.bytes_sent / hook.rounds / 1e6}
