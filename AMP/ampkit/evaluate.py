"""Evaluation: top-1 accuracy of a checkpoint on the test split (single, DP or DDP).

The checkpoint is loaded once, onto the device; the data set, its root and the
image size default to what the checkpoint was trained with. Under DDP each rank
evaluates a disjoint shard (no padding) and the counts are summed exactly, so
every world size reports the same figure as ``eval_without``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from alexnet import alexnet

from . import checkpoint as ckpt_io
from .config import DATA_DIR, parse_eval_args
from .data import build_loaders
from .distributed import DistInfo, cleanup, setup
from .engine import evaluate
from .errors import report_user_errors
from .precision import autocast_factory, resolve_amp_dtype
from .variants import eval_name


def run(args, parallel: str, info: DistInfo) -> float:
    device = info.device
    path = ckpt_io.resolve(args.checkpoint)
    state = ckpt_io.load(path, map_location=device)
    trained = state.get("args") or {}
    dataset = args.dataset or trained.get("dataset") or "CIFAR10"
    root = Path(args.dataset_root or trained.get("dataset_root") or DATA_DIR)
    img_size = args.img_size or trained.get("img_size") or 227

    data = build_loaders(dataset, root, img_size, args.batch_size, info, loader=args.loader,
                         num_workers=args.num_workers, channels_last=args.channels_last,
                         train=False)
    amp_dtype = resolve_amp_dtype(args.amp_dtype, device) if args.autocast else None
    model = alexnet(num_classes=data.num_classes, amp_dtype=amp_dtype)
    ckpt_io.load_weights(model, state, path)
    input_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=input_format)
    if parallel == "dp":
        model = nn.DataParallel(model)
    # eval_DDP needs no DDP wrapper: there is no gradient to synchronise, each rank
    # runs its own copy on its own shard and only the counts are reduced.

    if info.is_main:
        print(f"checkpoint: {path}", flush=True)
    correct, total = evaluate(model, data.val, autocast_factory(device, amp_dtype), info,
                              desc=eval_name(parallel), input_format=input_format)
    acc = correct / total
    if info.is_main:
        print(f"top-1 accuracy on {dataset} test split ({img_size}px"
              f"{', autocast ' + str(amp_dtype)[6:] if amp_dtype else ''}"
              f"{f', {info.world_size} processes' if info.world_size > 1 else ''}): "
              f"{correct}/{total} = {acc:.4f}", flush=True)
    return acc


@report_user_errors
def main(parallel: str, argv: Optional[Sequence[str]] = None) -> None:
    args = parse_eval_args(eval_name(parallel), ddp=parallel == "ddp", argv=argv)
    info = setup(parallel == "ddp", args.cuda)
    try:
        run(args, parallel, info)
    finally:
        cleanup(info)
