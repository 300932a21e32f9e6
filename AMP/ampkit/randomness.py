"""The run's random streams: the same initial weights on every rank for any world size, then
each rank's own streams (dropout, the classic path's flips); seeds derived per rank, epoch
or device; and a rank's streams as a checkpoint keeps them and a resume puts them back, so
that a resumed run draws what the stopped run would have drawn.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch


def derived_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed mixing ``seed`` with ``parts`` (a rank, an epoch, a device): distinct,
    reproducible streams for each."""
    state = np.random.SeedSequence([seed % 2**64, *parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def seed_streams(seed: int, rank: int, cuda: bool) -> None:
    """After the model is built from ``seed`` (the same weights on every rank, for any world
    size): this rank's own random streams, for dropout and the classic path's flips. With
    ``cuda``, each visible GPU gets a stream of its own too: ``torch.manual_seed`` gives
    every GPU the same one, so DataParallel's replicas (CUDA's alone) would draw the same
    dropout masks on their chunks of the batch."""
    torch.manual_seed(derived_seed(seed, 1, rank))
    if cuda:
        # default_generators is empty until CUDA is initialised; init() makes no context.
        torch.cuda.init()
        for index in range(torch.cuda.device_count()):
            torch.cuda.default_generators[index].manual_seed(derived_seed(seed, 2, rank, index))


def random_state(device: torch.device) -> dict:
    """This process's streams: the CPU's, and each visible accelerator's (DataParallel's
    replicas draw from every GPU's) on an accelerator."""
    if device.type == "cpu":
        return {"torch": torch.get_rng_state()}
    module = torch.get_device_module(device.type)
    states = (module.get_rng_state_all() if hasattr(module, "get_rng_state_all")
              else [module.get_rng_state()])
    return {"torch": torch.get_rng_state(), "device_type": device.type, "devices": states}


def restore_random_state(saved: Any, rank: int, world_size: int, device: torch.device) -> str:
    """This rank's saved streams back (``saved``: one entry per rank; an older checkpoint's
    dict: rank 0's alone). "" when restored; else what the streams are instead, in words."""
    # A dict was written before every rank's streams were saved: rank 0's alone, which only
    # a one-process run can take as its own.
    if isinstance(saved, dict):
        saved = [saved] if world_size == 1 else None
    if not isinstance(saved, list) or len(saved) != world_size:
        return (f"the random streams (dropout) start anew from --seed: the checkpoint holds "
                f"{len(saved) if isinstance(saved, list) else 'no'} rank's streams, this run "
                f"has {world_size} processes")
    mine = saved[rank]
    torch.set_rng_state(mine["torch"])
    # Older checkpoints kept CUDA's streams under "cuda".
    states: Optional[Any] = (mine.get("devices") if mine.get("device_type") == device.type
                             else mine.get("cuda") if device.type == "cuda" else None)
    if device.type != "cpu" and states is not None:
        # Older checkpoints kept this device's state alone, not a list of every device's.
        states = states if isinstance(states, list) else [states]
        module = torch.get_device_module(device.type)
        if len(states) == 1 and not hasattr(module, "get_rng_state_all"):
            module.set_rng_state(states[0])
        else:
            for index, state in enumerate(states[:torch.accelerator.device_count()]):
                module.set_rng_state(state, index)
    return ""
