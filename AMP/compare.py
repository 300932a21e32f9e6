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

- ``results.csv``, ``results.md`` (one row per variant) and ``results.png``: validation
  accuracy against cumulative training time (the training loops alone, as logged in
  ``train_time``), the speed-up of each variant over ``train_without`` (steady-state
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

A run that fails is reported as failed with a one-line reason and the others still run;
the table counts the runs that finished, and the exit status is then 1. For steady-state step throughput without data
loading, see ``AMP/benchmark.py``.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch  # only to see the devices; the children do the work

from ampkit.machinery.devices import want_cuda
from ampkit.machinery.archs import check_arch_flags
from ampkit.machinery.config import (AMP_DTYPES, DATASETS, REPO_ROOT, TENSORBOARD_DIR, Parser,
                                     train_parser)
from ampkit.machinery.errors import UserError
from tools import report, run_logs, runner, stats
from tools.figure import plot_results
from tools.report import FAILED, INTERRUPTED, NOT_RUN, OK, VariantResult
from tools.variants import ARTICLE_VARIANTS, DISTRIBUTED, TRAIN_VARIANTS, eval_name

AMP_DIR = Path(__file__).resolve().parent
RESULTS_DIR = REPO_ROOT / "results"
LABEL = re.compile(r"[A-Za-z0-9_.-]+")  # SCRIPT+LABEL: also a folder's name


def script_of(variant: str) -> str:
    """``train_DDP+bf16comm`` -> ``train_DDP``: the training script a variant runs."""
    return variant.partition("+")[0]


def build_parser() -> Parser:
    d = train_parser("train_without")  # the train scripts' defaults, kept in sync
    p = Parser(prog="compare.py", description=__doc__.split("\n\n")[0],
               formatter_class=lambda prog: argparse.ArgumentDefaultsHelpFormatter(
                   prog, max_help_position=32))
    p.add_argument("--variants", default=None,
                   help="comma-separated training variants to run, in this order "
                        f"(any of: {', '.join(TRAIN_VARIANTS)}), or 'all'; SCRIPT+LABEL "
                        "is SCRIPT with the flags --extra_args 'SCRIPT+LABEL=...' gives it. "
                        "Default: the article's nine (all but the FSDP ones)")
    g = p.add_argument_group("passed to every variant")
    g.add_argument("--arch", default=d.get_default("arch"),
                   help="the network (alexnet, or a torchvision classifier; --arch list)")
    g.add_argument("--dataset", choices=DATASETS, default=d.get_default("dataset"))
    g.add_argument("--dataset_root", type=Path, default=d.get_default("dataset_root"))
    g.add_argument("--img_size", type=int, default=d.get_default("img_size"))
    g.add_argument("--epochs", type=int, default=d.get_default("epochs"))
    g.add_argument("--batch_size", type=int, default=d.get_default("batch_size"),
                   help="batch size; PER PROCESS for the DDP variants, as in their scripts")
    g.add_argument("--lr", type=float, default=d.get_default("lr"))
    g.add_argument("--seed", type=int, default=d.get_default("seed"))
    g.add_argument("--num_workers", type=int, default=None,
                   help="DataLoader workers (default: the scripts' own, 4 with CUDA, 0 on the CPU)")
    g.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA (--no-cuda: CPU). Default: CUDA when available")
    g.add_argument("--amp_dtype", choices=AMP_DTYPES, default=None,
                   help="autocast dtype of the AMP variants (default: float16 on CUDA, "
                        "bfloat16 on the CPU)")
    g.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="log every run to TensorBoard under <tensorboard_root>/compare-<time>/")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="runs per variant, with seeds --seed, --seed + 1, ...: the table gives "
                        "each variant's mean and spread, and whether its accuracy differs "
                        "from its fp32 baseline by more than seed noise")
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
    for flag in ("epochs", "batch_size", "img_size"):
        if getattr(args, flag) <= 0:
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
    args.dataset_root = args.dataset_root.expanduser().resolve()
    args.out = args.out.expanduser().resolve()
    args.tensorboard_root = args.tensorboard_root.expanduser().resolve()
    return args


def _gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
        names = [n.strip() for n in out.splitlines() if n.strip()]
        return ", ".join(sorted(set(names))) if names else "CUDA GPU"
    except (OSError, subprocess.SubprocessError):
        return "CUDA GPU"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _short(path: Path) -> str:
    """``path`` relative to the current folder when it lies under it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd())) or "."
    except ValueError:
        return str(path)


class Comparison:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = want_cuda(args.cuda)
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        self.nproc = args.nproc or (self.gpus if self.cuda else 2)
        self.device = "cuda" if self.cuda else "cpu"
        self.amp_dtype = args.amp_dtype or ("float16" if self.cuda else "bfloat16")
        self.torch_version = torch.__version__
        self.started = time.time()  # the common start of the TensorBoard accuracy curves
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.stamp = stamp
        n = 2
        while (args.out / self.stamp).exists():
            self.stamp = f"{stamp}-{n}"
            n += 1
        self.dir = args.out / self.stamp
        self.ckpt_dir = self.dir / "checkpoint"
        self.log_dir = self.dir / "logs"
        self.tb_dir = args.tensorboard_root / f"compare-{self.stamp}"
        for d in (self.ckpt_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    # -- commands -------------------------------------------------------------
    def _launcher(self, parallel: str, script: str) -> List[str]:
        path = str(AMP_DIR / f"{script}.py")
        if parallel in DISTRIBUTED:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={self.nproc}", path]
        return [sys.executable, path]

    def _common(self) -> List[str]:
        a = self.args
        cmd = ["--dataset", a.dataset, "--dataset_root", str(a.dataset_root),
               "--img_size", str(a.img_size), "--batch_size", str(a.batch_size),
               "--cuda" if self.cuda else "--no-cuda"]
        if a.arch != "alexnet":
            cmd += ["--arch", a.arch]
        if a.num_workers is not None:
            cmd += ["--num_workers", str(a.num_workers)]
        return cmd

    def under(self, root: Path, seed: int) -> Path:
        """Where a run of ``seed`` writes under ``root``: ``root`` itself with one seed, its
        ``seed<k>/`` with several."""
        return root if self.args.seeds == 1 else root / f"seed{seed}"

    def run_dir(self, variant: str, seed: int) -> Path:
        """The run folder of ``variant``'s run of ``seed``: its script's folder, under a
        folder of its own for a ``SCRIPT+LABEL`` variant."""
        root = self.under(self.ckpt_dir, seed)
        return (root / variant if "+" in variant else root) / script_of(variant)

    def run_name(self, variant: str, seed: int) -> str:
        return variant if self.args.seeds == 1 else f"{variant}.seed{seed}"

    def train_cmd(self, variant: str, seed: Optional[int] = None) -> List[str]:
        a = self.args
        seed = a.seed if seed is None else seed
        parallel, precision = TRAIN_VARIANTS[script_of(variant)]
        cmd = self._launcher(parallel, script_of(variant)) + self._common() + [
            "--epochs", str(a.epochs), "--lr", repr(a.lr), "--seed", str(seed),
            "--checkpoint", str(self.run_dir(variant, seed).parent)]
        if a.amp_dtype is not None:
            cmd += ["--amp_dtype", a.amp_dtype]
        tb_root = self.under(self.tb_dir, seed) / (variant if "+" in variant else "")
        cmd += (["--tensorboard_log", str(tb_root)] if a.tensorboard else ["--no-tensorboard"])
        return cmd + a.extra.get(None, []) + a.extra.get(variant, [])

    def eval_cmd(self, variant: str, checkpoint: Path) -> List[str]:
        parallel, _ = TRAIN_VARIANTS[script_of(variant)]
        return self._launcher(parallel, eval_name(parallel)) + self._common() + [
            "--checkpoint", str(checkpoint)]

    def devices(self, parallel: str) -> int:
        if parallel in DISTRIBUTED:
            return self.nproc
        if parallel == "dp":
            return max(self.gpus, 1)
        return 1

    # -- one variant ----------------------------------------------------------
    def result(self, variant: str, seed: int, status: str = NOT_RUN) -> VariantResult:
        parallel, precision = TRAIN_VARIANTS[script_of(variant)]
        return VariantResult(variant=variant, parallel=parallel, precision=precision,
                             amp_dtype="" if precision == "fp32" else self.amp_dtype,
                             device=self.device, devices=self.devices(parallel), seed=seed,
                             status=status)

    def run_variant(self, variant: str, index: int, count: int,
                    seed: Optional[int] = None) -> VariantResult:
        seed = self.args.seed if seed is None else seed
        r = self.result(variant, seed)
        parallel, precision = r.parallel, r.precision
        run_dir, name = self.run_dir(variant, seed), self.run_name(variant, seed)
        cmd = self.train_cmd(variant, seed)
        where = (f"{r.devices} {self.device} processes" if parallel in DISTRIBUTED
                 else f"{r.devices} {self.device}")
        print(f"\n==> [{index}/{count}] {variant} ({parallel}, {precision}"
              f"{', ' + r.amp_dtype if r.amp_dtype else ''}) on {where}"
              + (f", seed {seed}" if self.args.seeds > 1 else ""), flush=True)
        print("    " + shlex.join(cmd), flush=True)
        run = runner.run_child(cmd, self.log_dir / f"{name}.train.log", env=self.env)
        r.wall_time_s = run.wall_s
        summary = run_logs.summarise_log(run_logs.read_log(run_dir / "log.jsonl"))
        r.epochs = summary["epochs"]
        r.train_time_s = summary["train_time_s"]
        r.images_per_s = summary["images_per_s"]
        r.best_val_acc = summary["best_val_acc"]
        r.tflops, r.utilisation = summary["tflops"], summary["utilisation"]
        if summary["peak_mem_mb"] is not None:
            r.peak_mem_mb, r.peak_mem_source = summary["peak_mem_mb"], "log"
            r.peak_mem_per_rank = summary["peak_mem_per_rank"]
        elif run.max_rss_mb is not None:
            r.peak_mem_mb, r.peak_mem_source = run.max_rss_mb, "rss"
        if run.interrupted:
            r.status, r.reason = INTERRUPTED, "interrupted by the user"
            return r
        if run.returncode != 0:
            r.status, r.reason = FAILED, runner.failure_reason(run.stderr, run.returncode)
            return r
        last = run_dir / "last.pth"
        if not last.is_file() or r.epochs is None:
            r.status = FAILED
            r.reason = f"training exited 0 but wrote no {'last.pth' if not last.is_file() else 'log.jsonl'}"
            return r
        r.checkpoint = str(last)

        cmd = self.eval_cmd(variant, last)
        print(f"==> [{index}/{count}] {variant}: {eval_name(parallel)} on its last.pth", flush=True)
        print("    " + shlex.join(cmd), flush=True)
        ev = runner.run_child(cmd, self.log_dir / f"{name}.eval.log", env=self.env)
        if ev.interrupted:
            r.status, r.reason = INTERRUPTED, "interrupted by the user (during eval)"
            return r
        parsed = run_logs.parse_eval_output(ev.stdout) if ev.returncode == 0 else None
        if parsed is None:
            r.status = FAILED
            r.reason = "eval: " + (runner.failure_reason(ev.stderr, ev.returncode)
                                   if ev.returncode != 0 else "no 'correct/total = acc' line")
            return r
        r.test_correct, r.test_total = parsed
        r.test_acc = parsed[0] / parsed[1]
        r.status = OK
        return r


def _preamble(comp: Comparison, machine: str) -> List[str]:
    a = comp.args
    command = shlex.join(["python", os.path.relpath(__file__)] + sys.argv[1:]) \
        if sys.argv and sys.argv[0].endswith("compare.py") else "(from Python)"
    seeds = f"seed {a.seed}" if a.seeds == 1 else f"seeds {a.seed} to {a.seed + a.seeds - 1}"
    return [
        f"Command: `{command}`",
        "",
        f"- Machine: {machine}; torch {comp.torch_version}, Python {platform.python_version()}",
        f"- Data: {a.dataset} ({_short(a.dataset_root)}) at {a.img_size}px; {a.epochs} epochs, batch "
        f"{a.batch_size} (per process under DDP), AdamW lr {a.lr:g}, {seeds}",
        f"- Run: {time.strftime('%Y-%m-%d %H:%M')}; DDP variants: {comp.nproc} processes",
    ]


NOTES = [
    "Columns: *total wall time* is the training command from start to exit (process "
    "start-up, data loading, validation and checkpoint writes included); *training time* "
    "is the sum of the training loops alone (`train_time` in log.jsonl, device "
    "synchronised, no validation); *images/s* is the median over the epochs after the "
    "first (the only epoch's when there is one), all devices together; *peak memory* is "
    "`peak_mem_mb` from log.jsonl (rank 0: `torch.cuda.max_memory_allocated` on a GPU, "
    "max RSS on the CPU), or, marked (RSS), the peak resident memory of the largest "
    "process of the command measured by compare.py; *TFLOP/s* is what the training loops "
    "achieved (the FLOPs of a forward and backward per image x images / training time), "
    "with its share of the devices' dense peak where that is known; *test acc* is what the "
    "variant's eval script prints for its last.pth.",
]


def write_results(comp: Comparison, results: List[VariantResult], plot: bool = True) -> str:
    """results.csv and results.md (and with ``plot`` results.png and the TensorBoard
    curves) of the runs so far; the Markdown text."""
    a = comp.args
    machine = (f"{comp.gpus} x {_gpu_name()}" if comp.cuda
               else f"CPU: {_cpu_name()}, {os.cpu_count()} cores")
    summaries = stats.summarise_seeds(results) if a.seeds > 1 else None
    summary = ("" if summaries is None else
               f"Over {a.seeds} seeds:\n\n{stats.seed_table(summaries)}\n\n{stats.RULE}\n\n"
               "Every run:\n")
    report.write_csv(results, comp.dir / "results.csv")
    text = report.write_markdown(results, comp.dir / "results.md", title="AlexNet AMP comparison",
                                 preamble=_preamble(comp, machine), notes=NOTES, summary=summary,
                                 show_seed=summaries is not None)
    if not plot:
        return text
    curves = {comp.under(Path(), r.seed) / r.variant: run_logs.accuracy_curve(
        run_logs.read_log(comp.run_dir(r.variant, r.seed) / "log.jsonl"))
        for r in results}
    bars, bands = results, None
    if summaries is not None:  # one bar and one band per variant, over its seeds
        bars = [stats.mean_result(s) for s in summaries]
        bands = {s.first.variant: stats.band([curves[comp.under(Path(), r.seed) / r.variant]
                                              for r in s.finished]) for s in summaries}
    figure = None
    try:
        figure = plot_results(
            bars, comp.dir / "results.png", curves={str(k): v for k, v in curves.items()},
            bands=bands, title=f"{a.dataset} {a.img_size}px, {a.epochs} epochs, {machine}")
    except Exception as e:  # a plot must not cost the user the table
        print(f"compare.py: warning: results.png not written ({e})", file=sys.stderr)
    if a.tensorboard:
        try:
            write_tensorboard(comp.tb_dir, curves, comp.started, figure)
        except Exception as e:  # nor TensorBoard
            print(f"compare.py: warning: TensorBoard curves not written ({e})",
                  file=sys.stderr)
    return text


TB_ACCURACY = "compare/val_accuracy_by_train_ms"
TB_FIGURE = "compare/results"


def write_tensorboard(tb_dir: Path, curves: Dict[str, List[Tuple[int, float, float]]],
                      start: float, figure=None) -> None:
    """``compare/val_accuracy_by_train_ms`` in ``tb_dir/<variant>/`` for every variant with a
    curve (``run_logs.accuracy_curve`` points): step = cumulative training time in ms, wall
    time = ``start`` + that time. ``figure`` (the results figure) goes to ``tb_dir`` as
    ``compare/results``."""
    from torch.utils.tensorboard import SummaryWriter  # only with --tensorboard

    for variant, points in curves.items():
        if not points:
            continue
        writer = SummaryWriter(str(tb_dir / variant))
        try:
            for _, seconds, acc in points:
                writer.add_scalar(TB_ACCURACY, acc, global_step=round(seconds * 1000),
                                  walltime=start + seconds)
        finally:
            writer.close()
    if figure is not None:
        writer = SummaryWriter(str(tb_dir))
        try:
            writer.add_figure(TB_FIGURE, figure, global_step=0, walltime=start)
        finally:
            writer.close()


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

    write_results(comp, results)
    if args.seeds > 1:
        print(f"\nOver {args.seeds} seeds:\n\n{stats.seed_table(stats.summarise_seeds(results))}"
              f"\n\n{stats.RULE}\n\nEvery run: {comp.dir / 'results.md'}")
    else:
        print("\n" + report.markdown_table(results))
    print(f"\nresults: {comp.dir / 'results.csv'}, results.md, results.png")
    if args.tensorboard:
        print(f"TensorBoard: this comparison's runs are under {comp.tb_dir}/<variant>/; to see "
              f"every variant in one view: tensorboard --logdir {_short(args.tensorboard_root)} "
              f"(accuracy vs training time: {TB_ACCURACY})")
    failed = [comp.run_name(r.variant, r.seed) for r in results if r.status == FAILED]
    if failed:
        print(f"{len(failed)} of {len(results)} run(s) failed: {', '.join(failed)}", flush=True)
    if interrupted:
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
