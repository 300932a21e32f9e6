"""The nine training variants and three eval variants, by name."""
from __future__ import annotations

PARALLEL = ("single", "dp", "ddp")
_PAR_NAME = {"single": "", "dp": "DP", "ddp": "DDP"}
_PREC_NAME = {"fp32": "", "autocast": "autocast", "grad_scaler": "GradScaler"}


def train_name(parallel: str, precision: str) -> str:
    """``("dp", "grad_scaler")`` -> ``train_DP_GradScaler``; ``("single", "fp32")`` -> ``train_without``."""
    parts = ["train", _PAR_NAME[parallel], _PREC_NAME[precision]]
    name = "_".join(p for p in parts if p)
    return "train_without" if name == "train" else name


def eval_name(parallel: str) -> str:
    return "eval_" + (_PAR_NAME[parallel] or "without")


TRAIN_VARIANTS = {train_name(par, prec): (par, prec)
                  for par in PARALLEL for prec in _PREC_NAME}
EVAL_VARIANTS = {eval_name(par): par for par in PARALLEL}
