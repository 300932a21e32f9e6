"""A tiny Fashion-MNIST in its own idx format, for the tests: ``write_fashion_mnist`` writes the
four files (gzipped, as the Debian package installs them, or plain in torchvision's
``FashionMNIST/raw/``). The class of an image is its brightness band, so a network can learn it."""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

NAMES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def idx_bytes(array: np.ndarray) -> bytes:
    """``array`` (uint8) as an idx file: magic 0x08 + its number of dimensions, each size."""
    header = struct.pack(">I", 0x0800 + array.ndim) + b"".join(struct.pack(">I", n)
                                                                 for n in array.shape)
    return header + array.astype(np.uint8).tobytes()


def fashion_arrays(n: int, seed: int):
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 10
    rng.shuffle(labels)
    base = (labels * 25 + 10)[:, None, None]
    images = np.clip(base + rng.integers(-8, 9, size=(n, 28, 28)), 0, 255).astype(np.uint8)
    return images, labels.astype(np.uint8)


def write_fashion_mnist(root: Path, n_train: int = 40, n_test: int = 23, *,
                        layout: str = "debian") -> Path:
    """The four files under ``root`` (``layout="debian"``: gzipped, in ``root`` itself;
    ``"torchvision"``: plain, in ``root/FashionMNIST/raw``); returns ``root``."""
    folder = root if layout == "debian" else root / "FashionMNIST" / "raw"
    folder.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
        for name, array in zip(NAMES[split], fashion_arrays(n, seed)):
            data = idx_bytes(array)
            if layout == "debian":
                (folder / f"{name}.gz").write_bytes(gzip.compress(data, mtime=0))
            else:
                (folder / name).write_bytes(data)
    return root
