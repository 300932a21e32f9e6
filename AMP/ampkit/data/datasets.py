"""The data sets both input paths read: CIFAR-10 and Fashion-MNIST (torchvision's, checked),
ImageFolder (``<root>/train/<class>/*``, ``<root>/val/<class>/*``) and FakeData, and what
their images go through (resized, normalised). CIFAR-10's archive is checked against its md5
and member by member before anything is extracted; a broken extracted file is named, and
extracted again from the archive beside it. ImageFolder's tree and its unreadable images:
:mod:`.image_folder`. Their order: :mod:`.order`."""
from __future__ import annotations

import gzip
import math
import numbers
import os
import pickle
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
import torchvision
from torch.utils.data import Dataset
from torchvision import transforms
from torchvision.datasets.utils import calculate_md5, download_url

from ..errors import UserError
from .image_folder import ImageFolder, tree_problem


CIFAR_CLASSES = 10
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
ARCHIVE_MD5 = torchvision.datasets.CIFAR10.tgz_md5


class CIFAR10(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR10, trusting extracted batch files that exist (torchvision re-hashes
    their 178 MB at every start), extracting the archive after :func:`extract_cifar_archive`'s
    checks (one md5 of the archive)."""

    def _check_integrity(self) -> bool:
        names = [f for f, _ in self.train_list + self.test_list] + [self.meta["filename"]]
        return all(os.path.isfile(os.path.join(self.root, self.base_folder, n)) for n in names)

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
        # An archive put there by hand (no network) is checked, never downloaded over.
        if not archive.is_file():
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
        # All checked before anything is written: no half-extracted folder is left.
        for member in members:
            why = _unsafe_member(member)
            if why is not None:
                raise UserError(f"{archive}: nothing was extracted: its member {member.name!r} "
                                f"{why} (CIFAR-10's archive holds only files and folders, "
                                "inside the folder it is extracted to)")
        # The stdlib's own check too, where this Python has it (3.11.4, 3.10.12 and later).
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        try:
            tar.extractall(root, members, **safe)
        # A file where a folder must be; a folder of the root that links out of it.
        except (OSError, tarfile.TarError) as e:
            raise UserError(f"{archive}: cannot be extracted into {root}: {e}") from None


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
            if name not in names:
                dict.fromkeys(entry["label_names"])  # what torchvision makes of them
                continue
            images, labels = entry["data"], entry["labels"]
            if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or \
                    images.shape[1:] != (3072,):
                raise ValueError("its 'data' is not CIFAR-10's: an image a row of 3072 bytes")
            if len(labels) != len(images):
                raise ValueError(f"{len(images)} images but {len(labels)} labels")
            bad = _bad_label(labels)
            if bad is not None:
                raise ValueError(f"label {labels[bad]!r} of image {bad} is not a class index "
                                 f"0..{CIFAR_CLASSES - 1}")
        # A broken pickle may raise anything at all.
        except Exception as e:
            return path, (str(e).splitlines() or [type(e).__name__])[0][:160]
    return None


def _load_cifar10(root: Path, train: bool, transform, download: bool) -> CIFAR10:
    data = CIFAR10(str(root), train=train, transform=transform, download=download)
    # torchvision reads without a word pixels that are not bytes, and as many labels as
    # the files hold; no file named here: cifar10() asks _broken_cifar_file which one it is.
    if _bad_label(data.targets) is not None or data.data.dtype != np.uint8 or \
            len(data.targets) != len(data.data):
        raise ValueError("not CIFAR-10's format: a label that is not a class index, pixels "
                         "that are not bytes, or not one label an image")
    return data


def cifar10(root: Path, train: bool, transform, download: bool) -> CIFAR10:
    """torchvision's CIFAR-10 under ``root``. Broken extracted files are named, and extracted
    again from the archive when it lies beside them (by the process allowed to download)."""
    # A bad archive's error is one line already; any other (URLError, a broken file) below.
    try:
        return _load_cifar10(root, train, transform, download)
    except UserError:
        raise
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    folder, archive = Path(root) / CIFAR10.base_folder, Path(root) / CIFAR_ARCHIVE
    broken = _broken_cifar_file(folder) if folder.is_dir() else None
    if broken is None:
        raise UserError(
            f"CIFAR-10 is not in {root} and could not be downloaded ({reason}). Without a "
            f"network, put {CIFAR_ARCHIVE} (from https://www.cs.toronto.edu/~kriz/) in "
            f"{root}; or real data offline, --dataset FashionMNIST ({FASHION_OFFLINE}); or "
            f"--dataset ImageFolder or FakeData")
    path, why = broken
    if download and archive.is_file():
        # A bad archive extracts nothing: its error, as it is, is what to fix first.
        try:
            extract_cifar_archive(archive, Path(root))
            data = _load_cifar10(root, train, transform, download=False)
            print(f"{path} was broken ({why}): extracted it again from {archive}", flush=True)
            return data
        except UserError:
            raise
        except Exception as e2:
            why += f"; extracting {archive} again did not help: {(str(e2).splitlines() or [''])[0]}"
    raise UserError(f"{path}: a broken CIFAR-10 file ({why}). Delete {folder} and run again to "
                    f"download CIFAR-10, or put a good {CIFAR_ARCHIVE} in {root} to extract it "
                    "again")


# Fashion-MNIST's idx files (Debian's, gzipped, or torchvision's layout), checked closely.
FASHION_CLASSES = 10
# An idx file's magic number: 0x08 (unsigned bytes), then its number of dimensions.
IMAGES_MAGIC, LABELS_MAGIC = 0x0803, 0x0801
# Over the 60,000 training images, pixels scaled to 0..1.
FASHION_MEAN, FASHION_STD = (0.2860,) * 3, (0.3530,) * 3
FASHION_OFFLINE = ("apt install dataset-fashion-mnist, then --dataset_root "
                   "/usr/share/datasets/fashion-mnist")


def _fashion_names(train: bool) -> Tuple[str, str]:
    split = "train" if train else "t10k"
    return f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"


def _fashion_file(folder: Path, name: str) -> Optional[Path]:
    return next((p for p in (folder / name, folder / f"{name}.gz") if p.is_file()), None)


def fashion_folder(root: Path) -> Optional[Path]:
    """``root`` or torchvision's ``root/FashionMNIST/raw``: the first to hold the idx files;
    None if neither holds any. One with only some of the four is refused."""
    every = _fashion_names(True) + _fashion_names(False)
    for folder in (root, root / "FashionMNIST" / "raw"):
        missing = [n for n in every if not _fashion_file(folder, n)]
        if missing and len(missing) < len(every):
            raise UserError(f"{folder}: Fashion-MNIST's idx files are incomplete: "
                            f"{', '.join(missing)} missing (.gz or not). Put all four there, "
                            f"or: {FASHION_OFFLINE}")
        if not missing:
            return folder
    return None


def read_idx(path: Path, magic: int) -> torch.Tensor:
    """An idx file of unsigned bytes with the given magic number, as a uint8 tensor of its
    dimensions; a UserError naming the file if it is not one, or is cut short or too long."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        kind = "gzip" if path.suffix == ".gz" else "an idx file"
        raise UserError(f"{path}: cannot be read as {kind} ({e or type(e).__name__})") from None
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        kind = "images" if magic == IMAGES_MAGIC else "labels"
        raise UserError(f"{path}: not an idx file of {kind} (magic number 0x{found:08x}, "
                        f"expected 0x{magic:08x})")
    header = 4 * (1 + (magic & 0xFF))
    shape = [int.from_bytes(data[i:i + 4], "big") for i in range(4, header, 4)]
    # Python's integers: a header's sizes may multiply past 64 bits.
    expected = header + math.prod(shape)
    if len(data) != expected:
        raise UserError(f"{path}: {'truncated' if len(data) < expected else 'too long'}: "
                        f"{len(data):,} bytes where its header {tuple(shape)} needs {expected:,}")
    # frombuffer refuses an offset at the buffer's end: a file of 0 items is its header alone.
    if expected == header:
        return torch.empty(shape, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header).view(*shape)


def load_fashion_mnist(root: Path, train: bool,
                       download: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """A split as (images uint8 [N, 28, 28], labels int64 [N]), from ``root`` or, where it
    holds no idx file and ``download``, downloaded by torchvision into its own layout there."""
    root = Path(root)
    check_root(root)
    folder = fashion_folder(root) if root.is_dir() else None
    if folder is None and download:
        try:
            torchvision.datasets.FashionMNIST(str(root), train=train, download=True)
        except Exception as e:
            # torchvision's error spans lines (the file, each mirror tried): the user gets one.
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            raise UserError(f"Fashion-MNIST is not in {root} and could not be downloaded "
                            f"({reason}). Without a network: {FASHION_OFFLINE}") from None
        folder = fashion_folder(root)
    if folder is None:
        raise UserError(f"Fashion-MNIST is not in {root} (no idx file there or in "
                        f"{root / 'FashionMNIST' / 'raw'}). Without a network: {FASHION_OFFLINE}")
    image_file, label_file = (_fashion_file(folder, n) for n in _fashion_names(train))
    images, labels = read_idx(image_file, IMAGES_MAGIC), read_idx(label_file, LABELS_MAGIC)
    if len(images) != len(labels):
        raise UserError(f"{folder}: {image_file.name} holds {len(images)} images but "
                        f"{label_file.name} {len(labels)} labels")
    if not images.numel():
        what = f"images of {images.shape[1]} x {images.shape[2]}" if len(images) else "no images"
        raise UserError(f"{image_file}: holds {what}: nothing to train or test on")
    bad = (labels >= FASHION_CLASSES).nonzero()
    if len(bad):
        raise UserError(f"{label_file}: label {int(labels[bad[0]])} of image {int(bad[0])} is "
                        f"not a class index 0..{FASHION_CLASSES - 1}")
    return images, labels.long()


class FashionMNIST(torchvision.datasets.FashionMNIST):
    """torchvision's FashionMNIST (PIL images, "L" mode) over what load_fashion_mnist checked."""

    def __init__(self, root: Path, train: bool, transform, download: bool) -> None:
        # Not torchvision's __init__: it reads its own layout, or a legacy cache
        # (processed/*.pt) in place of the checked files where one lies there.
        torchvision.datasets.VisionDataset.__init__(self, str(root), transform=transform)
        self.train = train
        self.data, self.targets = load_fashion_mnist(root, train, download)


def check_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise UserError(f"--dataset_root {root} is a file, not a folder")


# ImageNet statistics: standard for AlexNet and what its pretrained weights expect.
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FAKE_TRAIN_SIZE, FAKE_VAL_SIZE = 1000, 200
# The data sets of a known number of classes (ImageFolder: its number of class folders),
# which the fast input path holds whole on the device.
NUM_CLASSES = {"CIFAR10": CIFAR_CLASSES, "FashionMNIST": FASHION_CLASSES, "FakeData": 10}


def normalization(name: str) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """(mean, std) per channel: a grey data set's own, ImageNet's for the colour ones."""
    return (FASHION_MEAN, FASHION_STD) if name == "FashionMNIST" else (MEAN, STD)


def build_transform(img_size: int, name: str = "CIFAR10") -> transforms.Compose:
    """What both splits' images go through; a training image's flip is its sampler's
    (:class:`ResumableSampler`), not a random transform's. A grey image becomes the three
    channels the networks take, after the resize (a third of the work)."""
    grey = [transforms.Grayscale(num_output_channels=3)] if name == "FashionMNIST" else []
    return transforms.Compose([transforms.Resize((img_size, img_size), antialias=True), *grey,
                               transforms.ToTensor(), transforms.Normalize(*normalization(name))])


def _image_folder(root: Path, split: str, transform) -> ImageFolder:
    folder = root / split
    if not folder.is_dir():
        raise UserError(f"--dataset ImageFolder expects {folder}/ with one folder per class "
                        f"(and {root / ('val' if split == 'train' else 'train')}/ beside it)")
    try:
        problem = tree_problem(str(folder))
        if problem:
            raise UserError(problem)
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
                   train: bool = True) -> Datasets:
    """The training split (unless ``train=False``) and the validation/test split; CIFAR-10
    and Fashion-MNIST downloaded if they are not there and ``download`` (one process per
    node: the caller runs it first, ``distributed.local_main_first``)."""
    root = Path(root)
    train_tf = val_tf = build_transform(img_size, name)
    if name == "FashionMNIST":
        train_set = FashionMNIST(root, True, train_tf, download) if train else None
        val_set = FashionMNIST(root, False, val_tf, download)
        return Datasets(train_set, val_set, NUM_CLASSES[name])
    if name == "CIFAR10":
        check_root(root)
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
        fake, size = torchvision.datasets.FakeData, (3, 32, 32)
        train_set = fake(FAKE_TRAIN_SIZE, size, 10, train_tf, random_offset=0) if train else None
        val_set = fake(FAKE_VAL_SIZE, size, 10, val_tf, random_offset=FAKE_TRAIN_SIZE)
        return Datasets(train_set, val_set, NUM_CLASSES[name])
    raise UserError(f"unknown --dataset {name!r}")
