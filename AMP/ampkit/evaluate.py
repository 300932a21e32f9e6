"""The eval driver every eval script shares: ``Evaluation(args, device)``, ``count``,
``report``.

``Evaluation`` takes the script's flags and device (a one-process script's own; eval_DDP's
``cuda:LOCAL_RANK`` in the process group it joined), loads the checkpoint on the CPU, builds
the test split -- by default the data set, root and image size the checkpoint was trained
with -- and the checkpoint's network with its weights, on the device. The script decides how
the model runs (bare, ``nn.DataParallel``) and sums a group's counts; ``count`` counts this
process's shard, ``report`` prints the one result line. In a process group every rank makes
each call, together.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch import nn

from .checkpoint import files as checkpoint_files
from .data import build_loaders, unreadable_line
from .device import resolve_amp_dtype, set_cuda_math
from .distributed import barrier, gather_from_ranks, local_main_first, this_process
from .engine import count_correct
from .errors import UserError
from .flags import DATA_DIR
from .models import DEFAULT_ARCH, autocast_replicas, build_model, check_arch_flags


class Evaluation:
    """Set-up, counting and the result line of one eval script (see the module docstring),
    from its flags (``args``: parse_eval_args'): the checkpoint, a file or a folder whose
    newest last.pth is evaluated; the data set, its root, the image size and the network
    (None: the checkpoint's own); ``--autocast`` in ``--amp_dtype`` (None: the device's
    default), on every GPU DataParallel replicates to with ``data_parallel``."""

    def __init__(self, args, device: torch.device, *, data_parallel: bool = False) -> None:
        self.name, self.info = args.variant, this_process(device)
        set_cuda_math(args.tf32, device)
        self.amp_dtype = (resolve_amp_dtype(args.amp_dtype, device, data_parallel=data_parallel)
                          if args.autocast else None)
        self.path = checkpoint_files.resolve(args.checkpoint)
        # Onto the CPU: the weights reach the device with the model they are loaded into.
        state = checkpoint_files.load(self.path, map_location="cpu")
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
        # The data set may be downloaded: by one process per node, the others after it.
        with local_main_first(self.info):
            self.data = build_loaders(self.dataset, root, self.img_size, args.batch_size,
                                      self.info, loader=args.loader,
                                      num_workers=args.num_workers,
                                      channels_last=args.channels_last, train=False,
                                      skip_bad=args.skip_bad_images)
        model = build_model(self.arch, self.data.num_classes)
        checkpoint_files.load_weights(model, state, self.path)
        del state
        if self.amp_dtype is not None:
            # The forward re-enters autocast with this dtype itself, for DataParallel's replica
            # threads, which do not inherit the caller's dtype.
            model = autocast_replicas(model, self.amp_dtype)
        memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
        self.model = model.to(device, memory_format=memory_format)
        self.autocast = (torch.autocast(device.type, dtype=self.amp_dtype)
                         if self.amp_dtype else contextlib.nullcontext())

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

    def count(self, model: nn.Module) -> torch.Tensor:
        """``tensor([correct, seen])`` on the device, over this process's shard of the test
        split (in a group, every world_size-th image from its rank's on: disjoint shards
        that cover each image once; alone, all of them). Summing them is the script's."""
        return count_correct(model, self.data.val, self.info, self.autocast, desc=self.name)

    def report(self, correct: int, total: int) -> float:
        """Print the result line (global rank 0); the accuracy. Then all ranks wait for each
        other, so that none leaves the group while a peer still uses it."""
        if total == 0:
            raise UserError(f"{self.name}: no readable test image to evaluate")
        acc = correct / total
        unreadable = unreadable_line(gather_from_ranks(self.data.take_unreadable(), self.info),
                                     "from the test split")
        if unreadable and self.info.is_main:
            print(unreadable, flush=True)
        if self.info.is_main:
            print(f"top-1 accuracy on {self.dataset} test split ({self.img_size}px"
                  f"{', autocast ' + str(self.amp_dtype)[6:] if self.amp_dtype else ''}"
                  f"{f', {self.info.world_size} processes' if self.info.world_size > 1 else ''}"
                  f"): {correct}/{total} = {acc:.4f}", flush=True)
        barrier(self.info)
        return acc
