"""The samplers: the order in which both input paths (classic and fast) read the samples.

Training takes a seeded permutation per epoch from a ``DistributedSampler``
(:class:`ResumableSampler`: a resumed epoch skips what it saw, and each sample's flip is
drawn from the seed, the epoch and the rank alone); validation gives each rank every
world_size-th sample, unpadded (:class:`IndexSampler`).
"""
from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler, Sampler

from ..errors import UserError
from ..randomness import derived_seed


class ResumableSampler(Sampler[int]):
    """A training sampler (the script's ``DistributedSampler``) from ``start_index`` of its
    epoch on: a run resumed mid-epoch skips what it trained on before it stopped (all of
    it, after a stop in the epoch's last step). The epoch is the sampler's own
    (``set_epoch`` is the script's, or the trainer's for a one-process script).

    It also draws each sample's horizontal flip, from (seed, epoch, rank) alone: the same
    flips on both input paths, in a resumed epoch as in the interrupted one, and none of
    the random stream that dropout draws from. ``pairs``: it yields ``(index, flip)`` (the
    classic path's :class:`.classic.NextReadable` takes them); else the indices, and the fast
    path
    takes :meth:`flips`."""

    def __init__(self, sampler: Sampler[int], pairs: bool = False) -> None:
        self.sampler, self.pairs = sampler, pairs
        self.start_index = 0
        self.seed, self.rank = getattr(sampler, "seed", 0), getattr(sampler, "rank", 0)

    @property
    def epoch(self) -> int:
        return getattr(self.sampler, "epoch", 0)

    @property
    def num_samples(self) -> int:
        """This rank's samples in a whole epoch."""
        return len(self.sampler)

    def flips(self) -> torch.Tensor:
        """Whether each sample of this epoch from ``start_index`` on is mirrored (bool, on
        the host)."""
        gen = torch.Generator().manual_seed(derived_seed(self.seed, 0, self.epoch, self.rank))
        return (torch.rand(self.num_samples, generator=gen) < 0.5)[self.start_index:]

    def __iter__(self) -> Iterator:
        indices = itertools.islice(iter(self.sampler), self.start_index, None)
        return zip(indices, self.flips().tolist()) if self.pairs else indices

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start_index)


def one_process_sampler(size: int, seed: int, world_size: int = 1) -> DistributedSampler:
    """The training order of a script that runs in one process: ``DistributedSampler``'s for
    one replica, so every variant shuffles the same way for the same seed and epoch.
    Under a process group of several (``world_size``) that would give every process all of
    the data: a DDP script makes its own DistributedSampler."""
    if world_size > 1:
        raise UserError(f"{world_size} processes need a DistributedSampler, or each would "
                        "train on all of the data")
    return DistributedSampler(range(size), num_replicas=1, rank=0, shuffle=True, seed=seed)


class IndexSampler(Sampler[int]):
    """The given indices, in order. ``indices`` may be replaced between epochs (an eval
    script choosing its shard); validation starts with this rank's shard."""

    def __init__(self, indices: Sequence[int]) -> None:
        self.indices = indices

    @classmethod
    def shard(cls, size: int, rank: int, world_size: int) -> "IndexSampler":
        """Every world_size-th index from ``rank``: disjoint shards covering each sample once."""
        return cls(range(rank, size, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
