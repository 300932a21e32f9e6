"""compare.py (the side-by-side table of the variants) and benchmark.py."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import FAST_ARCH, IF_VAL_SIZE, event_files, run_main, run_script

from ampkit.models import build_model
from tools import figure, report, run_logs, runner, stats  # AMP/ is on sys.path (conftest)

OK_VARIANTS = ("train_without", "train_DDP")
FAILING = "train_GradScaler"  # forced to fail with an unknown flag


# ------------------------------------------------------------------ unit: report helpers
def test_summarise_log_sums_training_time_and_takes_steady_throughput():
    rows = [{"epoch": 1, "train_time": 10.0, "images_per_s": 50.0, "val_acc": 0.4},
            {"epoch": 2, "train_time": 8.0, "images_per_s": 100.0, "val_acc": 0.7},
            {"epoch": 3, "train_time": 8.5, "images_per_s": 90.0, "val_acc": 0.6},
            {"epoch": 4, "train_time": 7.5, "images_per_s": 110.0, "val_acc": 0.65}]
    s = run_logs.summarise_log(rows)
    assert s["epochs"] == 4
    assert s["train_time_s"] == pytest.approx(34.0)
    assert s["images_per_s"] == pytest.approx(100.0)  # median of the epochs after the first
    assert s["best_val_acc"] == pytest.approx(0.7)
    assert s["peak_mem_mb"] is None  # not in these rows: compare.py measures RSS instead
    one = run_logs.summarise_log([{"epoch": 1, "train_time": 2.0, "images_per_s": 12.0,
                                 "val_acc": 0.5, "peak_mem_mb": 300.0}])
    assert one["images_per_s"] == 12.0 and one["peak_mem_mb"] == 300.0
    # A resumed run appends a row for an epoch it redid: the last one counts, once.
    again = run_logs.summarise_log(rows[:2] + [dict(rows[1], train_time=9.0)])
    assert again["epochs"] == 2 and again["train_time_s"] == pytest.approx(19.0)


def test_accuracy_curve_is_accuracy_against_cumulative_training_time():
    rows = [{"epoch": 1, "train_time": 10.0, "epoch_time": 14.0, "val_acc": 0.4},
            {"epoch": 2, "train_time": 8.0, "epoch_time": 12.0, "val_acc": 0.6},
            # resumed: epoch 2 again; its last row counts, once
            {"epoch": 2, "train_time": 9.0, "epoch_time": 13.0, "val_acc": 0.65},
            {"epoch": 3, "train_time": 7.0, "epoch_time": 11.0, "val_acc": 0.7}]
    assert run_logs.accuracy_curve(rows) == [(1, 10.0, 0.4), (2, 19.0, 0.65), (3, 26.0, 0.7)]
    # rows out of order: the last row of an epoch in the file counts, not the highest epoch
    assert run_logs.accuracy_curve(list(reversed(rows))) == [(1, 10.0, 0.4), (2, 18.0, 0.6),
                                                           (3, 25.0, 0.7)]
    # an epoch without val_acc adds its time but no point
    assert run_logs.accuracy_curve([rows[0], {"epoch": 2, "train_time": 5.0}, rows[3]]) == \
        [(1, 10.0, 0.4), (3, 22.0, 0.7)]
    # unknown training time or a missing epoch: the later points' times are unknown
    assert run_logs.accuracy_curve([rows[0], {"epoch": 2, "val_acc": 0.5}, rows[3]]) == \
        [(1, 10.0, 0.4)]
    assert run_logs.accuracy_curve([rows[0], rows[3]]) == [(1, 10.0, 0.4)]
    assert run_logs.accuracy_curve([rows[1]]) == []
    assert run_logs.accuracy_curve([]) == []


def _result(variant, status="ok", images_per_s=None, peak_mem_mb=None, device="cpu",
            source="log"):
    from tools.variants import TRAIN_VARIANTS

    parallel, precision = TRAIN_VARIANTS[variant]
    return report.VariantResult(variant=variant, parallel=parallel, precision=precision,
                                amp_dtype="" if precision == "fp32" else "bfloat16",
                                device=device, devices=2 if parallel == "ddp" else 1,
                                images_per_s=images_per_s, peak_mem_mb=peak_mem_mb,
                                peak_mem_source=source if peak_mem_mb else "", status=status)


def test_speedups_divide_by_train_without_and_refuse_a_missing_baseline():
    results = [_result("train_without", images_per_s=20.0),
               _result("train_autocast", images_per_s=30.0),
               _result("train_DDP", status="failed", images_per_s=50.0),
               _result("train_DP", images_per_s=None)]
    ratios, note = report.speedups(results)
    assert note == ""
    assert ratios == {"train_without": 1.0, "train_autocast": 1.5, "train_DDP": None,
                      "train_DP": None}
    ratios, note = report.speedups(results[1:])
    assert set(ratios.values()) == {None} and "train_without was not among" in note
    ratios, note = report.speedups([_result("train_without", "failed", 20.0)] + results[1:2])
    assert set(ratios.values()) == {None} and "train_without failed" in note


def test_peak_memory_kind_says_gpu_allocated_or_rss():
    assert report.peak_memory_kind(_result("train_DP", peak_mem_mb=900.0, device="cuda")) == \
        "GPU allocated"
    assert report.peak_memory_kind(_result("train_DP", peak_mem_mb=900.0)) == "process RSS"
    assert report.peak_memory_kind(_result("train_DP", peak_mem_mb=900.0, device="cuda",
                                      source="rss")) == "process RSS"
    assert report.peak_memory_kind(_result("train_DP")) == ""


def _panel_texts(ax):
    return [t.get_text() for t in ax.texts]


def test_plot_results_draws_the_three_views(tmp_path):
    from matplotlib.patches import Rectangle

    results = [_result("train_without", images_per_s=20.0, peak_mem_mb=1000.0),
               _result("train_autocast", images_per_s=30.0, peak_mem_mb=800.0),
               _result("train_DDP", status="failed", peak_mem_mb=1200.0)]
    curves = {"train_without": [(1, 10.0, 0.4), (2, 19.0, 0.6)],
              "train_autocast": [(1, 6.0, 0.3), (2, 12.0, 0.7)],
              "train_DDP": [(1, 30.0, 0.2)]}
    fig = figure.plot_results(results, tmp_path / "r.png", title="t", curves=curves)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    acc, speed, mem = fig.axes
    assert [ax.get_title() for ax in fig.axes] == [
        "accuracy vs training time", "speed-up over train_without (fp32, 1 device)",
        "peak memory per device: process RSS"]
    # 1: one line per variant, x = cumulative training time, y = val accuracy
    lines = acc.get_lines()
    assert [list(ln.get_xdata()) for ln in lines] == [[10.0, 19.0], [6.0, 12.0], [30.0]]
    assert [list(ln.get_ydata()) for ln in lines] == [[0.4, 0.6], [0.3, 0.7], [0.2]]
    labels = [t.get_text() for t in acc.get_legend().get_texts()]
    assert labels == ["train_without", "train_autocast", "train_DDP (failed)"]
    # the legend is outside the axes, over no data
    assert not acc.get_legend().get_window_extent().overlaps(acc.get_window_extent())
    # 2: bars of images/s / train_without's; the failed variant says so instead of a bar
    bars = [p for p in speed.patches if isinstance(p, Rectangle)]
    assert [b.get_width() for b in bars] == [1.0, 1.5]
    assert "failed" in _panel_texts(speed)
    # 3: peak memory, the failed variant's too (it ran), marked by its tick label
    assert [b.get_width() for b in mem.patches] == [1000.0, 800.0, 1200.0]
    assert [t.get_text() for t in mem.get_yticklabels()][2] == "train_DDP (failed)"
    # no baseline: said in the panel, no bars
    fig = figure.plot_results(results[1:], tmp_path / "r2.png", curves=curves)
    assert list(fig.axes[1].patches) == []
    assert any("no baseline: train_without was not among" in t for t in _panel_texts(fig.axes[1]))


def test_write_tensorboard_puts_accuracy_at_the_cumulative_training_time(tmp_path):
    from tools import compare_results

    curves = {"train_without": [(1, 10.0, 0.4), (2, 19.0, 0.6)], "train_DDP": []}
    fig = figure.plot_results([_result("train_without", images_per_s=1.0)], None, curves=curves)
    compare_results.write_tensorboard(tmp_path, curves, 1000.0, fig)
    points = _tb_points(tmp_path / "train_without", compare_results.TB_ACCURACY)
    assert [p[:2] for p in points] == [(10000, 1010.0), (19000, 1019.0)]  # ms of training
    assert [p[2] for p in points] == pytest.approx([0.4, 0.6])
    assert not (tmp_path / "train_DDP").exists()  # nothing to draw: no run
    assert compare_results.TB_FIGURE in _tb_tags(tmp_path, recursive=False)


def _tb_events(folder: Path, recursive: bool = True):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = event_files(folder) if recursive else sorted(folder.glob("events.out.tfevents*"))
    for f in files:
        yield from EventFileLoader(str(f)).Load()


def _tb_tags(folder: Path, recursive: bool = True):
    return {v.tag for ev in _tb_events(folder, recursive) for v in ev.summary.value}


def _tb_points(folder: Path, tag: str):
    """(step, wall time, value) of a scalar, in the order written."""
    from tensorboard.util import tensor_util

    return [(ev.step, ev.wall_time,
             float(tensor_util.make_ndarray(v.tensor)) if v.HasField("tensor") else v.simple_value)
            for ev in _tb_events(folder) for v in ev.summary.value if v.tag == tag]


def test_failure_reason_finds_the_one_line():
    argparse_err = "epoch 1/1:  50%|#####     | 1/2\rtrain_DP.py: error: unrecognized arguments: --x (see --help)\n"
    assert runner.failure_reason(argparse_err, 2) == \
        "train_DP.py: error: unrecognized arguments: --x (see --help)"
    traceback = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                 "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB\n")
    assert runner.failure_reason(traceback, 1).startswith("RuntimeError: CUDA out of memory")
    torchrun = ("train_DDP.py: error: --epochs must be a positive integer, got 0\n"
                "E1130 08:00:00.000 123 torch/distributed/elastic/multiprocessing/api.py:900] "
                "failed (exitcode: 2) local_rank: 0 (pid: 5) of binary: python\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                "============================================================\n"
                "AMP/train_DDP.py FAILED\n------------------------------------------------------------\n"
                "Failures:\n  <NO_OTHER_FAILURES>\nRoot Cause (first observed failure):\n[0]:\n"
                "  rank      : 0 (local_rank: 0)\n  exitcode  : 2 (pid: 5)\n"
                "  error_file: <N/A>\n  traceback : To enable traceback see: "
                "https://pytorch.org/docs/stable/elastic/errors.html\n"
                "============================================================\n")
    assert runner.failure_reason(torchrun, 1) == \
        "train_DDP.py: error: --epochs must be a positive integer, got 0"
    assert "signal 9" in runner.failure_reason("epoch 1/1:  10%|#  | 1/10\r", -9)


def test_parse_eval_output():
    out = ("checkpoint: /x/last.pth\n"
           "top-1 accuracy on ImageFolder test split (64px, 2 processes): 13/21 = 0.6190\n")
    assert run_logs.parse_eval_output(out) == (13, 21)
    assert run_logs.parse_eval_output("no accuracy here\n") is None


def test_compare_flags_are_checked_before_anything_runs(tmp_path):
    import compare

    with pytest.raises(SystemExit) as e:
        compare.parse_args(["--variants", "train_without,train_nope"])
    assert e.value.code == 2
    args = compare.parse_args(["--variants", "train_DP,train_DDP_autocast", "--out", str(tmp_path),
                               "--extra_args", "train_DP=--log_every 5", "--extra_args=--lr=0.1"])
    assert args.variant_list == ["train_DP", "train_DDP_autocast"]
    assert args.extra == {"train_DP": ["--log_every", "5"], None: ["--lr=0.1"]}
    with pytest.raises(SystemExit):
        compare.parse_args(["--extra_args", "train_typo=--x"])


# ------------------------------------------------------------------ end to end: compare.py
@pytest.fixture(scope="module")
def comparison(tmp_path_factory, imagefolder_root):
    """One compare.py run: two variants that work (one DDP on 2 processes), one forced to fail."""
    tmp = tmp_path_factory.mktemp("compare")
    res = run_script("compare", "--variants", ",".join([OK_VARIANTS[0], FAILING, OK_VARIANTS[1]]),
                     "--dataset", "ImageFolder", "--dataset_root", imagefolder_root,
                     "--img_size", "64", "--epochs", "1", "--batch_size", "16", "--lr", "1e-3",
                     "--arch", FAST_ARCH,  # compare's mechanics; AlexNet's runs: test_scripts
                     "--no-cuda", "--out", tmp / "results", "--tensorboard_root", tmp / "tb",
                     "--extra_args", f"{FAILING}=--bogus_flag 1")
    runs = sorted((tmp / "results").iterdir())
    assert len(runs) == 1, res.describe()
    rows = list(csv.DictReader(open(runs[0] / "results.csv", newline="")))
    return res, runs[0], rows, tmp


@pytest.mark.slow
def test_compare_writes_the_three_files_and_prints_the_table(comparison):
    res, out, rows, tmp = comparison
    for name in ("results.csv", "results.md", "results.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, res.describe()
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    for v in (*OK_VARIANTS, FAILING):
        assert v in md and v in res.stdout
    assert "python AMP/compare.py" in md  # the exact command is recorded
    assert "| variant" in res.stdout  # the table, printed at the end
    assert "tensorboard --logdir" in res.stdout
    # every variant's TensorBoard run in one tree, one folder per variant
    tb = tmp / "tb"
    for v in OK_VARIANTS:
        assert event_files(next(tb.glob(f"compare-*/{v}"))), f"no TensorBoard events for {v}"


@pytest.mark.slow
def test_compare_sends_accuracy_against_training_time_to_tensorboard(comparison):
    from tools import compare_results

    res, out, rows, tmp = comparison
    (run,) = (tmp / "tb").glob("compare-*")
    for v in OK_VARIANTS:
        points = _tb_points(run / v, compare_results.TB_ACCURACY)
        log = run_logs.read_log(out / "checkpoint" / v / "log.jsonl")
        # one point, epoch 1's: at its training time (in ms) and the log's accuracy
        assert [p[0] for p in points] == [round(log[0]["train_time"] * 1000)], (v, points)
        assert points[0][2] == pytest.approx(log[0]["val_acc"])
    assert compare_results.TB_ACCURACY not in _tb_tags(run / FAILING)  # no epoch: no curve
    assert compare_results.TB_FIGURE in _tb_tags(run, recursive=False)


@pytest.mark.slow
def test_compare_csv_has_one_row_per_variant_with_sane_numbers(comparison):
    res, out, rows, _ = comparison
    assert [r["variant"] for r in rows] == [OK_VARIANTS[0], FAILING, OK_VARIANTS[1]]
    for r in rows:
        if r["variant"] == FAILING:
            continue
        assert r["status"] == "ok", res.describe()
        assert r["epochs"] == "1"
        for col in ("wall_time_s", "train_time_s", "images_per_s", "peak_mem_mb"):
            assert float(r[col]) > 0, (col, r)
        assert float(r["wall_time_s"]) > float(r["train_time_s"])  # start-up, val, IO not counted
        for col in ("best_val_acc", "test_acc"):
            assert 0.0 <= float(r[col]) <= 1.0, (col, r)
        assert int(r["test_total"]) == IF_VAL_SIZE
    ddp = rows[2]
    assert (ddp["parallel"], ddp["devices"], ddp["device"]) == ("ddp", "2", "cpu")
    assert rows[0]["amp_dtype"] == "" and rows[1]["amp_dtype"] == "bfloat16"


@pytest.mark.slow
def test_a_failing_variant_is_reported_and_the_others_still_run(comparison):
    res, out, rows, _ = comparison
    assert res.returncode == 1, res.describe()  # non-zero: a variant failed
    failed = rows[1]
    assert failed["status"] == "failed"
    assert "unrecognized arguments: --bogus_flag" in failed["reason"]
    assert "\n" not in failed["reason"]
    assert f"{FAILING} FAILED" in res.stdout
    assert "failed: " in (out / "results.md").read_text()
    assert rows[2]["status"] == "ok"  # the variant after the failure still ran


@pytest.mark.slow
@pytest.mark.parametrize("variant", OK_VARIANTS)
def test_compare_test_accuracy_is_what_the_eval_script_prints(comparison, variant):
    res, out, rows, _ = comparison
    row = next(r for r in rows if r["variant"] == variant)
    ckpt = out / "checkpoint" / variant / "last.pth"
    assert Path(row["checkpoint"]) == ckpt
    # compare.py ran the variant's eval script (eval_DDP on 2 processes for train_DDP); the
    # row holds the one line that script printed, in its log.
    eval_log = (out / "logs" / f"{variant}.eval.log").read_text()
    assert f"checkpoint: {ckpt}" in eval_log
    # stdout and stderr (tqdm) share the log, and may share a line: search, not per line
    (correct, total), = [tuple(map(int, m)) for m in
                         re.findall(r"top-1 accuracy [^\n]*?: (\d+)/(\d+) = ", eval_log)]
    assert (int(row["test_correct"]), int(row["test_total"])) == (correct, total)
    assert float(row["test_acc"]) == pytest.approx(correct / total)


# ------------------------------------------------------------------ benchmark.py
@pytest.mark.slow
def test_benchmark_prints_positive_throughput_for_model_and_input_pipeline(tmp_path):
    out = tmp_path / "bench.json"
    res = run_script("benchmark", "--no-cuda", "--variants", "train_without,train_DDP_autocast",
                     "--arch", FAST_ARCH, "--img_size", "64", "--batch_size", "4", "--steps", "2",
                     "--warmup", "1",
                     "--pipeline_batches", "2", "--peak_tflops", "1", "--peak_tflops_fp32",
                     "0.5", "--json", out,
                     "--dataset_root", tmp_path / "no_cifar")  # -> generated CIFAR-format images
    assert res.returncode == 0, res.describe()
    assert "Training step" in res.stdout and "Input pipeline alone" in res.stdout
    data = json.loads(out.read_text())
    assert [s["variant"] for s in data["steps"]] == ["train_without", "train_DDP_autocast"]
    for s in data["steps"]:
        assert s["status"] == "ok", s
        for col in ("step_ms", "images_per_s", "peak_mem_mb", "gflop_per_step",
                    "achieved_tflops", "utilisation"):
            assert s[col] > 0, (col, s)
        assert s["timer"] == "perf_counter" and s["steps"] == 2 and s["warmup"] == 1
    # the same model and batch: the same FLOPs whatever the precision
    assert data["steps"][0]["gflop_per_step"] == pytest.approx(data["steps"][1]["gflop_per_step"])
    # each precision against its own peak: fp32 against --peak_tflops_fp32
    for s, peak in zip(data["steps"], (0.5, 1.0)):
        assert s["utilisation"] == pytest.approx(s["achieved_tflops"] / peak)
    # both input paths, timed by measure_input.measure_input_pipeline on the same data
    pipes = {p["path"]: p for p in data["pipeline"]}
    assert sorted(pipes) == ["classic", "fast"]
    for kind, p in pipes.items():
        assert p["status"] == "ok" and p["images_per_s"] > 0 and p["batches"] == 2, p
        assert p["dataset"].startswith("CIFAR10 (generated"), p
        # the printed table carries the same positive numbers
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith(kind + " "))
        assert float(line.split()[-1]) > 0, line


@pytest.mark.parametrize("channels_last", [False, True])
def test_benchmark_channels_last_reaches_the_model_and_its_inputs(monkeypatch, channels_last):
    """benchmark.py --channels_last measures what training with --channels_last runs."""
    import torch

    from tools import step_throughput
    from ampkit.models import build_model

    seen = []

    def hooked(*args, **kw):
        model = build_model(*args, **kw)
        cl = torch.channels_last
        model.features[0].register_forward_pre_hook(lambda mod, inp: None if inp[0].is_meta
                                                    else seen.append(
            (inp[0].is_contiguous(memory_format=cl), mod.weight.is_contiguous(memory_format=cl))))
        return model

    monkeypatch.setattr(step_throughput, "build_model", hooked)
    r = step_throughput.measure_variant("train_without", device=torch.device("cpu"), batch_size=2,
                                      img_size=64, warmup=1, steps=1, channels_last=channels_last)
    assert r.status == "ok" and r.channels_last is channels_last and r.images_per_s > 0
    assert len(seen) == 2  # warm-up step, timed step (the FLOP count's is on the meta device)
    assert seen == [(channels_last, channels_last)] * 2


def test_benchmark_reads_nothing_back_inside_its_timed_window(monkeypatch):
    """The loop's host read (every --log_every steps: progress bar, stop and divergence
    checks) syncs the host with the device; none may fall inside the timed steps."""
    import torch

    from ampkit import engine
    from tools import step_throughput

    timing, reads = [False], []
    real_timed, real_check = step_throughput._timed, engine._host_check

    def timed(fn, device):
        timing[0] = True
        try:
            return real_timed(fn, device)
        finally:
            timing[0] = False

    def check(*args, **kwargs):
        reads.append(timing[0])
        return real_check(*args, **kwargs)

    monkeypatch.setattr(step_throughput, "_timed", timed)
    monkeypatch.setattr(engine, "_host_check", check)
    r = step_throughput.measure_variant("train_without", device=torch.device("cpu"), batch_size=2,
                                      img_size=32, warmup=0, steps=21, arch="squeezenet1_1")
    assert r.status == "ok" and r.steps == 21
    assert True not in reads, "a host read inside the timed window"


def test_benchmark_speedup_is_over_the_fp32_row_of_the_same_parallel_mode():
    from tools import tables
    from tools.step_throughput import StepResult

    def row(variant, parallel, precision, images_per_s, **kw):
        return StepResult(variant=variant, parallel=parallel, precision=precision,
                          amp_dtype="", arch="alexnet", device="cuda", devices=1,
                          batch_size=256, img_size=227, warmup=1, steps=2,
                          images_per_s=images_per_s, **kw)

    rows = [row("train_without", "single", "fp32", 100.0),
            row("train_autocast", "single", "autocast", 250.0),
            row("train_DDP", "ddp", "fp32", 90.0),
            row("train_DDP_GradScaler", "ddp", "grad_scaler", 270.0),
            row("train_autocast", "single", "autocast", 400.0, channels_last=True),  # no base
            row("train_GradScaler", "single", "grad_scaler", 0.0, status="failed")]
    tables.add_speedups(rows)
    assert [r.speedup for r in rows] == [1.0, 2.5, 1.0, 3.0, None, None]
    table = tables.step_table(rows)
    assert "x fp32" in table.splitlines()[0] and " 2.50 " in table and " 3.00 " in table


def test_peaks_by_gpu_name_and_none_for_an_unknown_one():
    from ampkit.device import fp32_peak_math, peak_tflops

    assert peak_tflops("NVIDIA H200", "half") == 989 and peak_tflops("NVIDIA H200", "tf32") == 495
    assert peak_tflops("NVIDIA H200 NVL", "half") == 835  # not the SXM's
    assert peak_tflops("NVIDIA H100 PCIe", "fp32") == 51
    assert peak_tflops("NVIDIA H100 80GB HBM3", "half") == 989
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156
    assert peak_tflops("NVIDIA GeForce RTX 4090", "half") == 165
    assert peak_tflops("NVIDIA L40S", "fp32") == 91.6
    assert peak_tflops("Tesla T4", "half") is None
    # A name is matched as whole words: an RTX A1000 laptop GPU is no A100.
    assert peak_tflops("NVIDIA RTX A1000 6GB Laptop GPU", "half") is None
    assert peak_tflops("NVIDIA A10", "half") is None
    assert fp32_peak_math("fp32") == "fp32" and fp32_peak_math("tf32 conv, fp32 matmul") == "tf32"


# ------------------------------------------------------------------ --seeds: the statistics
def test_welch_p_values_are_students():
    """Against the t table: two-sided 5 % at 1, 2 and 4 degrees of freedom, and the normal
    limit; a difference of nothing is p = 1."""
    from tools.stats import t_two_sided_p, welch

    for t, df in [(12.7062, 1), (4.302653, 2), (2.776445, 4), (1.959964, 1e6)]:
        assert t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-5), (t, df)
    assert t_two_sided_p(0.0, 3) == pytest.approx(1.0)
    d = welch([0.80, 0.82, 0.81], [0.70, 0.71, 0.69])
    assert d.diff == pytest.approx(0.11) and d.p < 0.001 and not d.within_noise
    assert welch([0.80, 0.82, 0.81], [0.81, 0.79, 0.80]).within_noise
    assert welch([0.8], [0.7, 0.71]) is None  # one run says nothing of noise


def _fake_children(monkeypatch, accuracies, fail=(), seconds=None):
    """compare.py's children, faked: a training command writes the log.jsonl and last.pth a
    run would, 2 epochs with ``accuracies[(variant, seed)]`` as its final validation
    accuracy (0.1 less after epoch 1) and ``seconds[(variant, seed)]`` (2.0 by default) as
    each epoch's training time, and an eval command prints it (as c/1000); the (variant,
    seed) in ``fail`` exit 1. Returns the list the commands go to."""
    from tools import runner

    def run_child(cmd, log_path=None, env=None, **kw):
        commands.append(cmd)
        seed = int(cmd[cmd.index("--seed") + 1]) if "--seed" in cmd else None
        script = next(Path(c).stem for c in cmd if c.endswith(".py"))
        if script.startswith("eval"):
            ckpt = Path(cmd[cmd.index("--checkpoint") + 1])
            acc = json.loads((ckpt.parent / "log.jsonl").read_text().splitlines()[-1])["val_acc"]
            out = f"top-1 accuracy on ImageFolder test split (64px): {round(acc * 1000)}/1000 = {acc:.4f}\n"
            return runner.ChildRun(0, out, "", 1.0, 100.0)
        if (script, seed) in fail:
            return runner.ChildRun(1, "", f"{script}.py: error: boom on seed {seed}\n", 0.5, 50.0)
        root = Path(cmd[cmd.index("--checkpoint") + 1])
        run_dir = root / script
        run_dir.mkdir(parents=True)
        key = (root.name if "+" in root.name else script, seed)
        acc, train_time = accuracies[key], (seconds or {}).get(key, 2.0)
        (run_dir / "log.jsonl").write_text("".join(json.dumps(
            {"epoch": e, "train_time": train_time, "images_per_s": 100.0 + seed,
             "val_acc": acc - 0.1 * (2 - e),
             "peak_mem_mb": 500.0, "tflops": 0.5}) + "\n" for e in (1, 2)))
        (run_dir / "last.pth").write_bytes(b"")
        return runner.ChildRun(0, "", "", 10.0 + seed, 500.0)

    commands = []
    monkeypatch.setattr(runner, "run_child", run_child)
    return commands


def test_seeds_give_every_run_a_row_and_each_variant_its_spread_and_verdict(
        tmp_path, monkeypatch, capsys):
    """3 seeds of 5 variants: train_autocast beats train_without by 10 points on every
    seed (beyond noise), train_GradScaler by a point up and down (within noise) and its
    seed 1 fails: the table counts its 2 finished runs, the exit status is 1. DDP's
    variants are against DDP's own fp32 run (half the steps of one process's: another
    accuracy), not against train_without's."""
    import compare

    accs = {("train_without", s): a for s, a in enumerate([0.70, 0.72, 0.71])}
    accs |= {("train_autocast", s): a for s, a in enumerate([0.81, 0.82, 0.80])}
    accs |= {("train_GradScaler", s): a for s, a in enumerate([0.72, 0.0, 0.70])}
    accs |= {("train_DDP", s): a for s, a in enumerate([0.50, 0.52, 0.51])}
    accs |= {("train_DDP_autocast", s): a for s, a in enumerate([0.51, 0.53, 0.52])}
    _fake_children(monkeypatch, accs, fail={("train_GradScaler", 1)})
    code = compare.main(["--variants", "train_without,train_autocast,train_GradScaler,"
                         "train_DDP,train_DDP_autocast",
                         "--seeds", "3", "--no-cuda", "--epochs", "2", "--no-tensorboard",
                         "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    (run,) = tmp_path.iterdir()
    rows = list(csv.DictReader(open(run / "results.csv", newline="")))
    assert [(r["variant"], r["seed"]) for r in rows] == [
        (v, str(s)) for s in range(3) for v in ("train_without", "train_autocast",
                                                 "train_GradScaler", "train_DDP",
                                                 "train_DDP_autocast")]
    assert {r["status"] for r in rows if (r["variant"], r["seed"]) != ("train_GradScaler", "1")} \
        == {"ok"}
    table = out[out.index("Over 3 seeds:"):]
    line = {v: next(ln for ln in table.splitlines() if ln.startswith(f"| {v} |"))
            for v in ("train_without", "train_autocast", "train_GradScaler", "train_DDP",
                      "train_DDP_autocast")}
    assert "(the baseline)" in line["train_DDP"]
    assert "+0.0100 ±" in line["train_DDP_autocast"], line["train_DDP_autocast"]
    assert "within seed noise" in line["train_DDP_autocast"]
    assert "(the baseline)" in line["train_without"] and "3/3" in line["train_without"]
    assert "+0.1000 ±" in line["train_autocast"] and "beyond seed noise" in line["train_autocast"]
    assert "2/3 (seed 1 failed)" in line["train_GradScaler"]
    assert "within seed noise" in line["train_GradScaler"]
    assert "0.7100 ± 0.0141 (0.7000–0.7200)" in line["train_GradScaler"]  # seeds 0 and 2 only
    assert "Welch's t-test" in out and "Welch's t-test" in (run / "results.md").read_text()
    for seed in range(3):
        assert (run / "checkpoint" / f"seed{seed}" / "train_without" / "log.jsonl").is_file()
    assert (run / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_a_comparison_under_way_says_how_many_seeds_its_tables_hold(tmp_path, monkeypatch,
                                                                     capsys):
    """results.md is written after every run, so that a long comparison keeps what it has:
    read while seed 1 runs, it says its table is over 1 seed of the 2 asked for."""
    import compare

    accs = {(v, s): 0.7 + s / 100 for v in ("train_without", "train_autocast") for s in (0, 1)}
    commands = _fake_children(monkeypatch, accs)
    from tools import runner
    fake, seen = runner.run_child, []

    def run_child(cmd, *a, **kw):
        if "--seed" in cmd and cmd[cmd.index("--seed") + 1] == "1" and not seen:
            (run,) = tmp_path.iterdir()
            seen.append((run / "results.md").read_text())
        return fake(cmd, *a, **kw)

    monkeypatch.setattr(runner, "run_child", run_child)
    assert compare.main(["--variants", "train_without,train_autocast", "--seeds", "2",
                         "--no-cuda", "--epochs", "2", "--no-tensorboard",
                         "--out", str(tmp_path)]) == 0
    assert commands and "Over 2 seeds (1 run so far):" in seen[0], seen
    (run,) = tmp_path.iterdir()
    assert "Over 2 seeds:" in (run / "results.md").read_text()


def test_one_seed_keeps_todays_table_and_folders(tmp_path, monkeypatch, capsys):
    import compare

    _fake_children(monkeypatch, {("train_without", 0): 0.7, ("train_autocast", 0): 0.8})
    assert compare.main(["--variants", "train_without,train_autocast", "--no-cuda",
                         "--no-tensorboard", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (run,) = tmp_path.iterdir()
    assert (run / "checkpoint" / "train_without" / "log.jsonl").is_file()
    assert "verdict" not in out and "seed" not in (run / "results.md").read_text().split(
        "| variant")[1].splitlines()[0]
    assert "| train_autocast |" in out


@pytest.mark.parametrize("seeds", ["0", "-2"])
def test_seeds_below_one_are_one_line(seeds, capsys):
    import compare

    with pytest.raises(SystemExit) as e:
        compare.parse_args(["--seeds", seeds])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--seeds must be a positive integer" in err[0]


def test_a_script_with_flags_of_its_own_is_a_variant_against_its_plain_runs(
        tmp_path, monkeypatch, capsys):
    """``train_DDP_GradScaler+bf16comm`` runs train_DDP_GradScaler with the flags its
    --extra_args give it (the plain one without them), in a folder of its own, and its
    verdict is against the plain script's runs (no train_DDP ran): five points down on
    every seed is beyond their noise."""
    import compare

    plain, hooked = "train_DDP_GradScaler", "train_DDP_GradScaler+bf16comm"
    accs = {(plain, s): a for s, a in enumerate([0.50, 0.52, 0.51])}
    accs |= {(hooked, s): a - 0.05 for (_, s), a in accs.items()}
    commands = _fake_children(monkeypatch, accs)
    assert compare.main(["--variants", f"{plain},{hooked}", "--seeds", "3",
                         "--extra_args", f"{hooked}=--comm_hook bf16", "--no-cuda",
                         "--no-tensorboard", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    trains = [c for c in commands if "--epochs" in c]  # not the eval commands
    assert len(trains) == 6 and all(c[c.index("--nproc_per_node=2") + 1].endswith(
        f"{plain}.py") for c in trains)
    assert [c[-2:] == ["--comm_hook", "bf16"] for c in trains] == [False, True] * 3
    (run,) = tmp_path.iterdir()
    for seed in range(3):
        assert (run / "checkpoint" / f"seed{seed}" / hooked / plain / "log.jsonl").is_file()
    line = next(ln for ln in out[out.index("Over 3 seeds:"):].splitlines()
                if ln.startswith(f"| {hooked} |"))
    assert "-0.0500 ±" in line and "beyond seed noise" in line, line


def test_a_labelled_variant_inherits_its_scripts_flags(tmp_path, monkeypatch, capsys):
    """``SCRIPT+LABEL`` is SCRIPT's run plus one change: SCRIPT's own --extra_args come first,
    then the label's, so its verdict against SCRIPT measures the label's change alone; and
    --amp_dtype reaches only the scripts that compute in low precision (the fp32 ones refuse
    it)."""
    import compare

    plain, hooked = "train_DDP_GradScaler", "train_DDP_GradScaler+bf16comm"
    accs = {(v, 0): 0.5 for v in (plain, hooked, "train_without")}
    commands = _fake_children(monkeypatch, accs)
    assert compare.main(["--variants", f"train_without,{plain},{hooked}",
                         "--extra_args", f"{plain}=--accum_steps 2",
                         "--extra_args", f"{hooked}=--comm_hook bf16", "--amp_dtype", "bfloat16",
                         "--no-cuda", "--no-tensorboard", "--out", str(tmp_path)]) == 0
    without, plain_run, hooked_run = [c for c in commands if "--epochs" in c]
    assert plain_run[-2:] == ["--accum_steps", "2"]
    assert hooked_run[-4:] == ["--accum_steps", "2", "--comm_hook", "bf16"]
    assert "--amp_dtype" not in without and "bfloat16" in plain_run


def test_the_training_subset_reaches_training_and_the_figure_not_the_eval(tmp_path, monkeypatch,
                                                                          capsys):
    """--train_subset is a train script's flag: the eval script, which has no such flag,
    tests on the whole test set; the results and their figure name the subset."""
    import compare

    commands = _fake_children(monkeypatch, {("train_without", 0): 0.5})
    assert compare.main(["--variants", "train_without", "--train_subset", "600", "--no-cuda",
                         "--no-tensorboard", "--out", str(tmp_path)]) == 0
    train, evaluate = commands
    assert train[train.index("--train_subset") + 1] == "600" and "--train_subset" not in evaluate
    assert "600 training images" in next(tmp_path.rglob("results.md")).read_text()


@pytest.mark.parametrize("variants, extra, says", [
    ("train_DDP+bf16comm", [], "no --extra_args 'train_DDP+bf16comm=FLAGS'"),
    ("train_DDP+a/b", ["--extra_args", "train_DDP+a/b=--comm_hook bf16"], "a label of letters"),
    ("train_nope+x", ["--extra_args", "train_nope+x=--comm_hook bf16"], "unknown variant"),
])
def test_a_labelled_variant_without_flags_or_with_a_bad_name_is_one_line(
        variants, extra, says, capsys):
    import compare

    with pytest.raises(SystemExit) as e:
        compare.parse_args(["--variants", variants, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and says in err[-1], err


def test_benchmark_times_a_ddp_row_per_comm_hook_with_the_bytes_its_hook_sent():
    """In a group of one process the hooks still run: bf16 sends half of fp32's bytes a step,
    PowerSGD (compressing from the third step, after the warm-up) its rank-1 factors."""
    import torch

    from tools.step_throughput import DDPGroup, measure_variant

    group = DDPGroup(cuda=False)
    try:
        rows = {hook: measure_variant("train_DDP", device=torch.device("cpu"), batch_size=2,
                                      img_size=32, warmup=2, steps=2, arch="squeezenet1_1",
                                      ddp=group, comm_hook=hook)
                for hook in ("none", "bf16", "powersgd")}
    finally:
        group.close()
    params_mb = sum(p.numel() for p in build_model("squeezenet1_1", 10).parameters()) * 4 / 1e6
    assert rows["none"].wire_mb_per_step == pytest.approx(params_mb)
    assert rows["bf16"].wire_mb_per_step == pytest.approx(params_mb / 2)
    assert 0 < rows["powersgd"].wire_mb_per_step < params_mb / 5
    assert [r.comm_hook for r in rows.values()] == ["none", "bf16", "powersgd"]


@pytest.mark.parametrize("flags, says", [
    (["--variants", "train_without", "--comm_hook", "bf16"], "applies to the DDP variants"),
    (["--variants", "train_DDP", "--comm_hook", "powersgd", "--warmup", "1"], "--warmup 2"),
    (["--variants", "train_DDP", "--comm_hook", "none,zip"], "distinct hooks"),
])
def test_benchmark_comm_hook_flags_it_cannot_honour_are_one_line(flags, says, capsys):
    import benchmark

    with pytest.raises(SystemExit) as e:
        benchmark.parse_args(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and says in err[-1], err


def test_the_gpus_busy_share_counts_each_instant_once():
    """benchmark.py --busy: the kernels' intervals, merged where streams overlap, over the
    wall time; on the CPU there is no kernel to count."""
    from tools.step_throughput import covered_us, gpu_busy_share

    assert covered_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert covered_us([]) == 0
    assert gpu_busy_share(lambda: torch.ones(8).sum(), torch.device("cpu")) == 0.0


def test_busy_share_records_cuda_activity_alone(monkeypatch):
    """--busy's profiler records the GPU's kernels and no host op: recording the host's ops
    would slow the host whose waits the share measures, an eager step more than a CUDA
    graph replay. Its kernels' intervals, merged, over the wall time: the share."""
    import contextlib
    from types import SimpleNamespace

    import torch.profiler
    from helpers.machines import pretend_machine
    from tools.step_throughput import gpu_busy_share

    asked, cuda = [], torch.autograd.DeviceType.CUDA
    kernels = [SimpleNamespace(device_type=kind, time_range=SimpleNamespace(start=a, end=b))
               for kind, a, b in [(cuda, 0, 0.5), (torch.autograd.DeviceType.CPU, 0, 9e9)]]

    @contextlib.contextmanager
    def profile(activities):
        asked.append(list(activities))
        yield SimpleNamespace(events=lambda: kernels)

    pretend_machine(monkeypatch, "cuda", 1)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.profiler, "profile", profile)
    share = gpu_busy_share(lambda: None, torch.device("cuda"))
    assert asked == [[torch.profiler.ProfilerActivity.CUDA]]
    assert 0 < share < 1  # half a microsecond of kernels, not the host's span


def test_benchmark_refuses_cuda_graphs_off_one_device_in_one_line(capsys):
    """--compile reduce-overhead: a row that cannot take CUDA graphs says why in one line."""
    import benchmark

    code = benchmark.main(["--no-cuda", "--variants", "train_DDP", "--compile", "reduce-overhead",
                           "--steps", "1", "--warmup", "0", "--pipeline", "none",
                           "--batch_size", "2", "--img_size", "64"])
    out = capsys.readouterr().out
    assert code == 1 and "failed: --compile reduce-overhead (CUDA graphs) is for one device" in out


# ------------------------------------------------------------------ time to a target accuracy
def test_time_to_target_is_the_first_epoch_whose_accuracy_reaches_it():
    """The training loops' time, the epoch and the images (images/s x training time, epoch by
    epoch) to the end of the first epoch at or above the target; None where none is."""
    rows = [{"epoch": 1, "train_time": 10.0, "images_per_s": 50.0, "val_acc": 0.4},
            {"epoch": 2, "train_time": 8.0, "images_per_s": 100.0, "val_acc": 0.7},
            {"epoch": 3, "train_time": 8.0, "images_per_s": 100.0, "val_acc": 0.65},
            {"epoch": 4, "train_time": 6.0, "images_per_s": 150.0, "val_acc": 0.8}]
    reach = run_logs.time_to_target
    assert reach(rows, 0.7) == run_logs.Reached(2, 18.0, 1300)  # exactly the target counts
    assert reach(rows, 0.75) == run_logs.Reached(4, 32.0, 3000)  # after a dip below it
    assert reach(rows, 0.3) == run_logs.Reached(1, 10.0, 500)
    assert reach(rows, 0.81) is None
    # a resumed epoch's last row counts: here it fell short of the target
    assert reach(rows[:2] + [dict(rows[1], train_time=9.0, val_acc=0.6)], 0.7) is None
    # no images/s in a row: the time and epoch stand, the images are unknown
    assert reach([rows[0], {k: v for k, v in rows[1].items() if k != "images_per_s"}], 0.7) \
        == run_logs.Reached(2, 18.0, None)
    # an epoch of unknown training time: no later epoch's time is claimed
    assert reach([rows[0], {"epoch": 2, "val_acc": 0.9}], 0.7) is None


def _finished(script, test_acc, **figures):
    r = _result(script)
    r.test_acc = test_acc
    for k, v in figures.items():
        setattr(r, k, v)
    return r


def test_the_target_is_the_fp32_baselines_mean_accuracy_less_its_seed_spread():
    runs = [_finished("train_DP", 0.5), *(_finished("train_without", a) for a in (0.70, 0.72, 0.74)),
            _finished("train_without", 0.99, status="failed"), _finished("train_autocast", 0.9)]
    t = stats.choose_target(runs)
    assert t.acc == pytest.approx(0.70)  # train_without's, though train_DP finished first
    assert t.how == ("target: 0.7000 = train_without's mean final test accuracy 0.7200 less "
                     "its seed sd 0.0200 (3 runs)")
    assert stats.choose_target(runs, 0.6) == stats.Target(0.6, "target: 0.6000 (--target_acc)")
    one = stats.choose_target(runs[:2])
    assert one.acc == pytest.approx(0.70) and "one run: no seed spread" in one.how
    # without train_without: the first plain fp32 variant to finish, not a labelled one
    ddp = [_finished("train_DDP_autocast", 0.9), _finished("train_DDP", 0.9, variant="train_DDP+x"),
           _finished("train_DDP", 0.6), _finished("train_DP", 0.4)]
    assert stats.choose_target(ddp).acc == pytest.approx(0.6)
    assert "train_DDP's final test accuracy" in stats.choose_target(ddp).how
    none = stats.choose_target(ddp[:2])
    assert none.acc is None and none.how.startswith("no target: no fp32 baseline")


def test_time_to_target_over_seeds_counts_the_runs_that_reached_it():
    """Mean ± sd over the runs that reached the target (k of n finished), and Welch's test
    on those times against the baseline's."""
    def runs(variant, times):
        return [_finished(variant, 0.8, seed=i, target_acc=0.7, reached_target=t is not None,
                          time_to_target_s=t, epochs_to_target=t and 2,
                          images_to_target=t and 100) for i, t in enumerate(times)]

    results = (runs("train_without", [10.0, 10.5, 9.5]) + runs("train_autocast", [5.0, 5.5, 4.5])
               + runs("train_GradScaler", [10.2, None, 9.6]))
    rows = {r[0]: dict(zip(stats.SEED_HEADER, r))
            for r in stats.seed_rows(stats.summarise_seeds(results))}
    assert rows["train_without"]["time to target"] == "10.0s ± 0.5s (9.5s–10.5s), 3 of 3 reached"
    assert rows["train_without"]["time verdict"] == "(the baseline)"
    assert rows["train_autocast"]["Δ time to target vs baseline"] == "-5.0s ± 0.4s"
    # p is ~0.0003: said as such, not rounded to "p = 0.00".
    assert rows["train_autocast"]["time verdict"] == "beyond seed noise (p < 0.01)"
    assert rows["train_GradScaler"]["time to target"] == \
        "9.9s ± 0.4s (9.6s–10.2s), 2 of 3 reached"
    assert rows["train_GradScaler"]["time verdict"].startswith("within seed noise (p = ")
    figures = stats.variant_figures(stats.summarise_seeds(results)[2])
    assert figures["reached_target"] == 2 and figures["finished"] == 3
    assert figures["time_to_target_s"]["n"] == 2
    assert figures["time_to_target_delta"]["diff"] == pytest.approx(-0.1)
    # no target: nothing measured, nothing to say
    for r in results:
        r.reached_target = r.time_to_target_s = None
    row = stats.seed_rows(stats.summarise_seeds(results))[1]
    assert row[-3:] == ["-", "-", "-"]


def test_seeds_give_each_variant_its_time_to_the_automatic_target(tmp_path, monkeypatch, capsys):
    """3 seeds: the target is train_without's mean final accuracy (0.72) less its seed sd
    (0.0265), 0.6935; train_autocast reaches it an epoch sooner (beyond noise),
    train_GradScaler as fast on two seeds and never on the third; DDP's autocast is timed
    against train_DDP, as fast, not against train_without. The figure gets the target."""
    import compare
    from tools import compare_results

    accs = {("train_without", s): a for s, a in enumerate([0.70, 0.71, 0.75])}
    accs |= {("train_autocast", s): a for s, a in enumerate([0.80, 0.81, 0.82])}
    accs |= {("train_GradScaler", s): a for s, a in enumerate([0.80, 0.69, 0.82])}
    accs |= {(v, s): a for v in ("train_DDP", "train_DDP_autocast")
             for s, a in enumerate([0.75, 0.76, 0.77])}
    secs = {("train_without", s): t for s, t in enumerate([2.0, 2.2, 1.8])}
    secs |= {("train_autocast", s): t for s, t in enumerate([1.0, 1.1, 0.9])}
    secs |= {("train_GradScaler", s): t for s, t in enumerate([4.1, 1.0, 3.7])}
    secs |= {("train_DDP", s): t for s, t in enumerate([1.0, 1.1, 0.9])}
    secs |= {("train_DDP_autocast", s): t for s, t in enumerate([1.05, 1.0, 0.95])}
    _fake_children(monkeypatch, accs, seconds=secs)
    drawn = []
    real_plot = compare_results.plot_results
    monkeypatch.setattr(compare_results, "plot_results",
                        lambda *a, **kw: drawn.append(kw) or real_plot(*a, **kw))
    variants = ["train_without", "train_autocast", "train_GradScaler", "train_DDP",
                "train_DDP_autocast"]
    assert compare.main(["--variants", ",".join(variants), "--seeds", "3", "--no-cuda",
                         "--no-tensorboard", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    how = ("target: 0.6935 = train_without's mean final test accuracy 0.7200 less its seed "
           "sd 0.0265 (3 runs)")
    assert f"T{how[1:]}." in out and stats.time_rule(3) in out
    table = out[out.index("Over 3 seeds:"):]
    line = {v: dict(zip(stats.SEED_HEADER, [c.strip() for c in next(
        ln for ln in table.splitlines() if ln.startswith(f"| {v} |")).split("|")[1:-1]]))
        for v in variants}
    assert line["train_without"]["time to target"] == "4.0s ± 0.4s (3.6s–4.4s), 3 of 3 reached"
    assert line["train_autocast"]["Δ time to target vs baseline"] == "-3.0s ± 0.2s"
    assert line["train_autocast"]["time verdict"].startswith("beyond seed noise")
    assert line["train_GradScaler"]["time to target"].endswith("2 of 3 reached")
    assert line["train_GradScaler"]["time verdict"].startswith("within seed noise")
    assert line["train_DDP_autocast"]["time verdict"].startswith("within seed noise")
    (run,) = tmp_path.iterdir()
    assert f"- T{how[1:]}" in (run / "results.md").read_text()
    rows = {(r["variant"], r["seed"]): r for r in csv.DictReader(open(run / "results.csv"))}
    base = rows[("train_without", "1")]
    assert float(base["target_acc"]) == pytest.approx(0.6935425, abs=1e-7)
    assert (base["reached_target"], base["epochs_to_target"], base["images_to_target"]) == \
        ("True", "2", "444")  # 101 images/s x 2.2 s, twice
    assert float(base["time_to_target_s"]) == pytest.approx(4.4)
    missed = rows[("train_GradScaler", "1")]
    assert (missed["reached_target"], missed["time_to_target_s"]) == ("False", "")
    data = json.loads((run / "results.json").read_text())
    assert data["target"]["how"] == how and data["time_to_target"] == stats.time_rule(3)
    assert [(r["variant"], r["seed"]) for r in data["runs"]] == [
        (v, s) for s in range(3) for v in variants]
    assert data["runs"][0]["time_to_target_s"] == pytest.approx(4.0)
    per = {v["variant"]: v for v in data["variants"]}
    assert per["train_GradScaler"]["reached_target"] == 2
    assert per["train_GradScaler"]["time_to_target_s"]["mean"] == pytest.approx(3.9)
    assert per["train_autocast"]["time_to_target_delta"]["diff"] == pytest.approx(-3.0)
    assert per["train_DDP_autocast"]["baseline"] == "train_DDP"
    assert drawn[-1]["target"] == pytest.approx(0.6935425, abs=1e-7)
    assert drawn[-1]["target_label"] == how


def test_one_seed_times_each_run_to_the_baselines_own_accuracy(tmp_path, monkeypatch, capsys):
    import compare

    _fake_children(monkeypatch, {("train_without", 0): 0.7, ("train_autocast", 0): 0.8,
                                 ("train_GradScaler", 0): 0.65})
    assert compare.main(["--variants", "train_without,train_autocast,train_GradScaler",
                         "--no-cuda", "--no-tensorboard", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Target: 0.7000 = train_without's final test accuracy (one run: no seed spread " \
           f"to subtract).\n{stats.TIME_RULE}\n" in out
    header = next(ln for ln in out.splitlines() if ln.startswith("| variant"))
    column = [c.strip() for c in header.split("|")].index("time to target")
    cells = {ln.split("|")[1].strip(): ln.split("|")[column].strip()
             for ln in out.splitlines() if ln.startswith("| train_")}
    assert cells == {"train_without": "4.0s (epoch 2, 400 images)",
                     "train_autocast": "2.0s (epoch 1, 200 images)",
                     "train_GradScaler": "not reached"}


def test_a_given_target_is_the_one_used_and_said(tmp_path, monkeypatch, capsys):
    import compare

    _fake_children(monkeypatch, {("train_without", 0): 0.7})
    assert compare.main(["--variants", "train_without", "--target_acc", "0.55", "--no-cuda",
                         "--no-tensorboard", "--out", str(tmp_path)]) == 0
    assert "Target: 0.5500 (--target_acc)." in capsys.readouterr().out
    (row,) = csv.DictReader(open(next(tmp_path.rglob("results.csv"))))
    assert (row["target_acc"], row["epochs_to_target"]) == ("0.55", "1")


@pytest.mark.parametrize("value", ["0", "1.01", "-0.5", "nan", "inf", "80%"])
def test_a_target_accuracy_outside_0_to_1_is_one_line(value, capsys):
    import compare

    with pytest.raises(SystemExit) as e:
        compare.parse_args(["--target_acc", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "--target_acc" in err[0] and "(0, 1]" in err[0] and repr(value) in err[0]
    assert compare.parse_args(["--target_acc", "1"]).target_acc == 1.0


def test_the_figure_draws_the_target_as_a_labelled_line():
    curves = {"train_without": [(1, 10.0, 0.4), (2, 19.0, 0.6)]}
    fig = figure.plot_results([_result("train_without", images_per_s=1.0)], None, curves=curves,
                              target=0.55, target_label="target: 0.5500 (--target_acc)")
    acc = fig.axes[0]
    assert [list(ln.get_ydata()) for ln in acc.get_lines()][1] == [0.55, 0.55]
    assert [t.get_text() for t in acc.get_legend().get_texts()] == ["train_without",
                                                                    "target 0.5500"]
    assert "target: 0.5500 (--target_acc)" in _panel_texts(acc)
    fig = figure.plot_results([_result("train_without", images_per_s=1.0)], None, curves=curves)
    assert len(fig.axes[0].get_lines()) == 1  # no target, no line


@pytest.mark.parametrize("script", ["compare", "benchmark", "train_DDP", "eval_DP"])
def test_help_says_each_default_once(script):
    """An option's help says its default once: in its own words, or argparse's "(default:
    X)" where it has a value; never twice, never "(default: None)". The train and eval
    scripts' flags too (their one formatter, ampkit.flags.DefaultsOnce)."""
    import argparse

    import compare
    from ampkit.flags import eval_parser, train_parser
    from tools import benchmark_flags

    parser = {"compare": compare.build_parser, "benchmark": benchmark_flags.build_parser,
              "train_DDP": lambda: train_parser("train_DDP", process_group=True),
              "eval_DP": lambda: eval_parser("eval_DP")}[script]()
    res = run_main(script, "--help")
    assert res.returncode == 0, res.describe()
    blocks, text = {}, res.stdout.split("\noptions:\n", 1)[1]
    for line in text.splitlines():
        if re.match(r"\s{2}-", line):
            name = line.split()[0].rstrip(",")
            blocks[name] = ""
        if blocks:
            blocks[name] += " " + line
    assert {"--seeds", "--steps", "--lr", "--autocast"} & set(blocks)
    for action in parser._actions:
        if not action.option_strings or action.option_strings[0] == "-h":
            continue
        said = " ".join(blocks[action.option_strings[0]].split())
        assert "(default: None)" not in said, said
        count = len(re.findall(r"\bdefault\b", said, re.IGNORECASE))
        has_value = action.default not in (None, []) and (
            action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction))
        assert count == (1 if has_value else count) and count <= 1, said
