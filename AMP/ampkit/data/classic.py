"""The classic input path: torchvision's DataLoader with PIL transforms, workers (which
ignore a scheduler's stop signals: only the main process decides a stop, ``ampkit.stop``)
and pinned memory, for any data set; ImageFolder takes it.

An unreadable image is a one-line error naming it; with ``--skip_bad_images`` validation
leaves it out and lists it, and in training the next readable image takes its place
(:class:`NextReadable`), so that every rank runs as many full batches.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from typing import Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ..device import pinned
from ..distributed import DistInfo
from ..errors import RankError, UserError
from ..stop import SIGNALS
from .image_folder import Unreadable
from .order import IndexSampler, ResumableSampler, one_process_sampler


class BadImage(RankError):
    """An image file that cannot be read: corrupt, truncated, not an image, no permission."""


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader's ``worker_init_fn``: the worker ignores the stop signals from anyone but
    its main process (torch's worker dies of a SIGTERM, and its death would raise in the main
    process mid-step or mid-save). A SIGTERM from the main process still ends it: that is
    how ``multiprocessing`` stops daemonic workers as their process exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # SIGTERM stays held back in every thread (held_stop_signals; threads started later
    # inherit it), and one thread takes each one, with its sender.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_sigterm_from, args=(os.getppid(),), daemon=True,
                     name="stop-signal-filter").start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGUSR1})


def _exit_on_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            # _exit, no cleanup: what torch's own worker handler does on its parent's SIGTERM.
            os._exit(0)


@contextlib.contextmanager
def held_stop_signals() -> Iterator[None]:
    """The stop signals held back in this thread while it starts DataLoader workers: a
    forked worker inherits the mask, so none can die of one before
    :func:`ignore_stop_signals` runs in it; this process gets its own afterwards."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def printable(text: str) -> str:
    """``text`` with what a terminal would not show as it is escaped (a line break, a byte
    that is not UTF-8): a file's name may hold one, and the line naming it must stay one."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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


class CheckedLoader:
    """A DataLoader whose batches arrive on ``device`` (the images in ``memory_format``), and
    whose unreadable images (see :class:`.image_folder.ImageFolder`) stop the run with a one-line
    error naming the first, or with ``skip`` are left out of their batch and listed in
    ``unreadable`` (emptied by its reader, once per epoch)."""

    def __init__(self, loader: DataLoader, skip: bool, device: torch.device,
                 memory_format: torch.memory_format, image_shape: Tuple[int, ...]) -> None:
        self.loader, self.skip, self.device = loader, skip, device
        self.memory_format, self.image_shape = memory_format, image_shape
        self.unreadable: List[Unreadable] = []

    @property
    def sampler(self) -> Sampler:
        return self.loader.sampler

    def __len__(self) -> int:
        """The batches of this rank's whole epoch."""
        # A resumable training sampler's len() is a resumed epoch's rest; num_samples is the
        # whole epoch.
        n = getattr(self.sampler, "num_samples", len(self.sampler))
        return math.ceil(n / self.loader.batch_size)

    def __iter__(self) -> Iterator:
        return self.batches(0)

    def batches(self, start: int) -> Iterator:
        """The epoch's batches from batch ``start`` on (a resumed epoch's rest; 0: all)."""
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.start_index = start * self.loader.batch_size
        # iter() is where the workers are forked (the first time): the signals are held
        # around it.
        with held_stop_signals():
            batches = iter(self.loader)
        for images, targets, bad in batches:
            bad = [Unreadable(printable(u.path), u.reason) for u in bad]
            if bad and not self.skip:
                raise BadImage(f"{bad[0].path}: unreadable image ({bad[0].reason}); replace or "
                               "delete it, or pass --skip_bad_images to go on without it")
            self.unreadable += bad
            if images is not None:
                # Asynchronous only from pinned memory (the loader pins on CUDA and XPU): from
                # pageable memory a non-blocking copy may read it after it is freed (MPS).
                yield (images.to(self.device, non_blocking=images.is_pinned(),
                                 memory_format=self.memory_format),
                       targets.to(self.device, non_blocking=targets.is_pinned()))


def _loader(dataset: Dataset, sampler: Sampler, *, batch_size: int, num_workers: int,
            device: torch.device, memory_format: torch.memory_format, img_size: int,
            skip_bad: bool, collate=collate_readable) -> CheckedLoader:
    # The workers ignore the stop signals: only the main process decides to stop
    # (ampkit/stop.py). The loader's own generator draws the workers' seeds, not the
    # random stream that dropout draws from (a resumed run goes on with that stream).
    return CheckedLoader(DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
        pin_memory=pinned(device), persistent_workers=num_workers > 0, drop_last=False,
        collate_fn=collate, worker_init_fn=ignore_stop_signals,
        generator=torch.Generator()), skip_bad, device, memory_format, (3, img_size, img_size))


def default_workers(num_workers: Optional[int], device: torch.device) -> int:
    return num_workers if num_workers is not None else (0 if device.type == "cpu" else 4)


def train_dataloader(dataset: Dataset, sampler: Optional[Sampler[int]] = None, *,
                     batch_size: int, num_workers: int = 0,
                     device: torch.device = torch.device("cpu"),
                     memory_format: torch.memory_format = torch.contiguous_format,
                     img_size: int = 0, seed: int = 0, skip_bad: bool = False) -> CheckedLoader:
    """Batches in ``sampler``'s order (None: one process's, seeded by ``seed``) with its
    flips, always full: an unreadable image is replaced by the next readable one
    (:class:`NextReadable`)."""
    sampler = ResumableSampler(sampler or one_process_sampler(len(dataset), seed), pairs=True)
    return _loader(NextReadable(dataset), sampler, batch_size=batch_size,
                   num_workers=num_workers, device=device, memory_format=memory_format,
                   img_size=img_size, skip_bad=skip_bad, collate=collate_next_readable)


def eval_dataloader(dataset: Dataset, info: DistInfo, *, batch_size: int, num_workers: int = 0,
                memory_format: torch.memory_format = torch.contiguous_format, img_size: int = 0,
                skip_bad: bool = False) -> CheckedLoader:
    """This rank's shard of ``dataset`` (every world_size-th image), in order."""
    return _loader(dataset, IndexSampler.shard(len(dataset), info.rank, info.world_size),
                   batch_size=batch_size, num_workers=num_workers, device=info.device,
                   memory_format=memory_format, img_size=img_size, skip_bad=skip_bad)
