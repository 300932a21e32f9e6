"""Which training samples both input paths read (``--train_subset``: :func:`balanced_subset`)
and in what order: training training takes a seeded permutation per epoch from
a ``DistributedSampler`` (:class:`ResumableSampler`: a resumed epoch skips what it saw, and
each sample's flip is drawn from the seed, the epoch and the rank alone); validation gives
each rank every world_size-th sample, unpadded (:class:`IndexSampler`).
"""
from __future__ import annotations

import itertools
from typing import Iterator, List, Sequence

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from ..errors import UserError
from ..randomness import derived_seed


def balanced_subset(labels: Sequence[int], size: int, num_classes: int) -> List[int]:
    """``--train_subset``: ``size`` indices, as many of each class as can be (the first
    classes take the remainder), drawn by a fixed seed: the same subset for every --seed,
    variant and input path. Sorted, so the sampler's shuffle is the only order."""
    labels = torch.as_tensor(labels)
    if not num_classes <= size <= len(labels):
        raise UserError(f"--train_subset {size}: the training set has {len(labels)} images in "
                        f"{num_classes} classes; take {num_classes} to {len(labels)}")
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    chosen = []
    for c in range(num_classes):
        quota = size // num_classes + (c < size % num_classes)
        members = order[labels[order] == c][:quota]
        if len(members) < quota:
            raise UserError(f"--train_subset {size}: class {c} has {len(members)} training "
                            f"images, fewer than its {quota}; take a smaller subset")
        chosen.append(members)
    return torch.cat(chosen).sort().values.tolist()


def labels_of(dataset: Dataset) -> Sequence[int]:
    """Every sample's class: the data set's ``targets`` where it keeps them."""
    targets = getattr(dataset, "targets", None)
    return targets if targets is not None else [dataset[i][1] for i in range(len(dataset))]


class ResumableSampler(Sampler[int]):
    """A training sampler (the script's ``DistributedSampler``) that can start an epoch at a
    sample of its own: ``start_index``, taken by the next iteration alone (a DataLoader
    iterates its sampler itself), so that a run resumed mid-epoch skips what it trained on
    before it stopped (all of it, after a stop in the epoch's last step). The epoch is the
    sampler's own (``set_epoch`` is the script's, or the trainer's for a one-process
    script).

    It also draws each sample's horizontal flip, from (seed, epoch, rank) alone: the same
    flips on both input paths, in a resumed epoch as in the interrupted one, and none of
    the random stream that dropout draws from. ``pairs``: it yields ``(index, flip)`` (the
    classic path's :class:`.classic.NextReadable` takes them); else the indices, and the fast
    path takes :meth:`flips`."""

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

    def flips(self, start: int = 0) -> torch.Tensor:
        """Whether each sample of this epoch from ``start`` on is mirrored (bool, on the
        host)."""
        gen = torch.Generator().manual_seed(derived_seed(self.seed, 0, self.epoch, self.rank))
        return (torch.rand(self.num_samples, generator=gen) < 0.5)[start:]

    def __iter__(self) -> Iterator:
        start, self.start_index = self.start_index, 0
        indices = itertools.islice(iter(self.sampler), start, None)
        return zip(indices, self.flips(start).tolist()) if self.pairs else indices

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start_index)


def one_process_sampler(size: int, seed: int) -> DistributedSampler:
    """The training order of a script that runs in one process: ``DistributedSampler``'s for
    one replica, so every variant shuffles the same way for the same seed and epoch. (Under
    torchrun with several processes a one-process script is refused at its flags: each
    process would train on all of the data.)"""
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
