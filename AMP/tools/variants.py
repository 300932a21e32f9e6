"""The training variants and eval scripts, by name.

The article's nine: {single device, DataParallel, DDP} x {fp32, autocast, autocast +
GradScaler}. Beyond it, FSDP2 (``fully_shard``) as a fourth parallel mode, in the same
three precisions and in FSDP2's own mixed precision (``train_FSDP_mixed``).
"""
from __future__ import annotations

import re

DISTRIBUTED = ("ddp", "fsdp")  # one process per device, started by torchrun
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

LABEL = re.compile(r"[A-Za-z0-9_.-]+")  # SCRIPT+LABEL (compare.py): also a folder's name


def script_of(variant: str) -> str:
    """``train_DDP+bf16comm`` -> ``train_DDP``: the training script a variant runs."""
    return variant.partition("+")[0]
