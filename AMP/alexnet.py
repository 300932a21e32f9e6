"""AlexNet whose ``forward`` runs under autocast, as in the article: torchvision's AlexNet,
layer for layer (the weights of ``--arch alexnet`` load into it, and back), plus ``amp_dtype``.

The article decorates AlexNet's ``forward`` with ``@autocast()``. Why: ``nn.DataParallel``
runs each replica's forward in a worker thread, and autocast state is thread-local.
PyTorch re-enters autocast in those threads with the caller's *enabled* flag but not its
dtype, so a bfloat16 run under DP would silently fall back to float16. ``autocast_forward``
(``ampkit/models.py``) re-enters autocast inside ``forward`` with the dtype chosen at
run time (``model.amp_dtype``) and the device type of the input, in every thread.

The training scripts apply the same decorator to whatever DataParallel replicates, for any
``--arch`` (``ampkit.models.autocast_replicas``: the whole model, or only ``model.features``
with ``--dp_scope features``). ``amp_dtype = None`` leaves the caller's precision as it is.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torchvision

from ampkit.models import autocast_forward

__all__ = ["AlexNet", "alexnet", "autocast_forward"]


class AlexNet(torchvision.models.AlexNet):
    """torchvision.models.AlexNet, whose forward enters autocast with ``amp_dtype``."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5,
                 amp_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(num_classes=num_classes, dropout=dropout)
        # A plain attribute, not a buffer: it is not saved in checkpoints, and DataParallel's
        # replicas copy it.
        self.amp_dtype = amp_dtype

    @autocast_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)

    @property
    def num_classes(self) -> int:
        return self.classifier[-1].out_features


def alexnet(pretrained: bool = False, progress: bool = True, num_classes: int = 1000,
            amp_dtype: Optional[torch.dtype] = None, **kwargs: Any) -> AlexNet:
    """Build AlexNet; ``pretrained`` loads torchvision's ImageNet weights via torch.hub (with
    ``num_classes != 1000`` the backbone is kept and the last layer is new)."""
    model = AlexNet(num_classes=num_classes, amp_dtype=amp_dtype, **kwargs)
    if pretrained:
        weights = torchvision.models.AlexNet_Weights.DEFAULT
        state = weights.get_state_dict(progress=progress, check_hash=True, weights_only=True)
        if num_classes != 1000:
            state = {k: v for k, v in state.items() if not k.startswith("classifier.6.")}
        model.load_state_dict(state, strict=num_classes == 1000)
    return model
