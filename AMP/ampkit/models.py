"""Which network a run trains (``--arch``: any torchvision classifier; the names and their
checks are ``machinery/archs.py``), autocast in what DataParallel replicates, and the
blocks FSDP2 shards one by one. ``alexnet`` has the layers of the article's
``AMP/alexnet.py``: their weights load into each other.
"""
from __future__ import annotations

from typing import List

import torch
import torchvision
from torch import nn

from .machinery.archs import builder_kwargs, check_arch
from .machinery.process import UserError
from .precision import autocast_forward


def build_model(arch: str, num_classes: int, pretrained: bool = False) -> nn.Module:
    """``arch`` with ``num_classes`` outputs, on the CPU (ImageNet weights with ``pretrained``)."""
    check_arch(arch)
    kwargs = builder_kwargs(arch)
    if not pretrained:
        return torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)
    weights = torchvision.models.get_model_weights(arch).DEFAULT  # downloaded via torch.hub
    model = torchvision.models.get_model(arch, weights=weights, **kwargs)
    if num_classes != len(weights.meta["categories"]):
        _replace_head(model, num_classes)
    return model


def _replace_head(model: nn.Module, num_classes: int) -> None:
    """A new, freshly initialised last layer with ``num_classes`` outputs."""
    heads = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) or (isinstance(m, nn.Conv2d) and m.out_channels == 1000)]
    if not heads:
        raise UserError("--pretrained: found no last layer to resize for this data set")
    name, old = heads[-1]
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    new = (nn.Linear(old.in_features, num_classes) if isinstance(old, nn.Linear)
           else nn.Conv2d(old.in_channels, num_classes, old.kernel_size, old.stride))
    setattr(parent, name.rpartition(".")[2], new)


class AutocastForward(nn.Module):
    """``module`` whose forward runs under ``torch.autocast(input.device.type, dtype)``, in
    whatever thread calls it (the article's ``@autocast()`` on AlexNet's forward, for any
    module). Its state dict keys carry a ``module.`` prefix, which checkpoints strip like
    DataParallel's."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.amp_dtype = dtype  # a plain attribute: DataParallel's replicas copy it

    @autocast_forward  # reads self.amp_dtype
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def autocast_replicas(module: nn.Module, dtype: torch.dtype) -> AutocastForward:
    """What ``nn.DataParallel`` is about to replicate -- a whole model, or a block such as
    ``model.features`` -- made to compute in ``dtype`` in every replica thread.

    Why: DataParallel runs each replica in a thread of its own, and autocast's state is
    per thread. The threads re-enter autocast with the caller's on/off flag but their own
    default dtype (float16 on CUDA), so a bfloat16 run would silently compute in float16
    there. Wrap what is replicated, whatever it is, and every replica re-enters autocast
    with the run's dtype itself."""
    return AutocastForward(module, dtype)


def check_dp_scope(model: nn.Module, dp_scope: str, arch: str) -> None:
    """``--dp_scope features`` needs a ``features`` block to replicate: one line if not."""
    if dp_scope == "features" and not isinstance(getattr(model, "features", None), nn.Module):
        raise UserError(f"--dp_scope features: --arch {arch} has no .features block "
                        "(alexnet, vgg, densenet, mobilenet, efficientnet ... have one)")


def check_param_dtype_fits(model: nn.Module, arch: str) -> None:
    """FSDP2's MixedPrecisionPolicy casts every parameter to param_dtype, but not buffers:
    a BatchNorm layer would hold bf16/fp16 weights beside float32 running statistics,
    which its kernels refuse. Such a network is one line (autocast handles it)."""
    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    if any(isinstance(m, norms) for m in model.modules()):
        raise UserError(f"--arch {arch} has BatchNorm layers, whose float32 running statistics "
                        "cannot run beside parameters cast to --amp_dtype: use "
                        "train_FSDP_autocast.py for it")


def shard_units(model: nn.Module) -> List[nn.Module]:
    """The blocks FSDP2 shards one by one, before the root: the model's children that hold
    parameters, and inside an ``nn.Sequential`` child its own such children -- AlexNet's
    conv and linear layers, a ResNet's stem and residual blocks, a ViT's embedding,
    encoder and head. Each block's parameters are gathered just before it runs and freed
    after, so a process holds one whole block at a time, besides its own shards."""
    def has_params(m: nn.Module) -> bool:
        return any(True for _ in m.parameters())

    units = []
    for child in model.children():
        inner = [c for c in child.children() if has_params(c)]
        if isinstance(child, nn.Sequential) and len(inner) > 1:
            units += inner
        elif has_params(child):
            units.append(child)
    return units
