"""What a comparison writes: results.csv, results.md (with the spread over seeds and the
Welch verdicts), results.json (every run's figures and each variant's over its seeds),
results.png, and its TensorBoard curves of accuracy against training time; each run's time
to the comparison's target accuracy, measured from its log.jsonl."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from . import report, run_logs, stats
from .comparison import Comparison, cpu_name, gpu_name, short
from .figure import plot_results
from .report import VariantResult


def _preamble(comp: Comparison, machine: str, target: stats.Target) -> List[str]:
    a = comp.args
    command = shlex.join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:]) \
        if sys.argv and sys.argv[0].endswith("compare.py") else "(from Python)"
    seeds = f"seed {a.seed}" if a.seeds == 1 else f"seeds {a.seed} to {a.seed + a.seeds - 1}"
    return [
        f"Command: `{command}`",
        "",
        f"- Machine: {machine}; torch {comp.torch_version}, Python {platform.python_version()}",
        f"- Data: {a.dataset} ({short(a.dataset_root)}){subset_words(a.train_subset)} at "
        f"{a.img_size}px; {a.epochs} epochs, batch "
        f"{a.batch_size} (per process under DDP), AdamW lr {a.lr:g}, {seeds}",
        f"- Run: {time.strftime('%Y-%m-%d %H:%M')}; DDP variants: {comp.nproc} processes",
        f"- {target.sentence()}",
    ]


def arch_name(arch: str) -> str:
    return "AlexNet" if arch == "alexnet" else arch


def subset_words(train_subset) -> str:
    return "" if train_subset is None else f", {train_subset} training images"


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


def measure_to_target(comp: Comparison, results: Sequence[VariantResult],
                      target: stats.Target) -> None:
    """Each finished run's time, epochs and images to ``target``, from its log.jsonl."""
    for r in results:
        r.target_acc = target.acc
        hit = None
        if target.acc is not None and r.status == report.OK:
            hit = run_logs.time_to_target(
                run_logs.read_log(comp.run_dir(r.variant, r.seed) / "log.jsonl"), target.acc)
        r.reached_target = None if target.acc is None or r.status != report.OK else bool(hit)
        r.time_to_target_s, r.epochs_to_target, r.images_to_target = (
            (hit.seconds, hit.epoch, hit.images) if hit else (None, None, None))


def write_json(path: Path, results: Sequence[VariantResult],
               summaries: Sequence[stats.SeedSummary], target: stats.Target,
               seeds: int) -> None:
    """results.json: the target and how it was chosen, every run's figures (results.csv's
    columns) and each variant's over its seeds (:func:`stats.variant_figures`)."""
    data = {"target": {"acc": target.acc, "how": target.how},
            "time_to_target": stats.time_rule(seeds),
            "runs": [dataclasses.asdict(r) for r in results],
            "variants": [stats.variant_figures(s) for s in summaries]}
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def write_results(comp: Comparison, results: List[VariantResult],
                  plot: bool = True) -> stats.Target:
    """results.csv, results.md and results.json (and with ``plot`` results.png and the
    TensorBoard curves) of the runs so far, each run's time to target filled in; the
    target."""
    a = comp.args
    machine = (f"{comp.gpus} x {gpu_name()}" if comp.cuda
               else f"CPU: {cpu_name()}, {os.cpu_count()} cores")
    target = stats.choose_target(results, a.target_acc)
    measure_to_target(comp, results, target)
    every = stats.summarise_seeds(results)
    summaries = every if a.seeds > 1 else None
    # Written after every run: a comparison still under way says how far it got.
    ran = len({r.seed for r in results if r.status != report.NOT_RUN})
    so_far = "" if ran == a.seeds else f" ({ran} run so far)"
    summary = ("" if summaries is None else
               f"Over {a.seeds} seeds{so_far}:\n\n{stats.seed_table(summaries)}\n\n"
               f"{stats.RULE}\n\nEvery run:\n")
    report.write_csv(results, comp.dir / "results.csv")
    write_json(comp.dir / "results.json", results, every, target, a.seeds)
    report.write_markdown(results, comp.dir / "results.md",
                          title=f"{arch_name(a.arch)} AMP comparison",
                          preamble=_preamble(comp, machine, target),
                          notes=[*NOTES, stats.time_rule(a.seeds)],
                          summary=summary, show_seed=summaries is not None)
    if not plot:
        return target
    curves = {comp.under(Path(), r.seed) / r.variant: run_logs.accuracy_curve(
        run_logs.read_log(comp.run_dir(r.variant, r.seed) / "log.jsonl"))
        for r in results}
    bars, bands = results, None
    # Several seeds: one bar and one band per variant, over its seeds.
    if summaries is not None:
        bars = [stats.mean_result(s) for s in summaries]
        bands = {s.first.variant: stats.band([curves[comp.under(Path(), r.seed) / r.variant]
                                              for r in s.finished]) for s in summaries}
    # Neither a plot nor TensorBoard may cost the user the table: a failure is a warning.
    figure = None
    try:
        figure = plot_results(
            bars, comp.dir / "results.png", curves={str(k): v for k, v in curves.items()},
            bands=bands, target=target.acc, target_label=target.how,
            title=f"{arch_name(a.arch)}, {a.dataset}{subset_words(a.train_subset)} "
                  f"{a.img_size}px, {a.epochs} epochs, {machine}")
    except Exception as e:
        print(f"compare.py: warning: results.png not written ({e})", file=sys.stderr)
    if a.tensorboard:
        try:
            write_tensorboard(comp.tb_dir, curves, comp.started, figure)
        except Exception as e:
            print(f"compare.py: warning: TensorBoard curves not written ({e})",
                  file=sys.stderr)
    return target


TB_ACCURACY = "compare/val_accuracy_by_train_ms"
TB_FIGURE = "compare/results"


def write_tensorboard(tb_dir: Path, curves: Dict[str, List[Tuple[int, float, float]]],
                      start: float, figure=None) -> None:
    """``compare/val_accuracy_by_train_ms`` in ``tb_dir/<variant>/`` for every variant with a
    curve (``run_logs.accuracy_curve`` points): step = cumulative training time in ms, wall
    time = ``start`` + that time. ``figure`` (the results figure) goes to ``tb_dir`` as
    ``compare/results``."""
    # Imported here: only --tensorboard needs TensorBoard.
    from torch.utils.tensorboard import SummaryWriter

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
