"""Steady-state training throughput of each variant, and of the input pipeline alone.

    python AMP/benchmark.py                                    # all nine variants, 227px, batch 64
    python AMP/benchmark.py --variants train_without,train_autocast --steps 50 --warmup 10
    python AMP/benchmark.py --peak_tflops 165 --json bench.json  # utilisation against a peak
    python AMP/benchmark.py --variants none --pipeline all --repeat 3   # input paths only

Model: each variant's own build() (imported from its training script: its wrapper,
precision objects and step) run by the training loop (ampkit.engine.train_one_epoch)
over --steps synthetic batches already on the device, after --warmup steps that are not
counted; timed with CUDA events on a GPU (perf_counter on the CPU). Reports step time,
images/s, peak memory, FLOPs per step (torch.utils.flop_counter) and, with
--peak_tflops (per device), the utilisation. DDP and FSDP2 variants run as a one-process
group, or under torchrun in its group (then they alone, and rank 0 prints):

    torchrun --nproc_per_node=2 AMP/benchmark.py --variants train_DDP --accum_steps 4

Input pipeline: images/s delivered to the device at --img_size by the article's PIL
path, the classic DataLoader path (ampkit.machinery.data) and the fast device path
(ampkit.machinery.fastdata), on CIFAR-10 when --dataset_root holds it, else on generated images
in CIFAR-10's format. All the measuring code is in tools/measure.py.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

from ampkit.machinery.devices import want_cuda
from ampkit.machinery.archs import check_arch_flags
from ampkit.machinery.config import AMP_DTYPES, DATA_DIR, Parser
from ampkit.machinery.data import default_workers
from ampkit.machinery.errors import UserError
from ampkit.machinery.flops import fp32_peak_math, peak_tflops
from ampkit.precision import cpu_has_fast_bf16, set_tf32
from tools import measure
from tools.variants import ARTICLE_VARIANTS, DISTRIBUTED, TRAIN_VARIANTS

PIPELINES = {"all": ["article", "classic", "fast"], "both": ["classic", "fast"],
             "no_classic": ["article", "fast"],  # a machine whose /dev/shm holds no worker
             "article": ["article"], "classic": ["classic"], "fast": ["fast"], "none": []}


def build_parser() -> Parser:
    # allow_abbrev=False: the removed --dataset must not be taken as --dataset_root
    p = Parser(prog="benchmark.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
               formatter_class=lambda prog: argparse.ArgumentDefaultsHelpFormatter(
                   prog, max_help_position=32))
    p.add_argument("--variants", default=None,
                   help="comma-separated variants to measure, 'all' (the FSDP ones too), or "
                        "'none' (input pipeline only). Default: the article's nine")
    p.add_argument("--arch", default="alexnet",
                   help="the network (alexnet, or a torchvision classifier; --arch list)")
    p.add_argument("--batch_size", type=int, default=64, help="images per step (per process)")
    p.add_argument("--img_size", type=int, default=227)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="steps run first and not counted")
    p.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA (--no-cuda: CPU). Default: CUDA when available")
    p.add_argument("--amp_dtype", choices=AMP_DTYPES, default=None,
                   help="autocast dtype (default: float16 on CUDA, bfloat16 on the CPU)")
    p.add_argument("--num_classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="peak dense fp16/bf16 TFLOP/s of ONE device, for the utilisation of "
                        "the autocast variants. Default: by GPU name (ampkit/machinery/flops.py)")
    p.add_argument("--peak_tflops_fp32", type=float, default=None,
                   help="peak TFLOP/s of ONE device for the fp32 variants: the TF32 figure "
                        "unless --no-tf32, then the fp32 one. Default: by GPU name")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA fp32 math, as in training: TF32 (--tf32) or full fp32 "
                        "(--no-tf32). Default: PyTorch's, TF32 convolutions and fp32 matmuls")
    p.add_argument("--channels_last", action=argparse.BooleanOptionalAction, default=False,
                   help="model and inputs in the channels_last memory format (as in training)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (not the DataParallel variants); compilation "
                        "happens in the warm-up steps")
    p.add_argument("--dp_scope", choices=("model", "features"), default="model",
                   help="DataParallel wraps the whole model or only model.features (as in training)")
    p.add_argument("--accum_steps", type=int, default=1, metavar="K",
                   help="micro-batches of --batch_size per optimizer step (as in training); "
                        "--steps counts optimizer steps")
    p.add_argument("--keep_sync", action="store_true",
                   help="with --accum_steps, DDP all-reduces every micro-batch (no no_sync): "
                        "what no_sync saves")
    _add_pipeline_flags(p)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--profile", action="store_true",
                   help="after each variant's timing, record 5 more steps with torch.profiler: "
                        "a trace per variant in results/profile-<time>/ (open it in "
                        "https://ui.perfetto.dev) and the top operators printed")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p


def _add_pipeline_flags(p: Parser) -> None:
    p.add_argument("--pipeline", choices=list(PIPELINES), default="both",
                   help="input paths to measure: 'all' adds the article's PIL path to the "
                        "classic and fast ones ('both')")
    p.add_argument("--dataset_root", type=Path, default=DATA_DIR,
                   help="input pipeline data: CIFAR-10 (cifar-10-batches-py/) if present here, "
                        "else batch_size x (warm-up + timed batches + 1) generated images "
                        "(at least 256) in CIFAR-10's format, in a temporary folder")
    p.add_argument("--num_workers", type=int, default=None,
                   help="DataLoader workers of the classic path (default: 4 with CUDA, 0 on CPU)")
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
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: its group
    if args.world_size > 1:
        alone = [v for v in names if TRAIN_VARIANTS[v][0] not in DISTRIBUTED]
        if alone:
            p.error(f"under torchrun only the DDP and FSDP variants run (not {', '.join(alone)})")
        args.pipeline = "none"
    for flag in ("batch_size", "steps", "num_classes", "pipeline_batches", "repeat",
                 "accum_steps"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag} must be a positive integer")
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


def peaks(args: argparse.Namespace, device, fp32_math: str) -> tuple:
    """(the fp16/bf16 peak, the fp32 rows' peak) of one device: the flags', else the table's
    for this GPU (said once where it has none: no utilisation, never a guess)."""
    half, full = args.peak_tflops, args.peak_tflops_fp32
    if device.type == "cuda" and (half is None or full is None):
        name = torch.cuda.get_device_name(device)
        half = half if half is not None else peak_tflops(name, "half")
        full = full if full is not None else peak_tflops(name, fp32_peak_math(fp32_math))
        if half is None or full is None:
            print(f"note: no peak TFLOP/s known for {name} (ampkit/machinery/flops.py): no "
                  "utilisation without --peak_tflops and --peak_tflops_fp32", flush=True)
    return half, full


def measure_steps(args: argparse.Namespace, device, fp32_math: str) -> list:
    """One StepResult per variant; a variant that fails is reported and the others run."""
    peak_half, peak_fp32 = peaks(args, device, fp32_math)
    results = []
    ddp = measure.DDPGroup(device.type == "cuda")
    if args.world_size > 1:
        device = ddp.get().device  # this process's own (cuda:LOCAL_RANK under torchrun)
    try:
        for variant in args.variant_list:
            try:
                r = measure.measure_variant(
                    variant, device=device, batch_size=args.batch_size, img_size=args.img_size,
                    warmup=args.warmup, steps=args.steps, amp_dtype=args.amp_dtype,
                    num_classes=args.num_classes, lr=args.lr, arch=args.arch,
                    peak_tflops=peak_half, peak_tflops_fp32=peak_fp32, fp32_math=fp32_math, ddp=ddp,
                    channels_last=args.channels_last, compile=args.compile,
                    dp_scope=args.dp_scope, accum_steps=args.accum_steps,
                    keep_sync=args.keep_sync,
                    profile=args.profile_dir / f"trace_{variant}.json" if args.profile else None)
                print(f"  {variant}: {r.step_ms:.1f} ms/step, {r.images_per_s:.1f} images/s",
                      flush=True)
            except (UserError, RuntimeError, ValueError) as e:
                par, prec = TRAIN_VARIANTS[variant]
                r = measure.StepResult(
                    variant=variant, parallel=par, precision=prec, amp_dtype="", arch=args.arch,
                    device=device.type, devices=1, batch_size=args.batch_size,
                    img_size=args.img_size, warmup=args.warmup, steps=args.steps,
                    status="failed", reason=(str(e).strip().splitlines() or [type(e).__name__])[0])
                print(f"  {variant}: FAILED: {r.reason}", flush=True)
            results.append(r)
            gc.collect()  # this variant's model and optimizer, before the next one's
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        ddp.close()
    measure.add_speedups(results)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 alone prints and writes
        sys.stdout, args.json = open(os.devnull, "w"), None
    try:
        device = torch.device("cuda" if want_cuda(args.cuda) else "cpu")
    except UserError as e:
        print(f"benchmark.py: error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU ({torch.get_num_threads()} torch threads)")
    extras = [name for name, on in (("channels_last", args.channels_last),
                                    ("torch.compile", args.compile)) if on]
    print(f"benchmark.py: {len(args.variant_list)} variant(s) of {args.arch} on {where}, batch "
          f"{args.batch_size} "
          f"at {args.img_size}px, {args.warmup} warm-up + {args.steps} timed steps, torch "
          f"{torch.__version__}" + "".join(f", {e}" for e in extras), flush=True)
    if device.type == "cpu" and args.amp_dtype != "float16" and cpu_has_fast_bf16() is False \
            and any(TRAIN_VARIANTS[v][1] != "fp32" for v in args.variant_list):
        print("warning: this CPU has no native bfloat16 (AVX512-BF16/AMX): the autocast "
              "variants will be several times slower than fp32 here", file=sys.stderr)

    fp32_math = set_tf32(args.tf32) if device.type == "cuda" else ""
    steps = measure_steps(args, device, fp32_math)
    pipes = measure.measure_pipelines(
        PIPELINES[args.pipeline], args.dataset_root, args.img_size, args.batch_size,
        default_workers(args.num_workers, device), device, warmup=min(args.warmup, 2),
        batches=args.pipeline_batches, repeat=args.repeat, channels_last=args.channels_last)
    if steps:
        print("\nTraining step (synthetic batches on the device; warm-up excluded; "
              f"timer: {'CUDA events' if device.type == 'cuda' else 'perf_counter'}):")
        print(measure.step_table(steps))
        print("(x fp32: images/s over the fp32 row of the same parallel mode; util: of the "
              "precision's dense peak x devices)")
    if pipes:
        print(f"\nInput pipeline alone (images/s delivered to {device.type} at {args.img_size}px; "
              f"best of {args.repeat}, {args.pipeline_batches} timed batches after "
              f"{min(args.warmup, 2)} warm-up):")
        print(measure.pipeline_table(pipes))
    if args.json is not None:
        out = {"device": where, "torch": torch.__version__, "args": {
                   k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "steps": [r.as_dict() for r in steps], "pipeline": [p.as_dict() for p in pipes]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(f"\nwritten: {args.json}")
    return 1 if any(r.status != "ok" for r in [*steps, *pipes]) else 0


if __name__ == "__main__":
    sys.exit(main())
