"""Command-line flags of the train and eval scripts, and their checks: a flag a run cannot
honour is refused in one line, before anything starts.

The article's flag names and defaults are kept (CIFAR10, 227 px, batch 64,
AdamW lr 1e-4, 20 epochs); booleans are real booleans (``--tf32/--no-tf32``),
and default paths are relative to the repository root, not the current folder.
The flags a run was started with are recorded in its checkpoints (``checkpoint.files``).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from .device import DEVICES
from .comm_hooks import HOOKS
from .errors import UserError
from .models import check_arch_flags, check_batch_of_one, check_dp_scope

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"
CHECKPOINT_DIR = REPO_ROOT / "checkpoint"
TENSORBOARD_DIR = REPO_ROOT / "tensorboard"

DATASETS = ("CIFAR10", "FashionMNIST", "ImageFolder", "FakeData")
AMP_DTYPES = ("float16", "bfloat16")
LOADERS = ("auto", "fast", "classic")
COMPILE_MODES = ("default", "reduce-overhead")
# Each compiled forward starts a new CUDA graph generation, which overwrites the gradients the
# previous micro-batch's backward left in the graphs' memory pool: the next backward's
# accumulation into them raises (torch/_inductor/cudagraph_trees.py).
CUDA_GRAPHS_ACCUM = ("--compile reduce-overhead (CUDA graphs) takes one micro-batch per optimizer "
                     "step: with --accum_steps 2 or more, each micro-batch's graphs overwrite "
                     "the gradients the previous one accumulated; --compile compiles without "
                     "graphs, or give --accum_steps 1")
DEFAULT_LR = 1e-4  # the article's AdamW learning rate


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block) and exit with status 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class DefaultsOnce(argparse.HelpFormatter):
    """--help with each option's default said once: ``(default: X)`` appended where the help
    does not say its default itself and X is a value (not None, not an empty list, not the
    off state of a switch that takes no value; a ``--x/--no-x`` pair's is a value)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if ("default" in text.lower() or default is None or default is argparse.SUPPRESS
                or default == [] or switch or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


def _add_common(p: argparse.ArgumentParser, *, process_group: bool, for_eval: bool) -> None:
    from_ckpt = " (default: as the checkpoint was trained)" if for_eval else ""
    p.add_argument("--dataset", choices=DATASETS, default=None if for_eval else "CIFAR10",
                   help="CIFAR10 or FashionMNIST (downloaded into --dataset_root; Fashion-MNIST "
                        "offline: apt install dataset-fashion-mnist, --dataset_root "
                        "/usr/share/datasets/fashion-mnist), ImageFolder (a root with train/ and "
                        "val/ class folders) or FakeData (random images)" + from_ckpt)
    p.add_argument("--dataset_root", type=Path, default=None if for_eval else DATA_DIR,
                   help="data set folder" + from_ckpt)
    p.add_argument("--img_size", type=int, default=None if for_eval else 227,
                   help="images are resized to img_size x img_size (at least 63 for AlexNet; "
                        "what --arch takes)" + from_ckpt)
    p.add_argument("--arch", default=None if for_eval else "alexnet",
                   help="the network: alexnet (AMP/alexnet.py) or any torchvision classifier by "
                        "its builder name (resnet50, vit_b_16, ...; --arch list prints them)"
                        + from_ckpt)
    p.add_argument("--batch_size", type=int, default=64,
                   help="batch size " + ("PER PROCESS (the global batch is batch_size x world size)"
                                         if process_group
                                         else "(split across GPUs by DataParallel)"))
    add_device_flags(p)
    p.add_argument("--num_workers", type=int, default=None,
                   help="DataLoader worker processes (classic loader). Default: 4 on an "
                        "accelerator, 0 on the CPU")
    p.add_argument("--loader", choices=LOADERS, default="auto",
                   help="input path: 'fast' holds the whole data set as uint8 on the device and "
                        "resizes/normalises/flips there in batch; 'classic' is torchvision's "
                        "DataLoader with PIL transforms; 'auto' is fast for CIFAR10, FashionMNIST "
                        "and FakeData, "
                        "classic for ImageFolder")
    p.add_argument("--channels_last", action=argparse.BooleanOptionalAction, default=False,
                   help="use the channels_last memory format for the model and its inputs")
    p.add_argument("--skip_bad_images", action="store_true",
                   help="go on past images that cannot be read (corrupt, truncated, no "
                        "permission) and list them after each epoch, instead of stopping at "
                        "the first with an error naming it: validation leaves them out, "
                        "training takes the next readable image in their place")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA fp32 math: --tf32 runs fp32 convolutions and matmuls in TF32 "
                        "(Ampere and newer), --no-tf32 in full fp32. Default: PyTorch's, TF32 "
                        "convolutions and fp32 matmuls")


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """--device, --cuda / --no-cuda (its older spellings), and --amp_dtype, what autocast
    computes in there."""
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to run: auto is the accelerator this machine has (CUDA or ROCm, "
                        "Intel XPU, Apple MPS), else the CPU; a named one that is not there is "
                        "an error")
    p.add_argument("--cuda", dest="device", action="store_const", const="cuda",
                   help="the same as --device cuda")
    p.add_argument("--no-cuda", dest="device", action="store_const", const="cpu",
                   help="the same as --device cpu")
    p.add_argument("--amp_dtype", choices=AMP_DTYPES, default=None,
                   help="autocast dtype. Default: float16 on an accelerator (CUDA or ROCm, "
                        "XPU, MPS), bfloat16 on the CPU")


def save_interval(text: str) -> str:
    """``--save_every``: a number of epochs, or a duration such as ``30s`` or ``5m``."""
    if not re.fullmatch(r"\d+[smh]?", text.strip()):
        raise argparse.ArgumentTypeError(
            f"expected epochs (2) or a duration (30s, 5m), got {text!r}")
    return text.strip()


def _description(doc: Optional[str], default: str) -> str:
    """A script's --help description: the first line of its docstring."""
    return (doc or "").strip().splitlines()[0] if (doc or "").strip() else default


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The run's folders, its resume, saves, logs and traces."""
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="log to TensorBoard")
    p.add_argument("--tensorboard_log", type=Path, default=TENSORBOARD_DIR,
                   help="TensorBoard folder; this run logs to <it>/<variant>/<time>/")
    p.add_argument("--checkpoint", type=Path, default=CHECKPOINT_DIR,
                   help="checkpoint folder; this run writes <it>/<variant>/{last,best}.pth")
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="PATH",
                   help="continue a run from a checkpoint (no PATH: this variant's last.pth); "
                        "it must come from a run of this variant with the same data, image "
                        "size and global batch size")
    p.add_argument("--init_from", type=Path, default=None, metavar="PATH",
                   help="start a new run (epoch 1, fresh optimizer) from another checkpoint's "
                        "weights")
    p.add_argument("--log_every", type=int, default=20,
                   help="optimizer steps between reads of the loss on the host (progress bar, "
                        "checks)")
    p.add_argument("--profile", action="store_true",
                   help="record 3 steps of the first epoch (after 2 warm-up steps) with "
                        "torch.profiler: a trace per rank in <checkpoint>/<variant>/profile/ "
                        "(open it in https://ui.perfetto.dev) and the top operators printed")
    p.add_argument("--save_every", type=save_interval, default="1", metavar="N|Ns|Nm",
                   help="write last.pth every N epochs, or after the epoch that ends N seconds "
                        "(Ns) or minutes (Nm) after the previous save, in the background; the "
                        "last epoch and a stop always save; 0: only they do")


def train_parser(variant: str, process_group: bool = False, doc: Optional[str] = None) -> Parser:
    """The flags of a train script; ``process_group``: one of a group's processes (DDP, FSDP2),
    whose --batch_size is per process."""
    p = Parser(prog=f"{variant}.py", formatter_class=DefaultsOnce,
               description=_description(doc, f"Train AlexNet, or any --arch ({variant})."))
    p.set_defaults(variant=variant)
    _add_common(p, process_group=process_group, for_eval=False)
    p.add_argument("--lr", type=float, default=DEFAULT_LR,
                   help="AdamW learning rate (a resumed run goes on at its optimizer's saved "
                        "rate unless --lr is given)")
    p.add_argument("--epochs", type=int, default=20, help="number of epochs to train")
    p.add_argument("--train_subset", type=int, default=None, metavar="N",
                   help="train on N images of the training set, as many of each class, the same "
                        "N for every seed and variant (validation stays whole). Default: all")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--pretrained", action="store_true",
                   help="start from torchvision's ImageNet weights (downloaded via torch.hub)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   metavar="MODE",
                   help="torch.compile the model (not under DataParallel); --compile "
                        "reduce-overhead also replays its kernels as CUDA graphs (one device, "
                        "on CUDA: train_without, train_autocast, train_GradScaler; "
                        "--accum_steps 1)")
    # Default "model": the article's nn.DataParallel(model), so the comparison measures what
    # the article measured. "features" should be faster on 2+ GPUs: DataParallel copies the
    # replicated parameters to every GPU in every forward, 2.5M (9 MB) for the conv layers
    # against 57M (217 MB) for the whole model; it takes 2+ GPUs to see (on one GPU
    # DataParallel calls the module directly, and both are the same). Measure it with
    # `python AMP/benchmark.py --variants train_DP_autocast --dp_scope features`.
    p.add_argument("--dp_scope", choices=("model", "features"), default="model",
                   help="DataParallel wraps the whole model, or only model.features as in "
                        "pytorch/examples' ImageNet script (the big linear layers then run on "
                        "one GPU)")
    p.add_argument("--peak_tflops", type=float, default=None, metavar="TFLOPS",
                   help="dense peak TFLOP/s of one device in this run's precision, for the "
                        "share of it the epoch line reports. Default: by GPU name "
                        "(ampkit/device.py); none on the CPU")
    p.add_argument("--accum_steps", type=int, default=1, metavar="K",
                   help="micro-batches of --batch_size per optimizer step (gradient "
                        "accumulation): the global batch is batch_size x K x world size")
    p.add_argument("--clip_grad", type=float, default=None, metavar="MAX_NORM",
                   help="clip the gradients' total norm to MAX_NORM before each optimizer step "
                        "(after GradScaler's unscale_); the norm is logged either way")
    _add_run_flags(p)
    add_wire_flags(p)
    return p


def eval_parser(variant: str, process_group: bool = False, doc: Optional[str] = None) -> Parser:
    p = Parser(prog=f"{variant}.py", formatter_class=DefaultsOnce,
               description=_description(doc, f"Evaluate a checkpoint ({variant})."))
    p.set_defaults(variant=variant)
    _add_common(p, process_group=process_group, for_eval=True)
    p.add_argument("--checkpoint", type=Path, default=CHECKPOINT_DIR,
                   help="a checkpoint file, or a folder: its newest last.pth is evaluated")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=False,
                   help="evaluate under autocast (see --amp_dtype)")
    return p


def _check_common(args: argparse.Namespace, process_group: bool) -> None:
    if not process_group and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun started N copies of a one-process script: each would train the same
        # model on the same data and write the same files.
        raise UserError(f"this script runs in one process (one device or DataParallel), but "
                        f"torchrun started {os.environ['WORLD_SIZE']} (WORLD_SIZE): run it with "
                        "python, or use a DDP or FSDP script (train_DDP*, train_FSDP*, "
                        "eval_DDP) under torchrun")
    # Past sys.maxsize, a count reaches the sampler's islice as a traceback.
    if args.batch_size is not None and not 0 < args.batch_size <= sys.maxsize:
        raise UserError(f"--batch_size must be a positive integer (at most 2**63 - 1), got "
                        f"{args.batch_size}")
    if args.num_workers is not None and args.num_workers < 0:
        raise UserError(f"--num_workers must be >= 0, got {args.num_workers}")
    # An eval script's 0 would stand for "the checkpoint's size".
    if args.img_size is not None and args.img_size <= 0:
        raise UserError(f"--img_size must be a positive integer, got {args.img_size}")
    check_arch_flags(args.arch, args.img_size)


def parse_train_args(variant: str, argv: Optional[Sequence[str]] = None, doc: Optional[str] = None,
                     process_group: bool = False) -> argparse.Namespace:
    """A train script's flags (``argv``: sys.argv's by default), checked; ``args.variant`` is
    the script's name."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = train_parser(variant, process_group, doc).parse_args(argv)
    given = given_flags(train_parser(variant, process_group, doc), argv)
    _check_common(args, process_group)
    if args.epochs <= 0:
        raise UserError(f"--epochs must be a positive integer, got {args.epochs}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        raise UserError(f"--lr must be a finite number >= 0, got {args.lr}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops)
                                             and args.peak_tflops > 0):
        raise UserError(f"--peak_tflops must be a positive number, got {args.peak_tflops}")
    if args.log_every <= 0:
        raise UserError(f"--log_every must be a positive integer, got {args.log_every}")
    if not 0 < args.accum_steps <= sys.maxsize:
        raise UserError(f"--accum_steps must be a positive integer (at most 2**63 - 1), got "
                        f"{args.accum_steps}")
    # torch.manual_seed takes -2**63 to 2**64 - 1, and the sampler seeds each epoch with seed
    # + epoch: a signed 64-bit seed leaves every epoch room.
    if not -2**63 <= args.seed < 2**63:
        raise UserError(f"--seed must be a 64-bit integer, -2**63 to 2**63 - 1, got {args.seed}")
    if args.batch_size == 1:
        check_batch_of_one(args.arch, args.img_size)
    if args.train_subset is not None and args.train_subset <= 0:
        raise UserError(f"--train_subset must be a positive integer, got {args.train_subset}")
    if args.clip_grad is not None and not (math.isfinite(args.clip_grad) and args.clip_grad > 0):
        raise UserError(f"--clip_grad must be a positive number, got {args.clip_grad}")
    check_wire_flags(args, given)
    check_technique_flags(args, given)
    if args.resume and args.init_from:
        raise UserError("--resume continues a run, --init_from starts a new one from a "
                        "checkpoint's weights: give one of them")
    # What the command line gave: a resumed run takes --lr only if it was given.
    args.given = given
    return args


def parse_eval_args(variant: str, argv: Optional[Sequence[str]] = None, doc: Optional[str] = None,
                    process_group: bool = False) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = eval_parser(variant, process_group, doc).parse_args(argv)
    _check_common(args, process_group)
    if "amp_dtype" in given_flags(eval_parser(variant, process_group, doc), argv) and \
            not args.autocast:
        raise UserError("--amp_dtype is the dtype of --autocast: give --autocast too (without "
                        "it the evaluation runs in fp32)")
    return args


def check_technique_flags(args: argparse.Namespace, given: frozenset) -> None:
    """The flags of one technique, refused by the scripts of another, where they would do
    nothing (``given``: the flags the command line gave)."""
    variant = args.variant
    dp = variant.startswith("train_DP") and not variant.startswith("train_DDP")
    if "amp_dtype" in given and not variant.endswith(("autocast", "GradScaler", "mixed")):
        raise UserError(f"--amp_dtype is the low-precision dtype of the autocast, GradScaler "
                        f"and FSDP2 mixed scripts; {variant} trains in fp32")
    if "dp_scope" in given and not dp:
        raise UserError(f"--dp_scope chooses what DataParallel replicates (train_DP*.py), not "
                        f"{variant}")
    if args.compile and dp:
        raise UserError("--compile is supported for single-device, DDP and FSDP2 runs, not "
                        "DataParallel")
    if args.compile == "reduce-overhead" and variant.startswith(("train_DDP", "train_FSDP")):
        raise UserError(f"--compile reduce-overhead (CUDA graphs) is for the one-device scripts, "
                        f"not {variant}: a graph replays fixed kernels on fixed memory, and "
                        + ("DDP's all-reduces run from autograd's hooks between its graphs"
                           if variant.startswith("train_DDP") else
                           "FSDP2 gathers and frees each block's weights around it")
                        + "; --compile compiles without them")
    if args.compile == "reduce-overhead" and args.accum_steps > 1:
        raise UserError(CUDA_GRAPHS_ACCUM)
    check_dp_scope(args.arch, args.dp_scope)


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset:
    """The flags (their ``dest``) that ``argv`` gives, as opposed to those left at their
    defaults: ``argv`` parsed again with every default suppressed, so that abbreviations
    and ``--flag=value`` count as they do in the real parse."""
    # argparse has no public list of its actions.
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(argv)))


# ---- what travels between the processes: DDP's comm hook, FSDP2's reduce dtype
REDUCE_DTYPES = ("float32", "bfloat16", "float16")


def add_wire_flags(p: argparse.ArgumentParser) -> None:
    """What travels between the processes: DDP's comm hook, FSDP2's reduce dtype."""
    p.add_argument("--comm_hook", choices=HOOKS, default="none",
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
                        "accumulate in); float16 brings a GradScaler, as float16 parameters do")


def check_wire_flags(args: argparse.Namespace, given: frozenset) -> None:
    """--comm_hook and --reduce_dtype: only where the run can honour them (``given``: the
    flags the command line gave)."""
    variant = args.variant
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
