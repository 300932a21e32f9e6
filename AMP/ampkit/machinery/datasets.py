"""Data sets and transforms: what both input paths (classic and fast) read.

CIFAR-10 (:mod:`.cifar`); ImageFolder (``<root>/train/<class>/*``, ``<root>/val/<class>/*``),
whose unreadable images become :class:`Unreadable` samples, reported or passed over by the
loaders; FakeData. Each image is resized and normalised with ImageNet's statistics; the
order the samples are read in is :mod:`.samplers`'.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torchvision
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset, default_collate
from torchvision import transforms

from .cifar import CIFAR_CLASSES, check_cifar_root, cifar10
from .process import DistInfo, RankError, UserError

# ImageNet statistics: standard for AlexNet and what its pretrained weights expect.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FAKE_TRAIN_SIZE, FAKE_VAL_SIZE = 1000, 200
# ImageFolder: its number of class folders.
NUM_CLASSES = {"CIFAR10": CIFAR_CLASSES, "FakeData": 10}


def build_transform(img_size: int) -> transforms.Compose:
    """What both splits' images go through; a training image's flip is its sampler's
    (:class:`.samplers.ResumableSampler`), not a random transform's."""
    return transforms.Compose([transforms.Resize((img_size, img_size), antialias=True),
                               transforms.ToTensor(), transforms.Normalize(MEAN, STD)])


class BadImage(RankError):
    """An image file that cannot be read: corrupt, truncated, not an image, no permission."""


@dataclass(frozen=True)
class Unreadable:
    """Stands in a sample for an image that could not be read: its path, and why."""
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


class ImageFolder(torchvision.datasets.ImageFolder):
    """torchvision's ImageFolder whose unreadable images become :class:`Unreadable` samples:
    raised inside a DataLoader worker, their error would reach the user as a traceback,
    without the file's name in its last line."""

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        try:
            with open(path, "rb") as f:
                image = Image.open(f).convert("RGB")  # decodes it all: truncation shows here
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            reason = ("not an image file PIL can read" if isinstance(e, UnidentifiedImageError)
                      else e.strerror if isinstance(e, PermissionError)
                      else (str(e).splitlines() or [type(e).__name__])[0])
            return Unreadable(path, reason), target
        return (self.transform(image) if self.transform else image), target


def collate_readable(batch: list) -> Tuple[Optional[object], Optional[object], List[Unreadable]]:
    """``(images, targets)`` of the readable samples (None, None if there is none), and the
    unreadable ones."""
    bad = [x for x, _ in batch if isinstance(x, Unreadable)]
    good = [(x, y) for x, y in batch if not isinstance(x, Unreadable)]
    images, targets = default_collate(good) if good else (None, None)
    return images, targets, bad


class NextReadable(Dataset):
    """A training split whose unreadable image is replaced by the next readable one: each
    sample, asked for as ``(index, flip)``, is ``(image, mirrored if flip, target, [the
    Unreadable ones passed over])``.

    A batch then never shrinks, and no rank runs fewer steps than its peers: under DDP or
    FSDP2 a rank whose batch was left empty would skip a step, and the others would wait
    for it in that step's collectives. The images passed over are listed like the ones
    left out of validation."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Tuple[int, bool]):
        index, flip = key
        passed = []
        for offset in range(len(self.dataset)):
            image, target = self.dataset[(index + offset) % len(self.dataset)]
            if not isinstance(image, Unreadable):
                return (image.flip(-1) if flip else image), target, passed
            passed.append(image)
        raise UserError(f"no image of the training split can be read (the first: {passed[0]})")


def collate_next_readable(batch: list) -> Tuple[object, object, List[Unreadable]]:
    """``(images, targets, the unreadable images passed over)`` of :class:`NextReadable`."""
    images, targets = default_collate([(x, y) for x, y, _ in batch])
    return images, targets, [bad for _, _, passed in batch for bad in passed]


def _image_folder(root: Path, split: str, transform) -> ImageFolder:
    folder = root / split
    if not folder.is_dir():
        raise UserError(f"--dataset ImageFolder expects {folder}/ with one folder per class "
                        f"(and {root / ('val' if split == 'train' else 'train')}/ beside it)")
    try:
        with os.scandir(folder) as entries:  # os.walk, in ImageFolder, skips unreadable ones
            for entry in entries:
                if entry.is_dir():
                    with os.scandir(entry.path):
                        pass
        return ImageFolder(str(folder), transform=transform)
    except PermissionError as e:
        raise UserError(f"{e.filename or folder}: {e.strerror} (the data set must be readable "
                        "by this user)") from None
    except (OSError, RuntimeError) as e:
        raise UserError(f"{folder}: {str(e).splitlines()[0]}") from None


@dataclass
class Datasets:
    train: Optional[Dataset]
    val: Dataset
    num_classes: int


def build_datasets(name: str, root: Path, img_size: int, info: DistInfo,
                   train: bool = True) -> Datasets:
    """The training split (unless ``train=False``) and the validation/test split."""
    root = Path(root)
    train_tf = val_tf = build_transform(img_size)
    if name == "CIFAR10":
        check_cifar_root(root)
        # Only local rank 0 downloads; the caller runs it first (distributed.local_main_first).
        train_set = cifar10(root, True, train_tf, download=info.is_local_main) if train else None
        val_set = cifar10(root, False, val_tf, download=info.is_local_main and not train)
        return Datasets(train_set, val_set, NUM_CLASSES[name])
    if name == "ImageFolder":
        if not root.is_dir():
            raise UserError(f"--dataset_root {root} does not exist or is not a folder")
        if not any(root.iterdir()):
            raise UserError(f"--dataset_root {root} is empty: ImageFolder expects train/ and val/")
        train_set = _image_folder(root, "train", train_tf) if train else None
        val_set = _image_folder(root, "val", val_tf)
        if train_set is not None and train_set.classes != val_set.classes:
            raise UserError(f"{root}: train/ and val/ have different class folders")
        return Datasets(train_set, val_set, len(val_set.classes))
    if name == "FakeData":
        fake = torchvision.datasets.FakeData
        size = (3, 32, 32)
        train_set = fake(FAKE_TRAIN_SIZE, size, 10, train_tf, random_offset=0) if train else None
        val_set = fake(FAKE_VAL_SIZE, size, 10, val_tf, random_offset=FAKE_TRAIN_SIZE)
        return Datasets(train_set, val_set, NUM_CLASSES[name])
    raise UserError(f"unknown --dataset {name!r}")
