"""Images per second that an input path delivers to the device: ``benchmark.py --pipeline``.

One epoch after another, the first ``warmup`` batches not timed:

- ``article``: torchvision's CIFAR10 with ``Resize(img_size)`` + ``ToTensor()`` in PIL,
  ``num_workers=0``, as the article does;
- ``classic``: ampkit's DataLoader path (:mod:`ampkit.data.classic`);
- ``fast``: ampkit's device path (:mod:`ampkit.data.on_device`).

Without CIFAR-10 under ``root``, generated images in CIFAR-10's on-disk format are used
(:mod:`tools.cifar_files`; the pipelines' cost does not depend on the pixel values).
``dataset="FashionMNIST"`` reads Fashion-MNIST's idx files from ``root`` instead (the
article's path then is torchvision's FashionMNIST class, its grey made three channels).
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils.data import DataLoader
from torchvision import transforms

from ampkit.data.classic import train_dataloader
from ampkit.data.datasets import CIFAR10, FashionMNIST, build_datasets
from ampkit.data.on_device import fast_loaders
from ampkit.device import synchronize
from ampkit.distributed import DistInfo

from .cifar_files import cifar_root, has_cifar10

KINDS = ("article", "classic", "fast")


@dataclass
class PipelineResult:
    # One of KINDS.
    path: str
    # "CIFAR10 (generated, N)" where the folder lacked CIFAR-10: N images in its format.
    dataset: str
    img_size: int
    batch_size: int
    num_workers: int
    device: str
    # The best of ``repeat`` measurements: noise only ever slows a path down.
    images_per_s: Optional[float] = None
    # Timed batches, after the warm-up ones.
    batches: int = 0
    status: str = "ok"
    reason: str = ""

    def as_dict(self) -> Dict:
        return asdict(self)


def _pipeline(kind: str, root: Path, img_size: int, batch_size: int, num_workers: int,
              info: DistInfo, channels_last: bool, dataset: str = "CIFAR10"):
    if kind == "article":
        # torchvision's class apart from its checks at construction (generated data would
        # fail CIFAR10's md5); images are read and transformed exactly as torchvision does.
        grey = [transforms.Grayscale(3)] if dataset == "FashionMNIST" else []
        tf = transforms.Compose([transforms.Resize(img_size), *grey, transforms.ToTensor()])
        cls = FashionMNIST if dataset == "FashionMNIST" else CIFAR10
        data = cls(root, train=True, transform=tf, download=False)
        return DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=0)
    if kind == "classic":
        data = build_datasets(dataset, root, img_size, download=False)
        return train_dataloader(data.train, batch_size=batch_size, num_workers=num_workers,
                            device=info.device, img_size=img_size, seed=0)
    if kind == "fast":
        return fast_loaders(dataset, root, img_size, batch_size, info,
                            channels_last=channels_last)[0].loader()
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


@contextlib.contextmanager
def _ctrl_c_between_batches() -> Iterator[Callable[[], None]]:
    """Ctrl-C held until the batch in flight has arrived, then a KeyboardInterrupt (a second
    Ctrl-C: at once). One that lands while a loader worker hands its batch's shared memory
    over leaves that worker a traceback. Yields the check to make after each batch; one
    that came after the last check (while the workers shut down) is raised at the end."""
    pressed: List[int] = []

    def held(signum, frame) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(signum)

    def check() -> None:
        if pressed:
            raise KeyboardInterrupt

    # Only the main thread may set a signal handler: elsewhere Ctrl-C is left as it is.
    if threading.current_thread() is not threading.main_thread():
        yield check
        return
    previous = signal.signal(signal.SIGINT, held)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
    check()


def _data_root(dataset: str, root: Optional[Path], n: int):
    """CIFAR-10's folder (generated when ``root`` lacks it), or ``root`` as it is."""
    return cifar_root(root, n) if dataset == "CIFAR10" else contextlib.nullcontext(root)


def _endless(loader) -> Iterator:
    """The loader's batches, epoch after epoch (a new permutation each epoch)."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        # A ResumableSampler's epoch is the one of the sampler inside it.
        sampler = getattr(sampler, "sampler", sampler)
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
                           channels_last: bool = False, dataset: str = "CIFAR10") -> float:
    """Images per second that the ``kind`` input path delivers to ``device``.

    ``root``: a folder with CIFAR-10; without one, ``n`` generated images are used.
    ``warmup`` batches are not timed; then ``max_batches`` batches are (default: one
    epoch's worth), over as many epochs as that takes.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    info = DistInfo(device=device)
    with _data_root(dataset, root, n) as data_root:
        loader = _pipeline(kind, data_root, img_size, batch_size, num_workers, info,
                           channels_last, dataset)
        batches = _endless(loader)
        with _ctrl_c_between_batches() as ctrl_c:
            try:
                # Not timed: the workers' start-up and the first allocations.
                for _ in range(warmup):
                    x = next(batches)[0]
                    x.to(device, non_blocking=x.is_pinned())
                    ctrl_c()
                synchronize(device)
                t0 = time.perf_counter()
                images = 0
                for _ in range(max_batches if max_batches is not None else len(loader)):
                    x, y = next(batches)
                    images += x.to(device, non_blocking=x.is_pinned()).shape[0]
                    y.to(device, non_blocking=y.is_pinned())
                    ctrl_c()
                synchronize(device)
                seconds = time.perf_counter() - t0
            # Persistent workers are stopped before the data folder, maybe a generated one,
            # is removed from under them.
            finally:
                batches.close()
                del batches, loader
    return images / seconds


def measure_pipelines(kinds: Sequence[str], root: Optional[Path], img_size: int,
                      batch_size: int, num_workers: int, device: torch.device, *,
                      warmup: int = 2, batches: int = 10, repeat: int = 1,
                      channels_last: bool = False, dataset: str = "CIFAR10"
                      ) -> List[PipelineResult]:
    """The best images/s of ``repeat`` interleaved measurements of each path in ``kinds``,
    on the same data (``dataset`` under ``root``; CIFAR-10 missing there: generated images
    in its format). A path that fails is reported (``status="failed"``) and the others
    still run."""
    # Enough images that no epoch boundary falls inside the clock: at one, the loader's
    # prefetching starts over.
    n = max(batch_size * (warmup + batches + 1), 256)
    shown = dataset if dataset != "CIFAR10" or has_cifar10(root) else f"CIFAR10 (generated, {n})"
    results = [PipelineResult(path=k, dataset=shown, img_size=img_size, batch_size=batch_size,
                              num_workers=num_workers if k == "classic" else 0,
                              device=device.type, batches=batches) for k in kinds]
    with _data_root(dataset, root, n) as data_root:
        for _ in range(repeat):
            for res in results:
                if res.status != "ok":
                    continue
                try:
                    rate = measure_input_pipeline(
                        res.path, root=data_root, img_size=img_size, batch_size=batch_size,
                        num_workers=res.num_workers, device=device, n=n, warmup=warmup,
                        max_batches=batches, channels_last=channels_last, dataset=dataset)
                    res.images_per_s = max(res.images_per_s or 0.0, rate)
                except (RuntimeError, ValueError, OSError) as e:
                    res.status, res.images_per_s = "failed", None
                    res.reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    return results
