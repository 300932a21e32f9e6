"""The eval driver every eval script shares: ``Evaluation(args, device)``, ``count_correct``,
``report``.

``Evaluation`` takes the script's flags and device (a one-process script's own; eval_DDP's
``cuda:LOCAL_RANK`` in the process group it joined), loads the checkpoint on the CPU,
builds the test split -- by default the data set, root and image size the checkpoint was
trained with -- and the checkpoint's network (``--arch``) with its weights, on the device.
The script decides how the model runs (bare, ``nn.DataParallel``) and which test images
this process counts (all of them, or its shard); ``count_correct`` counts, ``report``
prints the one result line.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from .distributed import barrier, gather_from_ranks, local_main_first, this_process
from .machinery.process import UserError, single_process_device
from .engine import count_correct
from .machinery import checkpoint_files
from .machinery.archs import DEFAULT_ARCH, check_arch_flags
from .machinery.config import DATA_DIR
from .machinery.data import build_loaders, take_skipped
from .models import autocast_replicas, build_model
from .precision import resolve_amp_dtype


class Evaluation:
    """Set-up, counting and the result line of one eval script (see the module docstring)."""

    def __init__(self, args, device: Optional[torch.device] = None) -> None:
        self.name, self.args = args.variant, args
        self.info = this_process(device or single_process_device(args.cuda))
        self._set_up()

    def _set_up(self) -> None:
        args, device = self.args, self.info.device
        self.path = checkpoint_files.resolve(args.checkpoint)
        state = checkpoint_files.load(self.path, map_location="cpu")  # to the device with the model
        trained = state.get("args") or {}
        self.dataset = args.dataset or trained.get("dataset") or "CIFAR10"
        root = Path(args.dataset_root or trained.get("dataset_root") or DATA_DIR)
        self.img_size = args.img_size or trained.get("img_size") or 227
        self.arch = state.get("arch") or DEFAULT_ARCH
        if args.arch not in (None, self.arch):
            raise UserError(f"--arch {args.arch}: {self.path} holds a {self.arch} (leave --arch "
                            "out: the eval scripts rebuild the checkpoint's network)")
        check_arch_flags(self.arch, self.img_size)
        self._say_what_it_was_trained_on(trained, root)
        with local_main_first(self.info):  # a download: one process per node, the others after
            data = build_loaders(self.dataset, root, self.img_size, args.batch_size, self.info,
                                 loader=args.loader, num_workers=args.num_workers,
                                 channels_last=args.channels_last, train=False,
                                 skip_bad=args.skip_bad_images)
        self.data = data
        self.loader, self.test_size = data.val, data.val_size
        self.autocast_dtype = (resolve_amp_dtype(args.amp_dtype, device) if args.autocast
                               else None)
        model = build_model(self.arch, data.num_classes)
        checkpoint_files.load_weights(model, state, self.path)
        del state
        if self.autocast_dtype is not None:
            # The forward re-enters autocast with this dtype itself, for DataParallel's replica
            # threads, which do not inherit the caller's dtype.
            model = autocast_replicas(model, self.autocast_dtype)
        self.input_format = torch.channels_last if args.channels_last else torch.contiguous_format
        self.model = model.to(device, memory_format=self.input_format)
        self.autocast = (torch.autocast(device.type, dtype=self.autocast_dtype)
                         if self.autocast_dtype else contextlib.nullcontext())

    def _say_what_it_was_trained_on(self, trained: dict, root: Path) -> None:
        """The checkpoint, the data it was trained on, and one warning line if it differs."""
        if not self.info.is_main:
            return
        if not trained:
            print(f"checkpoint: {self.path}", flush=True)
            return
        then = (trained.get("dataset"), trained.get("dataset_root"), trained.get("img_size"))
        print(f"checkpoint: {self.path} ({self.arch}, trained on {then[0]} in {then[1]} at "
              f"{then[2]}px)",
              flush=True)
        same_root = then[1] is not None and Path(then[1]).resolve() == root.resolve()
        if then[0] != self.dataset or then[2] != self.img_size or \
                (not same_root and self.dataset != "FakeData"):
            print(f"warning: evaluating on {self.dataset} in {root} at {self.img_size}px, not "
                  "the data set this checkpoint was trained on", file=sys.stderr, flush=True)

    @property
    def device(self) -> torch.device:
        return self.info.device

    def count_correct(self, model: nn.Module, indices: Sequence[int]) -> torch.Tensor:
        """``tensor([correct, seen])`` on the device, over the test images ``indices``."""
        self.loader.sampler.indices = indices
        return count_correct(model, self.loader, self.info, self.autocast, desc=self.name,
                             input_format=self.input_format,
                             image_shape=(3, self.img_size, self.img_size))

    def report(self, correct: int, total: int) -> float:
        """Print the result line (global rank 0); the accuracy. Then all ranks wait for each
        other, so that none leaves the group while a peer still uses it."""
        if total == 0:
            raise UserError(f"{self.name}: no readable test image to evaluate")
        acc = correct / total
        skipped = gather_from_ranks(take_skipped(self.data.val), self.info)
        if skipped and self.info.is_main:
            print(f"skipped {len(skipped)} unreadable image(s) (--skip_bad_images): "
                  + "; ".join(str(u) for u in skipped[:5]), flush=True)
        if self.info.is_main:
            print(f"top-1 accuracy on {self.dataset} test split ({self.img_size}px"
                  f"{', autocast ' + str(self.autocast_dtype)[6:] if self.autocast_dtype else ''}"
                  f"{f', {self.info.world_size} processes' if self.info.world_size > 1 else ''}"
                  f"): {correct}/{total} = {acc:.4f}", flush=True)
        barrier(self.info)
        return acc
