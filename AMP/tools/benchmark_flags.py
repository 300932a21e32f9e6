"""``benchmark.py``'s flags, checked: one line and exit status 2 for a bad one."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import List, Optional

from ampkit.comm_hooks import HOOKS
from ampkit.errors import UserError
from ampkit.flags import (COMPILE_MODES, CUDA_GRAPHS_ACCUM, DATA_DIR, DefaultsOnce, Parser,
                          add_device_flags, train_parser)
from ampkit.models import check_arch_flags

from .variants import ARTICLE_VARIANTS, DISTRIBUTED, TRAIN_VARIANTS

DESCRIPTION = "Steady-state training throughput of each variant, and of the input pipeline alone."
PIPELINES = {"all": ["article", "classic", "fast"], "both": ["classic", "fast"],
             # For a machine whose /dev/shm cannot hold the classic path's workers.
             "no_classic": ["article", "fast"],
             "article": ["article"], "classic": ["classic"], "fast": ["fast"], "none": []}


def build_parser() -> Parser:
    # The train scripts' defaults, kept in sync: a timed step is a training step.
    d = train_parser("train_without")
    # allow_abbrev=False: a mistyped --dataset_r must not pass for --dataset_root.
    p = Parser(prog="benchmark.py", description=DESCRIPTION, allow_abbrev=False,
               formatter_class=DefaultsOnce)
    p.add_argument("--variants", default=None,
                   help="comma-separated variants to measure, 'all' (the FSDP ones too), or "
                        "'none' (input pipeline only). Default: the article's nine")
    p.add_argument("--arch", default=d.get_default("arch"),
                   help="the network (alexnet, or a torchvision classifier; --arch list)")
    p.add_argument("--batch_size", type=int, default=d.get_default("batch_size"),
                   help="images per step (per process)")
    p.add_argument("--img_size", type=int, default=d.get_default("img_size"),
                   help="images are img_size x img_size")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="steps run first and not counted")
    add_device_flags(p)
    p.add_argument("--num_classes", type=int, default=10, help="the network's classes")
    p.add_argument("--lr", type=float, default=d.get_default("lr"), help="AdamW's learning rate")
    _add_training_flags(p, d)
    _add_pipeline_flags(p)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--profile", action="store_true",
                   help="after each variant's timing, record 5 more steps with torch.profiler: "
                        "a trace per variant in results/profile-<time>/<variant>/ (open it in "
                        "https://ui.perfetto.dev) and the top operators printed")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p


def _add_training_flags(p: Parser, d: Parser) -> None:
    """What a training step is made of, as in training (``d``: the train scripts' parser,
    whose defaults these take)."""
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="peak dense fp16/bf16 TFLOP/s of ONE device, for the utilisation of "
                        "the autocast variants. Default: by GPU name (ampkit/device.py)")
    p.add_argument("--peak_tflops_fp32", type=float, default=None,
                   help="peak TFLOP/s of ONE device for the fp32 variants: the TF32 figure "
                        "unless --no-tf32, then the fp32 one. Default: by GPU name")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=d.get_default("tf32"),
                   help="CUDA fp32 math, as in training: TF32 (--tf32) or full fp32 "
                        "(--no-tf32). Default: PyTorch's, TF32 convolutions and fp32 matmuls")
    p.add_argument("--channels_last", action=argparse.BooleanOptionalAction,
                   default=d.get_default("channels_last"),
                   help="model and inputs in the channels_last memory format (as in training)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   metavar="MODE",
                   help="torch.compile the model (not the DataParallel variants), as in "
                        "training; reduce-overhead: replayed as CUDA graphs (one device, on "
                        "CUDA, --accum_steps 1). Compilation happens in the warm-up steps")
    p.add_argument("--busy", action="store_true",
                   help="on CUDA: after the timing, 10 more steps under torch.profiler, CUDA "
                        "activity alone, and the share of their wall time the GPU ran kernels "
                        "(the rest it waited for the host)")
    p.add_argument("--dp_scope", choices=("model", "features"),
                   default=d.get_default("dp_scope"),
                   help="DataParallel wraps the whole model or only model.features (as in "
                        "training)")
    p.add_argument("--accum_steps", type=int, default=d.get_default("accum_steps"), metavar="K",
                   help="micro-batches of --batch_size per optimizer step (as in training); "
                        "--steps counts optimizer steps")
    p.add_argument("--keep_sync", action="store_true",
                   help="with --accum_steps, DDP all-reduces every micro-batch (no no_sync): "
                        "what no_sync saves")
    p.add_argument("--comm_hook", default="none", metavar="HOOK[,HOOK...]",
                   help="the DDP variants' --comm_hook, a row per hook: any of "
                        f"{', '.join(HOOKS)} (PowerSGD from the third step: --warmup 2 or more)")
    p.add_argument("--powersgd_rank", type=int, default=1, help="PowerSGD's rank")


def _add_pipeline_flags(p: Parser) -> None:
    p.add_argument("--pipeline", choices=list(PIPELINES), default="both",
                   help="input paths to measure: 'all' adds the article's PIL path to the "
                        "classic and fast ones ('both')")
    p.add_argument("--dataset", choices=("CIFAR10", "FashionMNIST"), default="CIFAR10",
                   help="input pipeline data: CIFAR10, or FashionMNIST's idx files in "
                        "--dataset_root")
    p.add_argument("--dataset_root", type=Path, default=DATA_DIR,
                   help="input pipeline data: CIFAR-10 (cifar-10-batches-py/) if present here, "
                        "else batch_size x (warm-up + timed batches + 1) generated images "
                        "(at least 256) in CIFAR-10's format, in a temporary folder")
    p.add_argument("--num_workers", type=int, default=None,
                   help="DataLoader workers of the classic path (default: 4 on CUDA, 0 on the CPU)")
    p.add_argument("--pipeline_batches", type=int, default=10,
                   help="timed batches of the input pipeline (after --warmup batches, at most 2)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each input path this many times (interleaved), keep the best: "
                        "steadier figures on a shared machine")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.variants is None:
        args.variants = ",".join(ARTICLE_VARIANTS)
    if args.variants.strip() == "all":
        args.variants = ",".join(TRAIN_VARIANTS)
    if args.variants.strip().lower() == "none":
        names = []
    else:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in names if v not in TRAIN_VARIANTS]
        if unknown:
            p.error(f"unknown variant(s) {', '.join(unknown)}; choose from "
                    f"{', '.join(TRAIN_VARIANTS)} or 'none'")
    args.variant_list = names
    args.hooks = [h.strip() for h in args.comm_hook.split(",") if h.strip()]
    if not args.hooks or any(h not in HOOKS for h in args.hooks) or \
            len(set(args.hooks)) != len(args.hooks):
        p.error(f"--comm_hook {args.comm_hook!r}: a list of distinct hooks of {', '.join(HOOKS)}")
    ddp = [v for v in names if TRAIN_VARIANTS[v][0] == "ddp"]
    if args.hooks != ["none"] and not ddp:
        p.error("--comm_hook applies to the DDP variants (train_DDP*), none of which is "
                "among --variants")
    if "powersgd" in args.hooks and args.warmup < 2:
        p.error("--comm_hook powersgd needs --warmup 2 or more: its first 2 steps are plain "
                "all-reduces, not what it times")
    if args.powersgd_rank <= 0:
        p.error("--powersgd_rank must be a positive integer")
    # torchrun sets WORLD_SIZE: its processes measure the distributed variants together.
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.world_size > 1:
        alone = [v for v in names if TRAIN_VARIANTS[v][0] not in DISTRIBUTED]
        if alone:
            p.error(f"under torchrun only the DDP and FSDP variants run (not {', '.join(alone)})")
        args.pipeline = "none"
    for flag in ("batch_size", "steps", "num_classes", "pipeline_batches", "repeat",
                 "accum_steps"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag} must be a positive integer")
    if args.compile == "reduce-overhead" and args.accum_steps > 1:
        p.error(CUDA_GRAPHS_ACCUM)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    try:
        check_arch_flags(args.arch, args.img_size)
    except UserError as e:
        p.error(str(e))
    for flag in ("peak_tflops", "peak_tflops_fp32"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            p.error(f"--{flag} must be positive")
    if args.threads is not None and args.threads <= 0:
        p.error("--threads must be a positive integer")
    args.profile_dir = DATA_DIR.parent / "results" / time.strftime("profile-%Y%m%d-%H%M%S")
    return args
