"""Input-pipeline throughput: images/s delivered to the device, for three input paths.

- ``article``: what the article does — torchvision's CIFAR10 with ``Resize(img_size)`` and
  ``ToTensor()`` in PIL, one image at a time, a DataLoader with ``num_workers=0``.
- ``classic``: ampkit's DataLoader path (``ampkit.data``: Resize, flip, ToTensor,
  Normalize in PIL; ``DistributedSampler`` order; ``--num_workers`` workers,
  ``pin_memory`` and non-blocking copies on CUDA).
- ``fast``: ampkit's device path (``ampkit.fastdata``): the uint8 set held on the
  device, resized, flipped and normalised there in batch.

Each measurement iterates one epoch of the training split, moves every batch to the
device, skips the first ``warmup`` batches (worker start-up, first-call allocations)
and, on CUDA, synchronises before reading the clock. Without CIFAR-10 under ``root``,
``n`` generated images in CIFAR-10's on-disk format are written to a temporary folder
(the pipelines' cost does not depend on the pixel values).

Command line: ``python bench/input_pipeline.py --help``; from Python:
``measure_input_pipeline("fast", img_size=227, batch_size=64)``.
"""
from __future__ import annotations

import contextlib
import pickle
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from .distributed import DistInfo, synchronize

KINDS = ("article", "classic", "fast")
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

    def make(n: int) -> tuple[np.ndarray, list]:
        labels = np.arange(n) % num_classes
        rng.shuffle(labels)
        if not learnable:
            return rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8), labels.tolist()
        noise = rng.integers(-40, 41, (n, 3, 32, 32), dtype=np.int16)
        images = np.clip(palette[labels][:, :, None, None] + noise, 0, 255).astype(np.uint8)
        return images.reshape(n, -1), labels.tolist()

    data, labels = make(n_train)
    for k, (part, lab) in enumerate(zip(np.array_split(data, 5), np.array_split(np.array(labels), 5))):
        with open(folder / f"data_batch_{k + 1}", "wb") as f:
            pickle.dump({"batch_label": f"training batch {k + 1} of 5", "data": part,
                         "labels": lab.tolist()}, f)
    data, labels = make(n_test)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"batch_label": "testing batch 1 of 1", "data": data, "labels": labels}, f)
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



def _build(kind: str, root: Path, img_size: int, batch_size: int, num_workers: int,
           info: DistInfo, channels_last: bool):
    if kind == "article":
        from torch.utils.data import DataLoader
        from torchvision import transforms

        from .data import CIFAR10
        # torchvision's CIFAR10 apart from its md5 check at construction (generated data
        # would fail it); images are read and transformed exactly as torchvision does.
        tf = transforms.Compose([transforms.Resize(img_size), transforms.ToTensor()])
        dataset = CIFAR10(str(root), train=True, transform=tf, download=False)
        return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=0)
    if kind == "classic":
        from .data import build_datasets, train_loader
        data = build_datasets("CIFAR10", root, img_size, info)
        loader = train_loader(data.train, batch_size, num_workers, info, seed=0)
        return loader
    if kind == "fast":
        from .fastdata import fast_loaders
        loader, _, _ = fast_loaders("CIFAR10", root, img_size, batch_size, info,
                                    channels_last=channels_last)
        return loader
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _batches(loader) -> Iterator:
    """The loader's batches, epoch after epoch (a new permutation each epoch)."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the training split gives no batch")
        epoch += 1


def measure_input_pipeline(kind: str, *, root: Optional[Path] = None, img_size: int = 227,
                           batch_size: int = 64, num_workers: int = 0,
                           device: Optional[torch.device] = None, n: int = 2048,
                           warmup: int = 2, max_batches: Optional[int] = None,
                           channels_last: bool = False) -> float:
    """Images per second that the ``kind`` input path delivers to ``device``.

    ``root``: a folder with CIFAR-10 (``cifar-10-batches-py/``); without one, ``n``
    generated images are used. ``device``: default CUDA when available, else the CPU.
    ``warmup`` batches are not timed; then ``max_batches`` batches are (default: one
    epoch's worth), over as many epochs as that takes.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    info = DistInfo(device=device)
    with cifar_root(root, n) as data_root:
        loader = _build(kind, data_root, img_size, batch_size, num_workers, info, channels_last)
        batches = _batches(loader)
        for _ in range(warmup):  # worker start-up, first allocations: not counted
            next(batches)[0].to(device, non_blocking=True)
        synchronize(device)
        t0 = time.perf_counter()
        images = 0
        for _ in range(max_batches if max_batches is not None else len(loader)):
            x, y = next(batches)
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            images += x.shape[0]
        synchronize(device)
        seconds = time.perf_counter() - t0
        batches.close()
        del batches, loader  # stops persistent workers before the data folder goes
    return images / seconds
