"""The fast input path: the whole data set as one uint8 tensor on the device.

CIFAR-10 is 150 MB as uint8: it is loaded once and kept on the training device, as
KellerJordan/cifar10-airbench does. A batch is an index into it, and what the classic path
does per image in PIL on the host is done on the device for the whole batch:

    images_u8[indices] -> flip (train) -> resize (bilinear, antialias) -> float, normalise

No DataLoader, no workers, no copy and no host sync per step: the epoch's order goes to the
device in one asynchronous copy, and its flips are the sampler's, drawn from (seed, epoch,
rank), so a resumed epoch gets the same ones. On the CPU the resize runs on uint8
(it rounds like PIL: the classic path's pixels to one uint8 step), on CUDA in float32. The
order is the classic path's sampler's, so both paths agree sample for sample. CIFAR10,
FashionMNIST (its grey channel as three) and FakeData take this path; ImageFolder stays on
the classic one.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import Sampler, TensorDataset

from ..device import pinned
from ..distributed import DistInfo
from ..errors import UserError
from .datasets import (FAKE_TRAIN_SIZE, FAKE_VAL_SIZE, NUM_CLASSES, check_root, cifar10,
                       load_fashion_mnist, normalization)
from .order import IndexSampler, ResumableSampler, balanced_subset, one_process_sampler


def _fake_uint8(train: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    # Through torchvision's own FakeData (the sizes and offsets of build_datasets), so
    # both paths see the very same images: its float->uint8 conversion is kept as is.
    size, offset = (FAKE_TRAIN_SIZE, 0) if train else (FAKE_VAL_SIZE, FAKE_TRAIN_SIZE)
    fake = torchvision.datasets.FakeData(size, (3, 32, 32), 10, random_offset=offset)
    pairs = [fake[i] for i in range(size)]
    images = np.stack([np.asarray(img.convert("RGB")) for img, _ in pairs])  # N, H, W, C
    labels = torch.tensor([label for _, label in pairs], dtype=torch.int64)
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), labels


def load_uint8(name: str, root: Path, info: DistInfo, train: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """A whole split as (images uint8 [N, 3, H, W] contiguous, labels int64 [N]) on the CPU."""
    if name == "CIFAR10":
        root = Path(root)
        check_root(root)
        # Only local rank 0 downloads; the caller runs it first (local_main_first).
        ds = cifar10(root, train, None, download=info.is_local_main)
        # ds.data is an N,H,W,C view of the N,C,H,W array read from the batch files:
        # permuting back gives a contiguous tensor without a copy.
        images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        return images, torch.tensor(ds.targets, dtype=torch.int64)
    if name == "FashionMNIST":
        images, labels = load_fashion_mnist(root, train, download=info.is_local_main)
        return images.unsqueeze(1).expand(-1, 3, -1, -1).contiguous(), labels
    if name == "FakeData":
        return _fake_uint8(train)
    if name == "ImageFolder":
        raise UserError("--dataset ImageFolder is read from disk by the classic DataLoader "
                        "input path (--loader classic or auto); it is not held in memory")
    raise UserError(f"unknown --dataset {name!r}")


class DeviceLoader:
    """Batches (images, targets) already on ``device``, from a uint8 tensor held there.

    images: float32 [B, 3, img_size, img_size], normalised with ``normalization``'s mean
    and std (channels_last memory format if asked); targets: int64 [B].
    """

    def __init__(self, images_u8: torch.Tensor, labels: torch.Tensor, *, batch_size: int,
                 img_size: int, device: torch.device, train: bool, info: DistInfo,
                 sampler: Optional[Sampler[int]] = None, seed: int = 0,
                 channels_last: bool = False,
                 normalization: Tuple[tuple, tuple] = normalization("CIFAR10")) -> None:
        """``sampler``: the order (training: the script's DistributedSampler; None: one
        process's, seeded by ``seed``; validation: this rank's shard)."""
        if images_u8.dtype != torch.uint8 or images_u8.dim() != 4 or images_u8.shape[1] != 3:
            raise ValueError(f"images_u8 must be uint8 [N, 3, H, W], got {images_u8.dtype} "
                             f"{tuple(images_u8.shape)}")
        if labels.shape != (images_u8.shape[0],):
            raise ValueError(f"labels must be [N={images_u8.shape[0]}], got {tuple(labels.shape)}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.device = torch.device(device)
        # One copy to the device for the whole run.
        self.images = images_u8.to(self.device).contiguous()
        self.labels = labels.to(self.device, torch.int64)
        self.batch_size, self.img_size = batch_size, img_size
        self.train = train
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.image_shape = (3, img_size, img_size)
        self.dataset_size = n = images_u8.shape[0]
        if sampler is None:
            sampler = (one_process_sampler(n, seed) if train
                       else IndexSampler.shard(n, info.rank, info.world_size))
        self.sampler = ResumableSampler(sampler) if train else sampler
        # Normalize((x/255 - mean) / std) as x * scale + bias on the 0..255 values.
        mean, std = (torch.tensor(v, dtype=torch.float32).view(1, 3, 1, 1) * 255
                     for v in normalization)
        self._scale = (1 / std).to(self.device)
        self._bias = (-mean / std).to(self.device)
        # The CPU has a fast uint8 antialiased bilinear kernel (channels_last) that also
        # rounds to uint8 like PIL; CUDA's antialiased kernel takes floating types only.
        self.resize_uint8 = self.device.type == "cpu"

    def __len__(self) -> int:
        """The batches of this rank's whole epoch."""
        n = self.sampler.num_samples if self.train else len(self.sampler)
        return math.ceil(n / self.batch_size)

    def _epoch_indices(self, first: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        # The epoch's order from sample ``first`` on, and the training sampler's flips, from
        # (seed, epoch, rank) on the host and cut there: the classic path's, on any device,
        # and in a resumed epoch exactly those of the interrupted one.
        host = [torch.tensor(list(self.sampler)[first:], dtype=torch.int64)]
        # [N, 1, 1, 1], so that a batch's slice of the flips broadcasts over whole images.
        if self.train:
            host.append(self.sampler.flips(first).view(-1, 1, 1, 1))
        if pinned(self.device):
            # Pinned, so the copy is asynchronous: not even the epoch start waits for the GPU.
            host = [t.pin_memory() for t in host]
        # Asynchronous only from pinned memory: from pageable memory a non-blocking copy may
        # read it after it is freed (MPS).
        on_device = [t.to(self.device, non_blocking=t.is_pinned()) for t in host]
        return on_device[0], (on_device[1] if self.train else None)

    def transform(self, batch_u8: torch.Tensor, flip: Optional[torch.Tensor] = None) -> torch.Tensor:
        """uint8 [B, 3, H, W] -> normalised float32 [B, 3, img_size, img_size] on the device;
        ``flip``: bool [B, 1, 1, 1], the images mirrored."""
        if flip is not None:
            # Flip before resizing: cheaper at the source size, and the same image, since a
            # bilinear resize of a mirrored image is the mirrored resize.
            batch_u8 = torch.where(flip, batch_u8.flip(3), batch_u8)
        size = (self.img_size, self.img_size)
        fmt = self.memory_format
        if tuple(batch_u8.shape[-2:]) != size and self.resize_uint8:
            batch_u8 = F.interpolate(batch_u8.contiguous(memory_format=torch.channels_last),
                                     size=size, mode="bilinear", antialias=True,
                                     align_corners=False)
        elif tuple(batch_u8.shape[-2:]) != size:
            # Normalising first is exact (bilinear weights sum to 1) and touches ~50x fewer
            # values than normalising the resized batch.
            small = batch_u8.float().mul_(self._scale).add_(self._bias)
            return F.interpolate(small, size=size, mode="bilinear", antialias=True,
                                 align_corners=False).contiguous(memory_format=fmt)
        # One pass converts to float in the wanted memory format (a permuting copy when the
        # CPU kernel left channels_last), then two cheap in-place passes normalise; this beats
        # addcmul on uint8, which takes a slow mixed-dtype path on the CPU.
        return batch_u8.to(torch.float32, memory_format=fmt).mul_(self._scale).add_(self._bias)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        return self.batches(0)

    def batches(self, start: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches from batch ``start`` on (a resumed epoch's rest; 0: all)."""
        indices, flips = self._epoch_indices(start * self.batch_size)
        if not len(indices):
            # Nothing left (a stop in the epoch's last step; an empty shard): no batch, where
            # split() would give one of 0 images.
            return iter(())
        # The epoch cut into its batches at once: one op an epoch, not two slices a batch.
        batches = indices.split(self.batch_size)
        flipped = flips.split(self.batch_size) if flips is not None else [None] * len(batches)
        return ((self.transform(self.images.index_select(0, idx), flip),
                 self.labels.index_select(0, idx)) for idx, flip in zip(batches, flipped))


class DeviceSplit(TensorDataset):
    """A training split held on the device as uint8 (images, labels): what a training
    sampler draws from, and ``loader(sampler)`` its batches in that sampler's order."""

    def __init__(self, images_u8: torch.Tensor, labels: torch.Tensor, **loader_kw) -> None:
        device = loader_kw["device"]
        super().__init__(images_u8.to(device).contiguous(), labels.to(device, torch.int64))
        self.loader_kw = loader_kw

    def loader(self, sampler: Optional[Sampler[int]] = None) -> DeviceLoader:
        return DeviceLoader(*self.tensors, train=True, sampler=sampler, **self.loader_kw)


def fast_loaders(name: str, root: Path, img_size: int, batch_size: int, info: DistInfo,
                 channels_last: bool = False, train: bool = True,
                 train_subset: Optional[int] = None
                 ) -> Tuple[Optional[DeviceSplit], DeviceLoader, int]:
    """(the training split -- ``train_subset`` images of it, balanced -- or None with
    ``train=False``; the validation loader; the number of classes)."""
    kw = dict(batch_size=batch_size, img_size=img_size, device=info.device, info=info,
              channels_last=channels_last, normalization=normalization(name))
    train_set = None
    if train:
        images, labels = load_uint8(name, root, info, train=True)
        if train_subset is not None:
            kept = torch.tensor(balanced_subset(labels, train_subset, NUM_CLASSES[name]))
            images, labels = images[kept], labels[kept]
        train_set = DeviceSplit(images, labels, **kw)
    images, labels = load_uint8(name, root, info, train=False)
    return train_set, DeviceLoader(images, labels, train=False, **kw), NUM_CLASSES[name]
