"""The data sets both input paths read: CIFAR-10 (torchvision's, checked), Fashion-MNIST
(:mod:`.fashion_mnist`), ImageFolder (``<root>/train/<class>/*``, ``<root>/val/<class>/*``)
and FakeData, and what their images go through (resized, normalised with ImageNet's
statistics, or a grey data set's own); ``--train_subset``'s balanced subset.

CIFAR-10 is downloaded into ``--dataset_root`` by one process per node (no network: the error
says where to put the archive), checked against its md5 and member by member before anything
is extracted, its labels checked to be classes; a broken extracted file is named, and
extracted again from the archive when it lies beside it. An unreadable image of an
ImageFolder becomes an :class:`Unreadable` sample, which the loaders report or pass over.

The order both input paths read them in: training takes a seeded permutation per epoch from
a ``DistributedSampler`` (:class:`ResumableSampler`: a resumed epoch skips what it saw, and
each sample's flip is drawn from the seed, the epoch and the rank alone); validation gives
each rank every world_size-th sample, unpadded (:class:`IndexSampler`)."""
from __future__ import annotations

import itertools
import numbers
import os
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torchvision
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset, DistributedSampler, Sampler, Subset
from torchvision import transforms
from torchvision.datasets.utils import calculate_md5, download_url

from ..errors import RankError, UserError
from ..randomness import derived_seed
from . import fashion_mnist


CIFAR_CLASSES = 10  # its labels: 0..9
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
ARCHIVE_MD5 = torchvision.datasets.CIFAR10.tgz_md5  # the published archive's


class CIFAR10(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR10, trusting extracted batch files that exist, and extracting the
    archive only after :func:`extract_cifar_archive`'s checks.

    torchvision re-hashes the 178 MB of extracted files (md5) at every start; the archive
    is hashed once, before it is extracted.
    """

    def _files(self):
        names = [f for f, _ in self.train_list + self.test_list] + [self.meta["filename"]]
        return [os.path.join(self.root, self.base_folder, n) for n in names]

    def _check_integrity(self) -> bool:
        return all(os.path.isfile(p) for p in self._files())

    def _load_meta(self) -> None:
        path = os.path.join(self.root, self.base_folder, self.meta["filename"])
        with open(path, "rb") as f:
            self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    def download(self) -> None:
        """torchvision's own extracts without a filter: a ``../`` member, an absolute path or
        a link in a tampered archive would write outside ``root``."""
        if self._check_integrity():
            return
        archive = Path(self.root) / CIFAR_ARCHIVE
        if not archive.is_file():  # one put there is checked, never downloaded over
            # No md5 here: extract_cifar_archive hashes the 163 MB once, and says what is wrong.
            download_url(self.url, self.root, CIFAR_ARCHIVE)
        extract_cifar_archive(archive, Path(self.root))


def _unsafe_member(member: tarfile.TarInfo) -> Optional[str]:
    """Why ``member`` may not be extracted; None if it may. CIFAR-10's archive holds files and
    folders at relative paths only: anything else could write outside the folder."""
    if member.name.startswith("/") or os.path.isabs(member.name):
        return "has an absolute path"
    if ".." in member.name.replace("\\", "/").split("/"):
        return "leads out of the folder with '..'"
    if member.issym() or member.islnk():
        kind = "symbolic" if member.issym() else "hard"
        return f"is a {kind} link (to {member.linkname!r})"
    if not (member.isfile() or member.isdir()):
        return "is not a regular file or folder"
    return None


def extract_cifar_archive(archive: Path, root: Path) -> None:
    """Extract ``archive`` into ``root`` once it has CIFAR-10's published md5 and every member
    is safe; else a UserError naming it, and nothing written."""
    md5 = calculate_md5(str(archive))
    if md5 != ARCHIVE_MD5:
        raise UserError(f"{archive}: checksum mismatch (md5 {md5}, CIFAR-10's archive has "
                        f"{ARCHIVE_MD5}): nothing was extracted. Delete it to download CIFAR-10 "
                        "again, or put the one from https://www.cs.toronto.edu/~kriz/ there")
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        for member in members:  # all of them before anything is written
            why = _unsafe_member(member)
            if why is not None:
                raise UserError(f"{archive}: nothing was extracted: its member {member.name!r} "
                                f"{why} (CIFAR-10's archive holds only files and folders, "
                                "inside the folder it is extracted to)")
        # The stdlib's own check too, where this Python has it (3.11.4, 3.10.12 and later).
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(root, members, **safe)


def _bad_label(labels: Sequence) -> Optional[int]:
    """Index of the first label that is not a class index (an int in 0..9); None if all are.
    Out of range it fails the first step, and a float is cast to an int without a word."""
    for i, y in enumerate(labels):
        if isinstance(y, bool) or not isinstance(y, numbers.Integral) or not 0 <= y < CIFAR_CLASSES:
            return i
    return None


def _broken_cifar_file(folder: Path) -> Optional[Tuple[Path, str]]:
    """The first extracted CIFAR-10 file that cannot be read as one, and why; None if all can."""
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names + ["batches.meta"]:
        path = folder / name
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f, encoding="latin1")
            if name in names:
                images = np.asarray(entry["data"]).reshape(-1, 3, 32, 32)
                labels = entry["labels"]
                if len(labels) != len(images):
                    raise ValueError(f"{len(images)} images but {len(labels)} labels")
                bad = _bad_label(labels)
                if bad is not None:
                    raise ValueError(f"label {labels[bad]!r} of image {bad} is not a class "
                                     f"index 0..{CIFAR_CLASSES - 1}")
        except Exception as e:  # whatever a broken pickle raises
            return path, (str(e).splitlines() or [type(e).__name__])[0][:160]
    return None


def _load_cifar10(root: Path, train: bool, transform, download: bool) -> CIFAR10:
    data = CIFAR10(str(root), train=train, transform=transform, download=download)
    if _bad_label(data.targets) is not None:  # _broken_cifar_file names the file
        raise ValueError("a label that is not a class index")
    return data


def cifar10(root: Path, train: bool, transform, download: bool) -> CIFAR10:
    """torchvision's CIFAR-10 under ``root``. Broken extracted files are named, and extracted
    again from the archive when it lies beside them (by the process allowed to download)."""
    try:
        return _load_cifar10(root, train, transform, download)
    except UserError:  # a bad archive: already one line
        raise
    except Exception as e:  # URLError, socket errors, broken files: one line
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    folder, archive = Path(root) / CIFAR10.base_folder, Path(root) / CIFAR_ARCHIVE
    broken = _broken_cifar_file(folder) if folder.is_dir() else None
    if broken is None:
        raise UserError(
            f"CIFAR-10 is not in {root} and could not be downloaded ({reason}). Without a "
            f"network, put {CIFAR_ARCHIVE} (from https://www.cs.toronto.edu/~kriz/) in "
            f"{root}, or use --dataset ImageFolder or --dataset FakeData")
    path, why = broken
    if download and archive.is_file():
        try:
            extract_cifar_archive(archive, Path(root))
            data = _load_cifar10(root, train, transform, download=False)
            print(f"{path} was broken ({why}): extracted it again from {archive}", flush=True)
            return data
        except UserError:  # a bad archive, not extracted: that is what to fix first
            raise
        except Exception as e2:
            why += f"; extracting {archive} again did not help: {(str(e2).splitlines() or [''])[0]}"
    raise UserError(f"{path}: a broken CIFAR-10 file ({why}). Delete {folder} and run again to "
                    f"download CIFAR-10, or put a good {CIFAR_ARCHIVE} in {root} to extract it "
                    "again")


def check_cifar_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise UserError(f"--dataset_root {root} is a file, not a folder")


# ImageNet statistics: standard for AlexNet and what its pretrained weights expect.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FAKE_TRAIN_SIZE, FAKE_VAL_SIZE = 1000, 200
# The data sets of a known number of classes (ImageFolder: its number of class folders),
# which the fast input path holds whole on the device.
NUM_CLASSES = {"CIFAR10": CIFAR_CLASSES, "FashionMNIST": fashion_mnist.CLASSES, "FakeData": 10}


def normalization(name: str) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """(mean, std) per channel: a grey data set's own, ImageNet's for the colour ones."""
    return (fashion_mnist.MEAN, fashion_mnist.STD) if name == "FashionMNIST" else (MEAN, STD)


def build_transform(img_size: int, name: str = "CIFAR10") -> transforms.Compose:
    """What both splits' images go through; a training image's flip is its sampler's
    (:class:`ResumableSampler`), not a random transform's. A grey image becomes the three
    channels the networks take, after the resize (a third of the work)."""
    grey = [transforms.Grayscale(num_output_channels=3)] if name == "FashionMNIST" else []
    return transforms.Compose([transforms.Resize((img_size, img_size), antialias=True), *grey,
                               transforms.ToTensor(), transforms.Normalize(*normalization(name))])


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


def _labels(dataset: Dataset) -> Sequence[int]:
    targets = getattr(dataset, "targets", None)
    return targets if targets is not None else [dataset[i][1] for i in range(len(dataset))]


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


def build_datasets(name: str, root: Path, img_size: int, download: bool,
                   train: bool = True, train_subset: Optional[int] = None) -> Datasets:
    """The training split (unless ``train=False``; ``train_subset`` images of it, balanced)
    and the validation/test split; CIFAR-10 and Fashion-MNIST downloaded if they are not
    there and ``download`` (one process per node: the caller runs it first,
    ``distributed.local_main_first``)."""
    data = _datasets(name, Path(root), img_size, download, train)
    if train and train_subset is not None:
        indices = balanced_subset(_labels(data.train), train_subset, data.num_classes)
        data.train = Subset(data.train, indices)
    return data


def _datasets(name: str, root: Path, img_size: int, download: bool, train: bool) -> Datasets:
    train_tf = val_tf = build_transform(img_size, name)
    if name == "FashionMNIST":
        train_set = (fashion_mnist.FashionMNIST(root, True, train_tf, download)
                     if train else None)
        val_set = fashion_mnist.FashionMNIST(root, False, val_tf, download)
        return Datasets(train_set, val_set, NUM_CLASSES[name])
    if name == "CIFAR10":
        check_cifar_root(root)
        train_set = cifar10(root, True, train_tf, download=download) if train else None
        val_set = cifar10(root, False, val_tf, download=download and not train)
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
        start, self.start_index = self.start_index, 0  # a resumed epoch's start, taken once
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
