"""The networks ``--arch`` names: torchvision's classifiers by builder name, and the checks
that a name exists and takes the run's image size, made before anything is built."""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
from typing import List, Optional

import torch
import torchvision

from .process import UserError

DEFAULT_ARCH = "alexnet"
MIN_ALEXNET_SIZE = 63  # AlexNet's feature extractor needs at least 63x63 input


@functools.lru_cache(maxsize=1)
def arch_names() -> List[str]:
    """Every torchvision classification model's builder name."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


def check_arch(arch: str) -> None:
    if arch not in arch_names():
        raise UserError(f"unknown --arch {arch!r}: --arch list prints the {len(arch_names())} "
                        "torchvision classifiers it takes (resnet18, resnet50, vit_b_16, ...)")


def builder_kwargs(arch: str) -> dict:
    """Keyword arguments that make any classifier a plain one: one output tensor in training
    (no auxiliary logits) and no warning about a default that will change."""
    params = inspect.signature(torchvision.models.get_model_builder(arch)).parameters
    kwargs = {}
    if "aux_logits" in params or arch in ("googlenet", "inception_v3"):
        kwargs["aux_logits"] = False
    if arch in ("googlenet", "inception_v3"):
        kwargs["init_weights"] = True
    return kwargs


def check_input_size(arch: str, img_size: int) -> None:
    """One line if ``arch`` cannot take ``img_size`` x ``img_size`` images (checked by a forward
    pass on the meta device: shapes only, no memory, no arithmetic)."""
    if arch == DEFAULT_ARCH:
        if img_size < MIN_ALEXNET_SIZE:
            raise UserError(f"--img_size must be at least {MIN_ALEXNET_SIZE} for AlexNet, "
                            f"got {img_size}")
        return
    reason = _meta_forward_problem(arch, img_size)
    if reason is not None and _meta_forward_problem(arch, 224) is None:
        raise UserError(f"--img_size {img_size} does not suit --arch {arch}: {reason}")


@functools.lru_cache(maxsize=None)  # a pure function of its flags: once per process
def _meta_forward_problem(arch: str, img_size: int) -> Optional[str]:
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = torchvision.models.get_model(arch, num_classes=10, **builder_kwargs(arch))
            model.eval()(torch.empty(2, 3, img_size, img_size))
    except Exception as e:  # whatever the model raises on an input it cannot take
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    return None


def check_arch_flags(arch: Optional[str], img_size: Optional[int]) -> None:
    """``--arch list`` prints the names and exits; an unknown name, or an image size the
    network cannot take, is one line (None: not given, decided later)."""
    if arch == "list":
        print("\n".join(arch_names()))
        sys.exit(0)
    if arch is not None:
        check_arch(arch)
        if img_size is not None:
            check_input_size(arch, img_size)
