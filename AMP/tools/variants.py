"""The training variants and eval scripts, by name.

The article's nine: {single device, DataParallel, DDP} x {fp32, autocast, autocast +
GradScaler}. Beyond it, FSDP2 (``fully_shard``) as a fourth parallel mode, in the same
three precisions and in FSDP2's own mixed precision (``train_FSDP_mixed``).
"""
from __future__ import annotations

import importlib
import inspect
import re
from typing import Optional

import torch
from torch import nn

from ampkit.device import resolve_amp_dtype
from ampkit.flags import DEFAULT_LR

# One process per device, started by torchrun.
DISTRIBUTED = ("ddp", "fsdp")
_PAR_NAME = {"single": "", "dp": "DP", "ddp": "DDP", "fsdp": "FSDP"}
_PREC_NAME = {"fp32": "", "autocast": "autocast", "grad_scaler": "GradScaler", "mixed": "mixed"}


def train_name(parallel: str, precision: str) -> str:
    """``("dp", "grad_scaler")`` -> ``train_DP_GradScaler``; ``("single", "fp32")`` -> ``train_without``."""
    parts = ["train", _PAR_NAME[parallel], _PREC_NAME[precision]]
    name = "_".join(p for p in parts if p)
    return "train_without" if name == "train" else name


def eval_name(parallel: str) -> str:
    """The eval script of a parallel mode; FSDP's checkpoints are evaluated like DDP's."""
    return "eval_" + ({"fsdp": "DDP"}.get(parallel) or _PAR_NAME[parallel] or "without")


ARTICLE_VARIANTS = {train_name(par, prec): (par, prec)
                    for par in ("single", "dp", "ddp") for prec in ("fp32", "autocast", "grad_scaler")}
TRAIN_VARIANTS = dict(ARTICLE_VARIANTS)
TRAIN_VARIANTS.update({train_name("fsdp", prec): ("fsdp", prec)
                       for prec in ("fp32", "autocast", "grad_scaler", "mixed")})

# SCRIPT+LABEL's label (compare.py) also names a folder: no character a path would misread.
LABEL = re.compile(r"[A-Za-z0-9_.-]+")


def script_of(variant: str) -> str:
    """``train_DDP+bf16comm`` -> ``train_DDP``: the training script a variant runs."""
    return variant.partition("+")[0]


def build_variant(script: str, network: nn.Module, criterion: Optional[nn.Module] = None,
                  **values):
    """``script``'s own ``build()`` of ``network`` (the technique a tool times or a test checks),
    given the named values its signature takes of ``values`` (``device``: the network's by
    default; ``lr``; ``amp_dtype``, a dtype or its name, the device's default if left out;
    ``clip_grad``; ``dp_scope``; ``comm_hook``, None by default (DDP's own all-reduce); ``reduce_dtype``), and FSDP2's
    mixed precision's loss scaling as its main() decides it: where float16 is anywhere."""
    module = importlib.import_module(script)
    takes = inspect.signature(module.build).parameters
    device = values.setdefault("device", next(network.parameters()).device)
    dtype = values.get("amp_dtype")
    values["amp_dtype"] = (getattr(torch, dtype) if isinstance(dtype, str) else
                           dtype if dtype is not None else resolve_amp_dtype(None, device))
    reduce = values.get("reduce_dtype", torch.float32)
    values["reduce_dtype"] = getattr(torch, reduce) if isinstance(reduce, str) else reduce
    values.setdefault("loss_scaling", torch.float16 in (values["amp_dtype"],
                                                        values["reduce_dtype"]))
    values = {"clip_grad": None, "dp_scope": "model", "comm_hook": None} | values
    values["lr"] = DEFAULT_LR if values.get("lr") is None else values["lr"]
    return module.build(network, criterion or nn.CrossEntropyLoss(),
                        **{k: v for k, v in values.items() if k in takes})
