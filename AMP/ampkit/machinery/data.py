"""The training and validation loaders: the fast device path or the classic DataLoader.

``build_loaders`` picks the path (``--loader auto``: fast for the data sets held in
memory, CIFAR10 and FakeData; classic for ImageFolder). Both yield (images, targets)
batches in the same order for the same seed and epoch, and both expose ``.sampler``:
``set_epoch`` and ``start_index`` for training (:class:`ResumableDistributedSampler`),
replaceable ``indices`` for validation (:class:`IndexSampler`, this rank's shard).

The classic path is torchvision's: a DataLoader with PIL transforms in ``--num_workers``
worker processes, pinned memory and non-blocking copies on CUDA. An image that cannot be
read stops the run with a one-line error naming it, or, with ``--skip_bad_images``, is
left out and listed (:class:`CheckedLoader`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .datasets import (BadImage, IndexSampler, Unreadable, build_datasets, collate_readable,
                       train_sampler)
from ..distributed import DistInfo
from .errors import UserError
from .fastdata import fast_loaders, fits_in_memory


def default_workers(num_workers: Optional[int], device: torch.device) -> int:
    return num_workers if num_workers is not None else (4 if device.type == "cuda" else 0)


class CheckedLoader:
    """A DataLoader whose unreadable images (see :class:`ampkit.datasets.ImageFolder`) stop
    the run with a one-line error naming the first, or with ``skip`` are left out of their
    batch and listed in ``skipped`` (emptied by its reader, e.g. once per epoch)."""

    def __init__(self, loader: DataLoader, skip: bool) -> None:
        self.loader, self.skip = loader, skip
        self.skipped: List[Unreadable] = []

    @property
    def sampler(self) -> Sampler:
        return self.loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        for images, targets, bad in self.loader:
            if bad and not self.skip:
                raise BadImage(f"{bad[0].path}: unreadable image ({bad[0].reason}); replace or "
                               "delete it, or pass --skip_bad_images to go on without it")
            self.skipped += bad
            if images is not None:
                yield images, targets


def _loader(dataset: Dataset, batch_size: int, sampler: Sampler, num_workers: int,
            device: torch.device, skip_bad: bool) -> CheckedLoader:
    return CheckedLoader(DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
        pin_memory=device.type == "cuda", persistent_workers=num_workers > 0, drop_last=False,
        collate_fn=collate_readable), skip_bad)


def train_loader(dataset: Dataset, batch_size: int, num_workers: int, info: DistInfo,
                 seed: int, skip_bad: bool = False) -> CheckedLoader:
    return _loader(dataset, batch_size, train_sampler(len(dataset), info, seed), num_workers,
                   info.device, skip_bad)


def eval_loader(dataset: Dataset, batch_size: int, num_workers: int, info: DistInfo,
                skip_bad: bool = False) -> CheckedLoader:
    return _loader(dataset, batch_size, IndexSampler.shard(len(dataset), info), num_workers,
                   info.device, skip_bad)


@dataclass
class Loaders:
    train: Optional[Iterable]  # None for eval
    val: Iterable
    num_classes: int
    train_size: int
    val_size: int
    kind: str                  # "fast" or "classic"


def build_loaders(name: str, root: Path, img_size: int, batch_size: int, info: DistInfo, *,
                  loader: str = "auto", num_workers: Optional[int] = None, seed: int = 0,
                  channels_last: bool = False, train: bool = True,
                  skip_bad: bool = False) -> Loaders:
    """The training (unless ``train=False``) and validation loaders, fast or classic path."""
    kind = ("fast" if fits_in_memory(name) else "classic") if loader == "auto" else loader
    if kind == "fast":
        train_dl, val_dl, num_classes = fast_loaders(name, root, img_size, batch_size, info,
                                                     seed=seed, channels_last=channels_last,
                                                     train=train)
        sizes = (train_dl.dataset_size if train_dl is not None else 0, val_dl.dataset_size)
    else:
        data = build_datasets(name, root, img_size, info, train=train)
        workers = default_workers(num_workers, info.device)
        train_dl = (train_loader(data.train, batch_size, workers, info, seed, skip_bad)
                    if train else None)
        val_dl = eval_loader(data.val, batch_size, workers, info, skip_bad)
        num_classes = data.num_classes
        sizes = (len(data.train) if train else 0, len(data.val))
    if (train and sizes[0] == 0) or sizes[1] == 0:
        raise UserError(f"{root}: the data set has no images"
                        + ("" if sizes[1] else " in its validation/test split"))
    if train and num_classes < 2:
        raise UserError(f"{root}: {num_classes} class: a classifier needs at least 2 classes "
                        "(one folder per class under train/ and val/)")
    return Loaders(train_dl, val_dl, num_classes, sizes[0], sizes[1], kind)


def take_skipped(loaders: Loaders) -> List[Unreadable]:
    """The images the loaders left out since the last call (--skip_bad_images)."""
    skipped = []
    for dl in (loaders.train, loaders.val):
        if isinstance(dl, CheckedLoader):
            skipped, dl.skipped = skipped + dl.skipped, []
    return skipped
