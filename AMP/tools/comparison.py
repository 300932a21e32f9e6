"""One comparison's runs: the training and eval commands of each variant and seed, run one
after the other (:mod:`tools.runner`), each turned into a :class:`tools.report.VariantResult`
from its log.jsonl and its eval line (:mod:`tools.run_logs`). ``AMP/compare.py`` is its
command line; its flags are the ``args`` here."""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

# Only to see the devices: the child processes do the training.
import torch

from ampkit.device import device_type

from . import run_logs, runner
from .report import FAILED, INTERRUPTED, NOT_RUN, OK, VariantResult
from .variants import DISTRIBUTED, TRAIN_VARIANTS, eval_name, script_of

# The scripts' folder, AMP/.
AMP_DIR = Path(__file__).resolve().parents[1]


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
        names = [n.strip() for n in out.splitlines() if n.strip()]
        return ", ".join(sorted(set(names))) if names else "CUDA GPU"
    except (OSError, subprocess.SubprocessError):
        return "CUDA GPU"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def short(path: Path) -> str:
    """``path`` relative to the current folder when it lies under it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd())) or "."
    except ValueError:
        return str(path)


class Comparison:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # --device auto becomes the device type this machine has.
        self.device = device_type(args.device)
        self.cuda = self.device == "cuda"
        self.gpus = torch.accelerator.device_count() if self.device != "cpu" else 0
        self.nproc = args.nproc or (self.gpus if self.device != "cpu" else 2)
        self.amp_dtype = args.amp_dtype or ("bfloat16" if self.device == "cpu" else "float16")
        self.torch_version = torch.__version__
        # One start for every variant's TensorBoard accuracy curve, so that they line up.
        self.started = time.time()
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
               "--device", self.device]
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
            *(["--train_subset", str(a.train_subset)] if a.train_subset is not None else []),
            "--checkpoint", str(self.run_dir(variant, seed).parent)]
        # The mixed-precision scripts alone: the fp32 ones refuse --amp_dtype.
        if a.amp_dtype is not None and precision != "fp32":
            cmd += ["--amp_dtype", a.amp_dtype]
        tb_root = self.under(self.tb_dir, seed) / (variant if "+" in variant else "")
        cmd += (["--tensorboard_log", str(tb_root)] if a.tensorboard else ["--no-tensorboard"])
        # A SCRIPT+LABEL variant is SCRIPT's run plus its own flags: one change against it.
        inherited = a.extra.get(script_of(variant), []) if "+" in variant else []
        return cmd + a.extra.get(None, []) + inherited + a.extra.get(variant, [])

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
