"""What a train script's ``build(parts: Parts) -> Technique`` starts from and returns: the
contract between a script's own technique and the shared epoch, checkpoint and log code.
``make_parts`` makes the Parts of a run: the network from ``--seed`` and the run's options.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import nn

from .comm_hooks import CommHook, default_start_iter
from .machinery.hardware_use import training_flops_per_image
from .machinery.process import DistInfo, seed_streams
from .models import build_model, check_dp_scope
from .precision import resolve_amp_dtype

# One optimizer step over its micro-batches [(images, targets), ...] -> (its loss, the
# gradient norm before clipping).
MicroBatches = List[Tuple[torch.Tensor, torch.Tensor]]
Step = Callable[[MicroBatches], Tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Parts:
    """What a script's ``build()`` starts from: the objects that do not depend on the variant."""
    device: torch.device
    model: nn.Module             # the bare network, on ``device`` (resumed weights loaded)
    criterion: nn.Module
    # The autocast dtype: --amp_dtype (a name or a dtype); None: float16 on CUDA, bfloat16 on
    # the CPU. Resolved to a torch.dtype when Parts is made.
    amp_dtype: Union[torch.dtype, str, None] = None
    dp_scope: str = "model"               # --dp_scope (DataParallel scripts)
    lr: float = 1e-4                      # --lr, for the script's optimizer
    arch: str = "alexnet"                 # --arch: the network's name, for messages
    clip_grad: Optional[float] = None     # --clip_grad: the largest gradient norm (None: any)
    comm_hook: CommHook = field(default_factory=CommHook)  # --comm_hook (DDP scripts)
    reduce_dtype: torch.dtype = torch.float32  # --reduce_dtype (train_FSDP_mixed.py)
    flops_per_image: float = 0.0  # a training step's, per image (the TFLOP/s figures)

    def __post_init__(self) -> None:
        if not isinstance(self.amp_dtype, torch.dtype):
            self.amp_dtype = resolve_amp_dtype(self.amp_dtype, self.device)


@dataclass
class Technique:
    """What a script's ``build()`` returns: the objects that make its variant, which the
    shared code runs, checkpoints and logs."""
    model: nn.Module                           # as wrapped by the script (DP, DDP, FSDP2)
    optimizer: torch.optim.Optimizer           # made by the script, over what it trains
    train_step: Step                           # one optimizer step over a window of micro-batches
    autocast: Optional[torch.autocast] = None  # validation runs under it too
    scaler: Optional[torch.amp.GradScaler] = None
    param_dtype: Optional[torch.dtype] = None  # FSDP2's MixedPrecisionPolicy: the compute dtype

    @property
    def precision(self) -> str:
        if self.param_dtype is not None:
            return "mixed"
        if self.scaler is not None:
            return "grad_scaler"
        return "autocast" if self.autocast is not None else "fp32"

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype the matmuls and convolutions run in; None: float32."""
        if self.param_dtype is not None:
            return self.param_dtype
        return self.autocast.fast_dtype if self.autocast is not None else None


def make_parts(args, info: DistInfo, num_classes: int, train_size: int) -> Parts:
    """The network, built from ``--seed`` alone (the same initial weights on every rank, for
    any world size; then this rank's own random streams), on the device (channels_last with
    ``--channels_last``); and the rest of what a script's ``build()`` starts from (the comm
    hook's warm-up: from the run's steps over ``train_size`` images); the FLOPs of a
    training step per image, counted on the meta device (the model is left as it was)."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.manual_seed(args.seed)
    model = build_model(args.arch, num_classes, pretrained=args.pretrained)
    seed_streams(args.seed, info.rank, info.device.type == "cuda")  # dropout: each its own
    check_dp_scope(model, args.dp_scope, args.arch)
    model = model.to(info.device, memory_format=memory_format)
    steps = math.ceil(math.ceil(math.ceil(train_size / info.world_size) / args.batch_size)
                      / args.accum_steps) * args.epochs  # a DistributedSampler's shards
    hook = CommHook(args.comm_hook, powersgd_rank=args.powersgd_rank or 1, seed=args.seed,
                    start_iter=args.powersgd_start_iter or default_start_iter(steps))
    return Parts(info.device, model, nn.CrossEntropyLoss(), args.amp_dtype, args.dp_scope,
                 lr=args.lr, arch=args.arch, clip_grad=args.clip_grad, comm_hook=hook,
                 reduce_dtype=getattr(torch, args.reduce_dtype),
                 flops_per_image=training_flops_per_image(model, (3, args.img_size, args.img_size)))
