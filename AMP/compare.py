"""Run the training variants side by side and report time, throughput, memory and accuracy.

    python AMP/compare.py --epochs 20                          # all nine variants (the article's table)
    python AMP/compare.py --epochs 20 --seeds 3                # each 3 times: mean, spread, verdict
    python AMP/compare.py --variants train_without,train_DDP_autocast --epochs 2
    python AMP/compare.py --dataset ImageFolder --dataset_root data/flowers --img_size 64 --epochs 2
    python AMP/compare.py --seeds 3 --variants train_DDP,train_DDP+bf16comm \
        --extra_args 'train_DDP+bf16comm=--comm_hook bf16'   # a script with flags of its own

Each variant is its own training command, with the same data, epochs, batch size,
learning rate and seed (DDP variants under ``python -m torch.distributed.run
--standalone`` with one process per GPU, or 2 CPU processes without CUDA;
``--nproc`` to change), followed by its eval script (eval_without / eval_DP /
eval_DDP) on its own ``last.pth``. A variant named ``SCRIPT+LABEL`` is SCRIPT run with
the flags that ``--extra_args 'SCRIPT+LABEL=...'`` gives it, in a run folder of its own;
its accuracy is compared with SCRIPT's plain runs when they ran too. Everything lands under
``<out>/<time>/``:

- ``results.csv``, ``results.md`` (one row per variant), ``results.json`` (the runs and
  each variant over its seeds) and ``results.png``: validation accuracy against cumulative
  training time (the training loops alone, as logged in ``train_time``) with the target
  accuracy as a line, the speed-up of each variant over ``train_without`` (steady-state
  images/s) and the peak memory per device;
- ``checkpoint/<variant>/{last,best}.pth, log.jsonl``;
- ``logs/<variant>.train.log``, ``logs/<variant>.eval.log`` (the commands' output);

and TensorBoard runs under ``tensorboard/compare-<time>/<variant>/``, so that
``tensorboard --logdir tensorboard`` shows every variant of the comparison together.
After the last variant compare.py adds, per variant, the scalar
``compare/val_accuracy_by_train_ms``: validation accuracy at each epoch's end, with the
cumulative training time in milliseconds as its step (and the comparison's start plus that
time as its wall time). In TensorBoard's Scalars or Time Series tab, filter on
``compare/``: with the default Step axis each line shows validation accuracy against
training time. The figure of ``results.png`` is the image ``compare/results`` of the run
``compare-<time>``.

With ``--seeds N`` every variant is trained N times, with seeds ``--seed``, ``--seed`` + 1,
...: results.csv keeps one row per run, and the table gives each variant's mean and spread
over its runs, its test accuracy's difference from the fp32 variant of its parallel mode,
and whether that difference is within seed noise (Welch's t-test at 5 %, ``tools/stats.py``);
the figure draws each variant's band over its seeds. Each seed's runs write under
``seed<k>/`` of the checkpoint and TensorBoard folders.

Time to target: each run's training-loop time, epochs and images until its validation
accuracy first reaches ``--target_acc`` (by default the fp32 baseline's mean final test
accuracy less its seed standard deviation; the output says which and how), or "not
reached"; over seeds, its mean ± sd over the runs that reached it and Welch's verdict
against the fp32 variant of its parallel mode.

A run that fails is reported as failed with a one-line reason and the others still run;
the table counts the runs that finished, and the exit status is then 1. For steady-state step throughput without data
loading, see ``AMP/benchmark.py``.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path
from typing import List, Optional

from ampkit.data import check_loader_flags, loader_kind
from ampkit.errors import UserError
from ampkit.flags import (DATASETS, DEFAULT_LR, REPO_ROOT, TENSORBOARD_DIR, DefaultsOnce,
                          Parser, add_device_flags, train_parser)
from ampkit.models import check_arch_flags
from tools import report, stats
from tools.compare_results import TB_ACCURACY, write_results
from tools.comparison import Comparison, short
from tools.report import FAILED, INTERRUPTED, OK, VariantResult
from tools.variants import ARTICLE_VARIANTS, LABEL, TRAIN_VARIANTS, script_of

RESULTS_DIR = REPO_ROOT / "results"


def build_parser() -> Parser:
    d = train_parser("train_without")  # the train scripts' defaults, kept in sync
    p = Parser(prog="compare.py", description=__doc__.split("\n\n")[0],
               formatter_class=DefaultsOnce)
    p.add_argument("--variants", default=None,
                   help="comma-separated training variants to run, in this order "
                        f"(any of: {', '.join(TRAIN_VARIANTS)}), or 'all'; SCRIPT+LABEL "
                        "is SCRIPT with the flags --extra_args 'SCRIPT+LABEL=...' gives it. "
                        "Default: the article's nine (all but the FSDP ones)")
    g = p.add_argument_group("passed to every variant")
    g.add_argument("--arch", default=d.get_default("arch"),
                   help="the network (alexnet, or a torchvision classifier; --arch list)")
    g.add_argument("--dataset", choices=DATASETS, default=d.get_default("dataset"),
                   help="the data set (as the train scripts' --dataset)")
    g.add_argument("--dataset_root", type=Path, default=d.get_default("dataset_root"),
                   help="data set folder")
    g.add_argument("--img_size", type=int, default=d.get_default("img_size"),
                   help="images are resized to img_size x img_size")
    g.add_argument("--epochs", type=int, default=d.get_default("epochs"), help="epochs per run")
    g.add_argument("--train_subset", type=int, default=None, metavar="N",
                   help="train on N images of the training set, as many of each class, the same "
                        "for every variant and seed (named in the results and figure). Default: "
                        "the whole training set")
    g.add_argument("--batch_size", type=int, default=d.get_default("batch_size"),
                   help="batch size; PER PROCESS for the DDP variants, as in their scripts")
    g.add_argument("--lr", type=float, default=DEFAULT_LR, help="AdamW's learning rate")
    g.add_argument("--seed", type=int, default=d.get_default("seed"),
                   help="the first run's seed (see --seeds)")
    g.add_argument("--num_workers", type=int, default=None,
                   help="DataLoader workers of the classic input path (ImageFolder, or "
                        "--extra_args '--loader classic'; default: the scripts' own, 4 with "
                        "CUDA, 0 on the CPU)")
    add_device_flags(g)
    g.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="log every run to TensorBoard under <tensorboard_root>/compare-<time>/")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="runs per variant, with seeds --seed, --seed + 1, ...: the table gives "
                        "each variant's mean and spread, and whether its accuracy differs "
                        "from its fp32 baseline by more than seed noise")
    p.add_argument("--target_acc", type=target_fraction, default=None, metavar="A",
                   help="the validation accuracy each run's time to target is measured to, a "
                        "fraction in (0, 1]. Default: the fp32 baseline's (train_without, else "
                        "the first plain fp32 variant to finish) mean final test accuracy less "
                        "its seed standard deviation; with one run, its accuracy itself")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes of the DDP variants (default: the number of GPUs, or 2 "
                        "without CUDA)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR,
                   help="results root; this comparison writes <out>/<time>/")
    p.add_argument("--tensorboard_root", type=Path, default=TENSORBOARD_DIR,
                   help="TensorBoard root (the one to give `tensorboard --logdir`)")
    p.add_argument("--extra_args", action="append", default=[], metavar="[VARIANT=]ARGS",
                   help="more flags for the training command of VARIANT (or of every variant "
                        "without VARIANT=), e.g. --extra_args 'train_DP=--log_every 5'; repeatable")
    return p


def target_fraction(text: str) -> float:
    """--target_acc's value: an accuracy as a fraction, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"must be an accuracy as a fraction in (0, 1], e.g. 0.8, got {text!r}")
    return value


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    chosen = args.variants or ",".join(ARTICLE_VARIANTS)
    chosen = ",".join(TRAIN_VARIANTS) if chosen.strip() == "all" else chosen
    names = [v.strip() for v in chosen.split(",")
             if v.strip()]
    unknown = [v for v in names if script_of(v) not in TRAIN_VARIANTS
               or ("+" in v and not LABEL.fullmatch(v.partition("+")[2]))]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(TRAIN_VARIANTS)}"
                " (or SCRIPT+LABEL, a label of letters, digits, '_', '.', '-')")
    if not names:
        p.error("--variants is empty")
    if len(set(names)) != len(names):
        p.error("--variants names a variant twice")
    args.variant_list = names
    for flag in ("epochs", "batch_size", "img_size", "train_subset"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            p.error(f"--{flag} must be a positive integer")
    try:
        check_arch_flags(args.arch, args.img_size)
    except UserError as e:
        p.error(str(e))
    if args.seeds <= 0:
        p.error(f"--seeds must be a positive integer (runs per variant), got {args.seeds}")
    if args.nproc is not None and args.nproc <= 0:
        p.error("--nproc must be a positive integer")
    extra = {}
    for item in args.extra_args:
        head, sep, rest = item.partition("=")
        target = head.strip() if sep and (head.strip() in TRAIN_VARIANTS
                                          or head.strip() in names) else None
        if sep and head.strip() and not head.strip().startswith("-") and target is None:
            p.error(f"--extra_args {item!r}: {head.strip()!r} is not a variant")
        text = rest if target else item
        extra.setdefault(target, []).extend(shlex.split(text))
    bare = [v for v in names if "+" in v and not extra.get(v)]
    if bare:  # the same flags as its script: a second, identical variant
        p.error(f"--variants {bare[0]}: no --extra_args '{bare[0]}=FLAGS' gives it its flags")
    args.extra = extra
    for v in names:  # --num_workers: the classic loader's, which each variant's flags choose
        flags = [*extra.get(None, []), *extra.get(script_of(v), []),
                 *(extra.get(v, []) if v != script_of(v) else [])]
        loader = argparse.ArgumentParser(add_help=False)
        loader.add_argument("--loader", default="auto")
        try:
            check_loader_flags(loader_kind(args.dataset, loader.parse_known_args(flags)[0].loader),
                               num_workers=args.num_workers, skip_bad=False)
        except UserError as e:
            p.error(f"{v}: {e}")
    args.dataset_root = args.dataset_root.expanduser().resolve()
    args.out = args.out.expanduser().resolve()
    args.tensorboard_root = args.tensorboard_root.expanduser().resolve()
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        comp = Comparison(args)
    except UserError as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        return 2
    runs = [(seed, v) for seed in range(args.seed, args.seed + args.seeds)
            for v in args.variant_list]  # seed after seed: a machine's drift is every variant's
    print(f"compare.py: {len(args.variant_list)} variant(s)"
          + (f" x {args.seeds} seeds" if args.seeds > 1 else "")
          + f" on {comp.device}; results in {comp.dir}", flush=True)
    results: List[VariantResult] = []
    interrupted = False
    for i, (seed, variant) in enumerate(runs, 1):
        if interrupted:
            results.append(comp.result(variant, seed))
            continue
        r = comp.run_variant(variant, i, len(runs), seed)
        results.append(r)
        if r.status == INTERRUPTED:
            interrupted = True
        elif r.status != OK:
            print(f"==> {comp.run_name(variant, seed)} FAILED: {r.reason}", flush=True)
        write_results(comp, results, plot=False)  # after every run: a long comparison keeps what it has

    target = write_results(comp, results)
    if args.seeds > 1:
        print(f"\nOver {args.seeds} seeds:\n\n{stats.seed_table(stats.summarise_seeds(results))}"
              f"\n\n{stats.RULE}\n\nEvery run: {comp.dir / 'results.md'}")
    else:
        print("\n" + report.markdown_table(results))
    print(f"\n{target.sentence()}.\n{stats.time_rule(args.seeds)}")
    print(f"\nresults: {comp.dir / 'results.csv'}, results.json, results.md, results.png")
    if args.tensorboard:
        print(f"TensorBoard: this comparison's runs are under {comp.tb_dir}/<variant>/; to see "
              f"every variant in one view: tensorboard --logdir {short(args.tensorboard_root)} "
              f"(accuracy vs training time: {TB_ACCURACY})")
    failed = [comp.run_name(r.variant, r.seed) for r in results if r.status == FAILED]
    if failed:
        print(f"{len(failed)} of {len(results)} run(s) failed: {', '.join(failed)}", flush=True)
    if interrupted:
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
