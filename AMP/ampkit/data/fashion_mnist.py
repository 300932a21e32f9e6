"""Fashion-MNIST: its four idx files, read with every check torchvision's reader makes (and
the ones it asserts or skips), from a folder that holds them (Debian's
``dataset-fashion-mnist`` installs them, gzipped, in /usr/share/datasets/fashion-mnist) or
from torchvision's own layout (``<root>/FashionMNIST/raw/``), where torchvision downloads it.

A file that is truncated, not gzip where it is named so, of the wrong kind (magic number),
or whose counts disagree with its partner's, is one line naming it; nothing is half loaded.
The published split: 60,000 training and 10,000 test images, 28 x 28 grey, labels 0..9.
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Optional, Tuple

import torch
import torchvision

from ..errors import UserError

CLASSES = 10
# idx's magic numbers: 0x08 (unsigned bytes), then the number of dimensions.
IMAGES_MAGIC, LABELS_MAGIC = 0x0803, 0x0801
# Over the 60,000 training images, pixels scaled to 0..1.
MEAN, STD = (0.2860,) * 3, (0.3530,) * 3
OFFLINE = ("apt install dataset-fashion-mnist, then --dataset_root "
           "/usr/share/datasets/fashion-mnist")


def _names(train: bool) -> Tuple[str, str]:
    split = "train" if train else "t10k"
    return f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"


def _find(folder: Path, name: str) -> Optional[Path]:
    for path in (folder / name, folder / f"{name}.gz"):
        if path.is_file():
            return path
    return None


def idx_folder(root: Path) -> Optional[Path]:
    """The folder under ``root`` that holds the idx files (root itself, or torchvision's
    ``FashionMNIST/raw``); None if neither holds any. A folder with some of the four is
    refused, naming what is missing."""
    every = _names(True) + _names(False)
    for folder in (root, root / "FashionMNIST" / "raw"):
        found = [n for n in every if _find(folder, n)]
        if found and len(found) < len(every):
            missing = ", ".join(n for n in every if n not in found)
            raise UserError(f"{folder}: Fashion-MNIST's idx files are incomplete: {missing} "
                            f"missing (.gz or not). Put all four there, or: {OFFLINE}")
        if found:
            return folder
    return None


def read_idx(path: Path, magic: int) -> torch.Tensor:
    """An idx file of unsigned bytes with the given magic number, as a uint8 tensor of its
    dimensions; a UserError naming the file if it is not one, or is cut short or too long."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise UserError(f"{path}: cannot be read as "
                        f"{'gzip' if path.suffix == '.gz' else 'an idx file'} "
                        f"({str(e) or type(e).__name__})") from None
    if len(data) < 4 or int.from_bytes(data[:4], "big") != magic:
        found = f"0x{int.from_bytes(data[:4], 'big'):08x}" if len(data) >= 4 else "none"
        raise UserError(f"{path}: not an idx file of {'images' if magic == IMAGES_MAGIC else 'labels'}"
                        f" (magic number {found}, expected 0x{magic:08x})")
    ndim = magic & 0xFF
    header = 4 * (ndim + 1)
    if len(data) < header:
        raise UserError(f"{path}: truncated ({len(data)} bytes, shorter than its header)")
    shape = [int.from_bytes(data[4 * (i + 1):4 * (i + 2)], "big") for i in range(ndim)]
    expected = header + torch.Size(shape).numel()
    if len(data) != expected:
        raise UserError(f"{path}: {'truncated' if len(data) < expected else 'too long'}: "
                        f"{len(data)} bytes where its header {tuple(shape)} needs {expected}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header).view(*shape)


def load_split(root: Path, train: bool, download: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """A split as (images uint8 [N, 28, 28], labels int64 [N]), from ``root`` or, where it
    holds no idx file and ``download``, downloaded by torchvision into its own layout there."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UserError(f"--dataset_root {root} is a file, not a folder")
    folder = idx_folder(root) if root.is_dir() else None
    if folder is None and download:
        try:
            torchvision.datasets.FashionMNIST(str(root), train=train, download=True)
        except Exception as e:  # URLError, socket errors, a failed md5: one line
            # torchvision's error spans lines: the file, the mirrors tried, what each said.
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            raise UserError(f"Fashion-MNIST is not in {root} and could not be downloaded "
                            f"({reason}). Without a network: {OFFLINE}") from None
        folder = idx_folder(root)
    if folder is None:
        raise UserError(f"Fashion-MNIST is not in {root} (no idx file there or in "
                        f"{root / 'FashionMNIST' / 'raw'}). Without a network: {OFFLINE}")
    image_name, label_name = _names(train)
    images = read_idx(_find(folder, image_name), IMAGES_MAGIC)
    labels = read_idx(_find(folder, label_name), LABELS_MAGIC)
    if len(images) != len(labels):
        raise UserError(f"{folder}: {image_name} holds {len(images)} images but {label_name} "
                        f"{len(labels)} labels")
    if labels.numel() and int(labels.max()) >= CLASSES:
        first = int((labels >= CLASSES).nonzero()[0])
        raise UserError(f"{_find(folder, label_name)}: label {int(labels[first])} of image "
                        f"{first} is not a class index 0..{CLASSES - 1}")
    return images, labels.long()


class FashionMNIST(torchvision.datasets.FashionMNIST):
    """torchvision's FashionMNIST (its PIL images, "L" mode, and transform) over the split
    :func:`load_split` read and checked."""

    def __init__(self, root: Path, train: bool, transform, download: bool) -> None:
        self.checked = load_split(root, train, download)
        super().__init__(str(root), train=train, transform=transform)

    def _check_exists(self) -> bool:
        return True  # load_split found and checked the files

    def _load_data(self):
        return self.checked
