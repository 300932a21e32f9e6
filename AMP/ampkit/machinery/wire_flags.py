"""The flags of what travels between the processes, and their checks: DDP's comm hook
(``ampkit/comm_hooks.py``), FSDP2's reduce dtype (``train_FSDP_mixed.py``). A flag a run
cannot honour is refused in one line."""
from __future__ import annotations

import argparse

from .process import UserError

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")  # ampkit/comm_hooks.py
REDUCE_DTYPES = ("float32", "bfloat16", "float16")  # train_FSDP_mixed.py


def add_wire_flags(p: argparse.ArgumentParser) -> None:
    """What travels between the processes: DDP's comm hook, FSDP2's reduce dtype."""
    p.add_argument("--comm_hook", choices=COMM_HOOKS, default="none",
                   help="DDP scripts: what the gradients' all-reduce sends: fp32 (none), cast "
                        "to fp16 or bf16 (half the bytes), or PowerSGD's low-rank factors")
    p.add_argument("--powersgd_rank", type=int, default=None, metavar="R",
                   help="--comm_hook powersgd: the rank of each matrix's approximation "
                        "(default 1)")
    p.add_argument("--powersgd_start_iter", type=int, default=None, metavar="STEPS",
                   help="--comm_hook powersgd: plain all-reduce steps before compressing "
                        "(default: 10%% of the run's optimizer steps, at least 2)")
    p.add_argument("--reduce_dtype", choices=REDUCE_DTYPES, default="float32",
                   help="train_FSDP_mixed.py: the dtype FSDP2 reduce-scatters the gradients "
                        "in (MixedPrecisionPolicy; with --accum_steps also the dtype they "
                        "accumulate in)")


def check_wire_flags(args: argparse.Namespace) -> None:
    """--comm_hook and --reduce_dtype: only where the run can honour them."""
    variant, given = args.variant, args.given
    if args.comm_hook != "none" and not variant.startswith("train_DDP"):
        why = ("FSDP2 reduce-scatters without DDP's hooks: train_FSDP_mixed.py has "
               "--reduce_dtype" if variant.startswith("train_FSDP") else
               "DataParallel sums the gradients on one GPU, in one process"
               if variant.startswith("train_DP") else
               "one device sends no gradients anywhere")
        raise UserError(f"--comm_hook {args.comm_hook} is for the DDP scripts "
                        f"(train_DDP*.py), not {variant}: {why}")
    if {"powersgd_rank", "powersgd_start_iter"} & given and args.comm_hook != "powersgd":
        raise UserError("--powersgd_rank and --powersgd_start_iter tune --comm_hook powersgd; "
                        f"this run has --comm_hook {args.comm_hook}")
    if args.powersgd_rank is not None and args.powersgd_rank <= 0:
        raise UserError(f"--powersgd_rank must be a positive integer, got {args.powersgd_rank}")
    if args.powersgd_start_iter is not None and args.powersgd_start_iter < 2:
        raise UserError("--powersgd_start_iter must be at least 2 (PowerSGD's error feedback "
                        f"needs a plain step first), got {args.powersgd_start_iter}")
    if "reduce_dtype" in given and variant != "train_FSDP_mixed":
        raise UserError(f"--reduce_dtype is train_FSDP_mixed.py's (FSDP2's "
                        f"MixedPrecisionPolicy), not {variant}'s"
                        + ("; the DDP scripts have --comm_hook"
                           if variant.startswith("train_DDP") else ""))
