"""A run's data: the data sets and the order they are read in (:mod:`.datasets`: CIFAR-10,
Fashion-MNIST, ImageFolder, FakeData), the two input paths -- the whole data set on the device
(:mod:`.on_device`) or torchvision's DataLoader (:mod:`.classic`) -- and the loaders a
script takes from them.

``build_loaders`` picks the path (``--loader auto``: fast for the data sets held whole on the
device, CIFAR10, FashionMNIST and FakeData; classic for ImageFolder).
``Loaders.train_loader(sampler)`` yields the training batches in a sampler's order (a
script's ``DistributedSampler``, or one process's); both paths' batches arrive on the
device, and a resumed epoch starts at a batch of its own (``loader.batches(start)``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sized, Tuple

import torch
from torch.utils.data import Sampler, Subset

from ..distributed import DistInfo
from ..errors import UserError
from .classic import CheckedLoader, default_workers, eval_dataloader, train_dataloader
from .datasets import NUM_CLASSES, build_datasets
from .image_folder import Unreadable
from .order import balanced_subset, labels_of, one_process_sampler
from .on_device import fast_loaders


@dataclass
class Loaders:
    """A run's data: its validation loader, what its training sampler draws from
    (``train_set``), and the training loader made for that sampler."""
    name: str
    # Per process: the global batch is this times the processes and the accumulation steps.
    batch_size: int
    # None for an evaluation, which trains on nothing.
    train_set: Optional[Sized]
    val: Iterable
    num_classes: int
    train_size: int
    val_size: int
    # "fast" (the data set held whole on the device) or "classic" (a DataLoader).
    kind: str
    make_train: Optional[Callable[[Sampler[int]], Iterable]] = None
    # (3, --img_size, --img_size): the FLOPs per image are counted at this size.
    image_shape: Tuple[int, ...] = ()
    train: Optional[Iterable] = field(default=None, init=False)

    def last_batch(self, world_size: int) -> int:
        """The images of an epoch's last batch in each of ``world_size`` processes (their
        shards are padded to one size, and no batch is dropped)."""
        return math.ceil(self.train_size / world_size) % self.batch_size or self.batch_size

    def global_batch(self, accum_steps: int, world_size: int) -> int:
        """The images of one optimizer step, over every process and micro-batch."""
        return self.batch_size * accum_steps * world_size

    def train_loader(self, sampler: Sampler[int]) -> Iterable:
        """The training batches, in ``sampler``'s order, on the device."""
        self.train = self.make_train(sampler)
        return self.train

    def take_unreadable(self) -> List[Unreadable]:
        """The images the loaders left out since the last call (--skip_bad_images)."""
        taken = []
        for loader in (self.train, self.val):
            if isinstance(loader, CheckedLoader):
                taken, loader.unreadable = taken + loader.unreadable, []
        return taken


def unreadable_line(unreadable: List[Unreadable], when: str) -> Optional[str]:
    """--skip_bad_images: the images the loaders left out (every rank's, gathered), named in
    one line; None for none."""
    if not unreadable:
        return None
    more = f"; and {len(unreadable) - 5} more" if len(unreadable) > 5 else ""
    return (f"skipped {len(unreadable)} unreadable image(s) {when} (--skip_bad_images): "
            + "; ".join(str(u) for u in unreadable[:5]) + more)


def loader_kind(dataset: str, loader: str) -> str:
    """The input path ``--loader`` takes for ``dataset``: ``auto`` is the fast one for the data
    sets held whole on the device (CIFAR10, FashionMNIST, FakeData), the classic one for
    ImageFolder."""
    return ("fast" if dataset in NUM_CLASSES else "classic") if loader == "auto" else loader


def check_loader_flags(kind: str, *, num_workers: Optional[int], skip_bad: bool) -> None:
    """``--num_workers`` and ``--skip_bad_images`` are the classic path's: with the fast one,
    which has no workers and reads no image files, each is one line."""
    if kind == "fast" and (num_workers is not None or skip_bad):
        flag = "--num_workers" if num_workers is not None else "--skip_bad_images"
        raise UserError(f"{flag} is for the classic DataLoader input path; this run takes the "
                        "fast one (--loader fast, the default for CIFAR10, FashionMNIST and FakeData), which "
                        "has no worker processes and reads no image files: leave it out, or "
                        "give --loader classic")


def build_loaders(name: str, root: Path, img_size: int, batch_size: int, info: DistInfo, *,
                  loader: str = "auto", num_workers: Optional[int] = None,
                  channels_last: bool = False, train: bool = True,
                  train_subset: Optional[int] = None, skip_bad: bool = False) -> Loaders:
    """The validation loader and (unless ``train=False``) the training set -- ``train_subset``
    images of it, as many of each class -- fast or classic; CIFAR-10 and Fashion-MNIST
    downloaded by local rank 0 (the caller runs it first: ``local_main_first``)."""
    kind = loader_kind(name, loader)
    check_loader_flags(kind, num_workers=num_workers, skip_bad=skip_bad)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    if kind == "fast":
        train_set, val_dl, num_classes = fast_loaders(name, root, img_size, batch_size, info,
                                                      channels_last=channels_last, train=train,
                                                      train_subset=train_subset)
        make_train = train_set.loader if train else None
        val_size = val_dl.dataset_size
    else:
        data = build_datasets(name, root, img_size, download=info.is_local_main, train=train)
        if train and train_subset is not None:
            data.train = Subset(data.train, balanced_subset(labels_of(data.train), train_subset,
                                                            data.num_classes))
        workers = default_workers(num_workers, info.device)
        train_set, num_classes, val_size = data.train, data.num_classes, len(data.val)
        val_dl = eval_dataloader(data.val, info, batch_size=batch_size, num_workers=workers,
                                 memory_format=memory_format, img_size=img_size,
                                 skip_bad=skip_bad)

        def make_train(sampler):
            return train_dataloader(train_set, sampler, batch_size=batch_size,
                                    num_workers=workers, device=info.device,
                                    memory_format=memory_format, img_size=img_size,
                                    skip_bad=skip_bad)
    train_size = len(train_set) if train else 0
    if (train and train_size == 0) or val_size == 0:
        raise UserError(f"{root}: the data set has no images"
                        + ("" if val_size else " in its validation/test split"))
    if train and num_classes < 2:
        raise UserError(f"{root}: {num_classes} class: a classifier needs at least 2 classes "
                        "(one folder per class under train/ and val/)")
    return Loaders(name, batch_size, train_set, val_dl, num_classes, train_size, val_size, kind,
                   make_train if train else None, (3, img_size, img_size))


__all__ = ["Loaders", "build_loaders", "check_loader_flags", "loader_kind", "one_process_sampler",
           "unreadable_line"]
