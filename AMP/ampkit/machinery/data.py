"""The training and validation loaders: the fast device path or the classic DataLoader.

``build_loaders`` picks the path (``--loader auto``: fast for CIFAR10 and FakeData, classic
for ImageFolder); ``Loaders.train_loader(sampler)`` yields the batches in a sampler's order
(a script's ``DistributedSampler``, or one process's), resumable through
``.sampler.start_index``. The classic path is torchvision's DataLoader with PIL transforms,
workers (which ignore the stop signals), pinned memory. An unreadable image is a one-line error naming it; with
``--skip_bad_images`` it is listed and left out of validation, and in training the next
readable image takes its place, so that every rank runs as many full batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Sized, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .datasets import (BadImage, NextReadable, Unreadable, build_datasets,
                       collate_next_readable, collate_readable)
from .samplers import IndexSampler, ResumableSampler, one_process_sampler
from .process import DistInfo, UserError
from .fastdata import fast_loaders, fits_in_memory
from .signals import held_stop_signals, ignore_stop_signals


def default_workers(num_workers: Optional[int], device: torch.device) -> int:
    return num_workers if num_workers is not None else (4 if device.type == "cuda" else 0)


class CheckedLoader:
    """A DataLoader whose unreadable images (see :class:`.datasets.ImageFolder`) stop
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
        with held_stop_signals():  # the workers start here, the first time
            batches = iter(self.loader)
        for images, targets, bad in batches:
            if bad and not self.skip:
                raise BadImage(f"{bad[0].path}: unreadable image ({bad[0].reason}); replace or "
                               "delete it, or pass --skip_bad_images to go on without it")
            self.skipped += bad
            if images is not None:
                yield images, targets


def _loader(dataset: Dataset, batch_size: int, sampler: Sampler, num_workers: int,
            device: torch.device, skip_bad: bool, collate=collate_readable) -> CheckedLoader:
    # The workers ignore the stop signals: only the main process decides to stop
    # (machinery/signals.py). The loader's own generator draws the workers' seeds, not the
    # random stream that dropout draws from (a resumed run goes on with that stream).
    return CheckedLoader(DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
        pin_memory=device.type == "cuda", persistent_workers=num_workers > 0, drop_last=False,
        collate_fn=collate, worker_init_fn=ignore_stop_signals,
        generator=torch.Generator()), skip_bad)


def train_loader(dataset: Dataset, batch_size: int, num_workers: int, info: DistInfo,
                 sampler: Optional[Sampler[int]] = None, seed: int = 0,
                 skip_bad: bool = False) -> CheckedLoader:
    """Batches in ``sampler``'s order (None: one process's, seeded by ``seed``) with its
    flips, always full: an unreadable image is replaced by the next readable one
    (:class:`NextReadable`)."""
    sampler = ResumableSampler(sampler or one_process_sampler(len(dataset), seed), pairs=True)
    return _loader(NextReadable(dataset), batch_size, sampler, num_workers, info.device,
                   skip_bad, collate_next_readable)


def eval_loader(dataset: Dataset, batch_size: int, num_workers: int, info: DistInfo,
                skip_bad: bool = False) -> CheckedLoader:
    return _loader(dataset, batch_size, IndexSampler.shard(len(dataset), info), num_workers,
                   info.device, skip_bad)


@dataclass
class Loaders:
    train_set: Optional[Sized]  # what the training sampler draws from; None for eval
    val: Iterable
    num_classes: int
    train_size: int
    val_size: int
    kind: str                  # "fast" or "classic"
    make_train: Optional[Callable[[Sampler[int]], Iterable]] = None
    input_format: torch.memory_format = torch.contiguous_format  # channels_last, --channels_last
    image_shape: Tuple[int, ...] = ()  # (3, --img_size, --img_size): a blank image's shape

    def train_loader(self, sampler: Sampler[int]) -> Iterable:
        """The training batches, in ``sampler``'s order; ``.sampler.start_index`` resumes."""
        return self.make_train(sampler)


def build_loaders(name: str, root: Path, img_size: int, batch_size: int, info: DistInfo, *,
                  loader: str = "auto", num_workers: Optional[int] = None,
                  channels_last: bool = False, train: bool = True,
                  skip_bad: bool = False) -> Loaders:
    """The validation loader and (unless ``train=False``) the training set, fast or classic."""
    kind = ("fast" if fits_in_memory(name) else "classic") if loader == "auto" else loader
    if kind == "fast":
        train_set, val_dl, num_classes = fast_loaders(name, root, img_size, batch_size, info,
                                                      channels_last=channels_last, train=train)
        make_train = train_set.loader if train else None
    else:
        data = build_datasets(name, root, img_size, info, train=train)
        workers = default_workers(num_workers, info.device)
        train_set, num_classes = data.train, data.num_classes
        val_dl = eval_loader(data.val, batch_size, workers, info, skip_bad)
        make_train = (lambda sampler: train_loader(train_set, batch_size, workers, info,
                                                   sampler, skip_bad=skip_bad))
    sizes = (len(train_set) if train else 0, val_dl.dataset_size if kind == "fast"
             else len(val_dl.loader.dataset))
    if (train and sizes[0] == 0) or sizes[1] == 0:
        raise UserError(f"{root}: the data set has no images"
                        + ("" if sizes[1] else " in its validation/test split"))
    if train and num_classes < 2:
        raise UserError(f"{root}: {num_classes} class: a classifier needs at least 2 classes "
                        "(one folder per class under train/ and val/)")
    return Loaders(train_set, val_dl, num_classes, sizes[0], sizes[1], kind, make_train,
                   torch.channels_last if channels_last else torch.contiguous_format,
                   (3, img_size, img_size))


def take_skipped(*loaders: Iterable) -> List[Unreadable]:
    """The images the loaders left out since the last call (--skip_bad_images)."""
    skipped = []
    for dl in loaders:
        if isinstance(dl, CheckedLoader):
            skipped, dl.skipped = skipped + dl.skipped, []
    return skipped


def report_skipped(logger, skipped: List[Unreadable]) -> int:
    """--skip_bad_images: name the images the loaders left out (every rank's, gathered from
    their :func:`take_skipped`); how many."""
    if skipped:
        more = f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        logger.print(f"skipped {len(skipped)} unreadable image(s) this epoch: "
                     + "; ".join(str(u) for u in skipped[:5]) + more)
    return len(skipped)
