"""What a train script's ``build(parts: Parts) -> Technique`` starts from and returns: the
contract between a script's own technique and the shared epoch, checkpoint and log code.

``Parts.network`` is the bare network, on its device (a resumed run's weights loaded);
``Technique.model`` is the network as the script runs it (wrapped by DataParallel, DDP or
FSDP2). ``amp_dtype`` is the one name of the dtype the matmuls and convolutions run in
(None: float32), whether autocast or FSDP2's MixedPrecisionPolicy casts to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import nn

from .comm_hooks import CommHook
from .precision import resolve_amp_dtype

DEFAULT_LR = 1e-4  # the article's AdamW learning rate

# One optimizer step over its micro-batches [(images, targets), ...] -> (each micro-batch's
# mean loss, the gradient norm before clipping).
MicroBatches = List[Tuple[torch.Tensor, torch.Tensor]]
Step = Callable[[MicroBatches], Tuple[List[torch.Tensor], torch.Tensor]]


@dataclass
class Parts:
    """What a script's ``build()`` starts from: the objects that do not depend on the variant,
    and the flags of its technique (a script passes those it honours)."""
    network: nn.Module                    # the bare network, on its device
    criterion: nn.Module = field(default_factory=nn.CrossEntropyLoss)
    lr: Optional[float] = None            # --lr (None: DEFAULT_LR)
    # --amp_dtype, a name or a dtype; None: float16 on CUDA, bfloat16 on the CPU.
    amp_dtype: Union[torch.dtype, str, None] = None
    clip_grad: Optional[float] = None     # --clip_grad: the largest gradient norm (None: any)
    dp_scope: str = "model"               # --dp_scope (DataParallel scripts)
    comm_hook: CommHook = field(default_factory=CommHook)  # --comm_hook (DDP scripts)
    reduce_dtype: Union[torch.dtype, str] = torch.float32  # --reduce_dtype (FSDP2 mixed)
    device: Optional[torch.device] = None  # the run's (None: where the network is)

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = next(self.network.parameters()).device
        if self.lr is None:
            self.lr = DEFAULT_LR
        if not isinstance(self.amp_dtype, torch.dtype):
            self.amp_dtype = resolve_amp_dtype(self.amp_dtype, self.device)
        if isinstance(self.reduce_dtype, str):
            self.reduce_dtype = getattr(torch, self.reduce_dtype)


@dataclass
class Technique:
    """What a script's ``build()`` returns: the objects that make its variant, which the
    shared code runs, checkpoints and logs."""
    model: nn.Module                           # the network as the script runs it
    optimizer: torch.optim.Optimizer           # made by the script, over what it trains
    train_step: Step                           # one optimizer step over its micro-batches
    autocast: Optional[torch.autocast] = None  # validation runs under it too
    scaler: Optional[torch.amp.GradScaler] = None
    amp_dtype: Optional[torch.dtype] = None    # autocast's, or a MixedPrecisionPolicy's

    def __post_init__(self) -> None:
        if self.amp_dtype is None and self.autocast is not None:
            self.amp_dtype = self.autocast.fast_dtype

    @property
    def precision(self) -> str:
        if self.amp_dtype is not None and self.autocast is None:
            return "mixed"
        if self.scaler is not None:
            return "grad_scaler"
        return "autocast" if self.autocast is not None else "fp32"
