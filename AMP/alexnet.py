"""AlexNet (torchvision's architecture) whose ``forward`` runs under autocast, as in the article.

The article decorates AlexNet's ``forward`` with ``@autocast()``. Why: ``nn.DataParallel``
runs each replica's forward in a worker thread, and autocast state is thread-local.
PyTorch re-enters autocast in those threads with the caller's *enabled* flag but not its
dtype, so a bfloat16 run under DP would silently fall back to float16. ``autocast_forward``
below re-enters autocast inside ``forward`` with the dtype chosen at run time
(``model.amp_dtype``) and the device type of the input, in every thread.

The training scripts apply the same decorator to whatever DataParallel replicates, for any
``--arch`` (``ampkit.models.autocast_replicas``: the whole model, or only
``model.features`` with ``--dp_scope features``), so they leave ``amp_dtype`` at None here.

``amp_dtype = None`` leaves the caller's precision untouched (fp32 variants).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["AlexNet", "alexnet", "autocast_forward"]

# torchvision's ImageNet weights (fetched only with pretrained=True, never in tests).
ALEXNET_WEIGHTS_URL = "https://download.pytorch.org/models/alexnet-owt-7be5be79.pth"


def autocast_forward(forward: Callable) -> Callable:
    """Run ``forward`` under ``torch.amp.autocast(input.device.type, self.amp_dtype)``."""

    @functools.wraps(forward)
    def wrapper(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any):
        dtype = getattr(self, "amp_dtype", None)
        if dtype is None:
            return forward(self, x, *args, **kwargs)
        with torch.amp.autocast(device_type=x.device.type, dtype=dtype):
            return forward(self, x, *args, **kwargs)

    return wrapper


class AlexNet(nn.Module):
    """torchvision.models.AlexNet, layer for layer (so its weights load), plus ``amp_dtype``."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5,
                 amp_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )
        # The autocast dtype of ``forward`` (None: as called). A plain attribute, not a
        # buffer: it is not saved in checkpoints, and DataParallel's replicas copy it.
        self.amp_dtype = amp_dtype

    @autocast_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)

    @property
    def num_classes(self) -> int:
        return self.classifier[-1].out_features


def alexnet(pretrained: bool = False, progress: bool = True, num_classes: int = 1000,
            amp_dtype: Optional[torch.dtype] = None, **kwargs: Any) -> AlexNet:
    """Build AlexNet; ``pretrained`` loads torchvision's ImageNet weights via torch.hub.

    With ``num_classes != 1000`` the pretrained backbone is kept and the last
    layer is freshly initialised for the new number of classes.
    """
    model = AlexNet(num_classes=num_classes, amp_dtype=amp_dtype, **kwargs)
    if pretrained:
        state = torch.hub.load_state_dict_from_url(
            ALEXNET_WEIGHTS_URL, progress=progress, weights_only=True)
        if num_classes != 1000:
            state = {k: v for k, v in state.items() if not k.startswith("classifier.6.")}
        model.load_state_dict(state, strict=num_classes == 1000)
    return model
