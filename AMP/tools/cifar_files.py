"""Data sets in CIFAR-10's on-disk format (``cifar-10-batches-py/``), written for tests
and benchmarks: torchvision's ``CIFAR10`` and ampkit's fast path read them as the real one."""
from __future__ import annotations

import contextlib
import pickle
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                 "ship", "truck")


def has_cifar10(root: Optional[Path]) -> bool:
    if root is None:
        return False
    folder = Path(root) / CIFAR_FOLDER
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    return all((folder / n).is_file() for n in names)


def write_cifar10(root: Path, n_train: int, n_test: int, *, seed: int = 0,
                  learnable: bool = False, num_classes: int = 10) -> Path:
    """Write a CIFAR-10-format data set (``<root>/cifar-10-batches-py/``) that torchvision reads.

    ``learnable=False``: uniform random pixels. ``learnable=True``: each class is a
    well-separated colour plus noise, so a small network separates the classes within
    a few steps (and flips do not hide the cue). Labels cycle through ``num_classes``
    (at most 10) classes, shuffled.
    """
    rng = np.random.default_rng(seed)
    folder = Path(root) / CIFAR_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    palette = np.array([(230, 30, 30), (30, 230, 30), (30, 30, 230), (230, 230, 30),
                        (230, 30, 230), (30, 230, 230), (240, 240, 240), (20, 20, 20),
                        (128, 128, 30), (30, 128, 128)], dtype=np.int16)

    def make(n: int) -> tuple:
        labels = np.arange(n) % num_classes
        rng.shuffle(labels)
        if not learnable:
            return rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8), labels
        noise = rng.integers(-40, 41, (n, 3, 32, 32), dtype=np.int16)
        images = np.clip(palette[labels][:, :, None, None] + noise, 0, 255).astype(np.uint8)
        return images.reshape(n, -1), labels

    data, labels = make(n_train)
    for k, (part, lab) in enumerate(zip(np.array_split(data, 5), np.array_split(labels, 5))):
        with open(folder / f"data_batch_{k + 1}", "wb") as f:
            pickle.dump({"batch_label": f"training batch {k + 1} of 5", "data": part,
                         "labels": lab.tolist()}, f)
    data, labels = make(n_test)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"batch_label": "testing batch 1 of 1", "data": data,
                     "labels": labels.tolist()}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": list(CIFAR_CLASSES), "num_cases_per_batch": n_train // 5,
                     "num_vis": 3072}, f)
    return Path(root)


@contextlib.contextmanager
def cifar_root(root: Optional[Path], n: int) -> Iterator[Path]:
    """``root`` if it holds CIFAR-10, else a temporary folder with ``n`` generated images."""
    if has_cifar10(root):
        yield Path(root)
        return
    with tempfile.TemporaryDirectory(prefix="ampkit-bench-") as tmp:
        yield write_cifar10(Path(tmp), n, max(n // 8, 64))
