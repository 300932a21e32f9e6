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
    torchrun --nproc_per_node=2 AMP/benchmark.py --variants train_DDP_GradScaler \
        --comm_hook none,fp16,bf16,powersgd          # a row per hook: step time, bytes sent

Input pipeline: images/s delivered to the device at --img_size by the article's PIL
path, the classic DataLoader path (ampkit.data.classic) and the fast device path
(ampkit.data.on_device), on CIFAR-10 when --dataset_root holds it, else on generated images
in CIFAR-10's format. The measuring code: tools/step_throughput.py, tools/measure_input.py.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch

from ampkit.data.classic import default_workers
from ampkit.device import cpu_has_fast_bf16, device_type, set_cuda_math
from ampkit.errors import UserError
from ampkit.device import fp32_peak_math, peak_tflops
from ampkit.run import report_user_errors
from tools import measure_input, step_throughput, tables
from tools.benchmark_flags import PIPELINES, parse_args
from tools.variants import TRAIN_VARIANTS


def peaks(args: argparse.Namespace, device, fp32_math: str) -> tuple:
    """(the fp16/bf16 peak, the fp32 rows' peak) of one device: the flags', else the table's
    for this GPU (said once where it has none: no utilisation, never a guess)."""
    half, full = args.peak_tflops, args.peak_tflops_fp32
    if device.type == "cuda" and (half is None or full is None):
        name = torch.cuda.get_device_name(device)
        half = half if half is not None else peak_tflops(name, "half")
        full = full if full is not None else peak_tflops(name, fp32_peak_math(fp32_math))
        if half is None or full is None:
            print(f"note: no peak TFLOP/s known for {name} (ampkit/device.py): no "
                  "utilisation without --peak_tflops and --peak_tflops_fp32", flush=True)
    return half, full


def time_steps(args: argparse.Namespace, device, fp32_math: str) -> list:
    """One StepResult per variant; a variant that fails is reported and the others run."""
    peak_half, peak_fp32 = peaks(args, device, fp32_math)
    results = []
    ddp = step_throughput.DDPGroup(device.type == "cuda")
    if args.world_size > 1:
        device = ddp.get().device  # this process's own (cuda:LOCAL_RANK under torchrun)
    try:
        runs = [(v, h) for v in args.variant_list
                for h in (args.hooks if TRAIN_VARIANTS[v][0] == "ddp" else ["none"])]
        for variant, hook in runs:
            name = variant + (f" ({hook} hook)" if len(args.hooks) > 1 and hook != "none"
                              and TRAIN_VARIANTS[variant][0] == "ddp" else "")
            hook_suffix = "" if hook == "none" else f"_{hook}"
            try:
                r = step_throughput.measure_variant(
                    variant, device=device, batch_size=args.batch_size, img_size=args.img_size,
                    warmup=args.warmup, steps=args.steps, amp_dtype=args.amp_dtype,
                    num_classes=args.num_classes, lr=args.lr, arch=args.arch,
                    peak_tflops=peak_half, peak_tflops_fp32=peak_fp32, fp32_math=fp32_math, ddp=ddp,
                    channels_last=args.channels_last, compile=args.compile,
                    dp_scope=args.dp_scope, accum_steps=args.accum_steps,
                    keep_sync=args.keep_sync, comm_hook=hook, powersgd_rank=args.powersgd_rank,
                    busy=args.busy,
                    profile=args.profile_dir / f"{variant}{hook_suffix}"
                    if args.profile else None)
                print(f"  {name}: {r.step_ms:.1f} ms/step, {r.images_per_s:.1f} images/s",
                      flush=True)
            except (UserError, RuntimeError, ValueError) as e:
                par, prec = TRAIN_VARIANTS[variant]
                r = step_throughput.StepResult(
                    variant=variant, parallel=par, precision=prec, amp_dtype="", arch=args.arch,
                    device=device.type, devices=1, batch_size=args.batch_size,
                    img_size=args.img_size, warmup=args.warmup, steps=args.steps,
                    comm_hook=hook if par == "ddp" else "", status="failed",
                    reason=(str(e).strip().splitlines() or [type(e).__name__])[0])
                print(f"  {name}: FAILED: {r.reason}", flush=True)
            results.append(r)
            gc.collect()  # this variant's model and optimizer, before the next one's
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        ddp.close()
    tables.add_speedups(results)
    return results


@report_user_errors  # a user's mistake: one line, exit status 2; Ctrl-C: one line, 130
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 alone prints and writes
        sys.stdout, args.json = open(os.devnull, "w"), None
    device = torch.device(device_type(args.device))
    if device.type not in ("cuda", "cpu"):  # its timer: CUDA events, or the host's clock
        raise UserError(f"benchmark.py times CUDA and the CPU, not {device.type}: there, a "
                        "training run's epoch lines give its images/s")
    fp32_math = set_cuda_math(args.tf32, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU ({torch.get_num_threads()} torch threads)")
    extras = [name for name, on in (("channels_last", args.channels_last),
                                    (f"torch.compile ({args.compile})", args.compile)) if on]
    print(f"benchmark.py: {len(args.variant_list)} variant(s) of {args.arch} on {where}, batch "
          f"{args.batch_size} "
          f"at {args.img_size}px, {args.warmup} warm-up + {args.steps} timed steps, torch "
          f"{torch.__version__}" + "".join(f", {e}" for e in extras), flush=True)
    if device.type == "cpu" and args.amp_dtype != "float16" and cpu_has_fast_bf16() is False \
            and int(os.environ.get("RANK", "0")) == 0 \
            and any(TRAIN_VARIANTS[v][1] != "fp32" for v in args.variant_list):
        print("warning: this CPU has no native bfloat16 (AVX512-BF16/AMX): the autocast "
              "variants will be several times slower than fp32 here", file=sys.stderr)

    steps = time_steps(args, device, fp32_math)
    pipes = measure_input.measure_pipelines(
        PIPELINES[args.pipeline], args.dataset_root, args.img_size, args.batch_size,
        default_workers(args.num_workers, device), device, warmup=min(args.warmup, 2),
        batches=args.pipeline_batches, repeat=args.repeat, channels_last=args.channels_last,
        dataset=args.dataset)
    if steps:
        print("\nTraining step (synthetic batches on the device; warm-up excluded; "
              f"timer: {'CUDA events' if device.type == 'cuda' else 'perf_counter'}):")
        print(tables.step_table(steps))
        print("(x fp32: images/s over the fp32 row of the same parallel mode; util: of the "
              "precision's dense peak x devices" + ("; GPU busy: the share of 10 more steps' "
              "wall time in which the GPU ran kernels, torch.profiler recording CUDA activity "
              "alone, no host op)" if args.busy else ")"))
    if pipes:
        print(f"\nInput pipeline alone (images/s delivered to {device.type} at {args.img_size}px; "
              f"best of {args.repeat}, {args.pipeline_batches} timed batches after "
              f"{min(args.warmup, 2)} warm-up):")
        print(tables.pipeline_table(pipes))
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
