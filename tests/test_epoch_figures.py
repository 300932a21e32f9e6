"""A figure means what its name says: an epoch's count is that epoch's, its peak that epoch's
peak, and every epoch of every variant trains in a new order."""
from __future__ import annotations

import json
import socket
from functools import partial

import pytest
import torch
from torch import nn

from conftest import quick_flags, run_main

CPU = torch.device("cpu")


def _tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def _run(script: str, argv: list, capsys=None) -> tuple:
    """conftest.run_main's run: (exit status, stdout, stderr)."""
    return tuple(run_main(script, *argv))


_args = partial(quick_flags, arch="resnet18", batch_size=48, epochs=2)


def test_skipped_steps_are_each_epochs_own():
    """One GradScaler for the whole run: the steps it skips in an epoch are that epoch's.
    A first scale of 2**127 and large inputs overflow the scaled gradients of the first steps
    (5 on this project's machine), until the halved scale fits."""
    from ampkit.distributed import DistInfo
    from ampkit.engine import train_one_epoch
    from helpers.meters import meters_of
    from tools.variants import build_variant

    t = build_variant("train_GradScaler", _tiny_net())
    t.scaler.load_state_dict(t.scaler.state_dict() | {"scale": 2.0 ** 127})
    gen = torch.Generator().manual_seed(0)
    batches = [(1000 * torch.randn(4, 3, 16, 16, generator=gen),
                torch.randint(0, 3, (4,), generator=gen)) for _ in range(12)]
    info = DistInfo(device=CPU)
    meters = meters_of(t, info)
    first = train_one_epoch(t.train_step, batches, info, max_nonfinite=None, meters=meters)
    second = train_one_epoch(t.train_step, batches, info, max_nonfinite=None, meters=meters)
    assert 1 <= first.skipped < 12, first
    assert second.skipped == 0, "the second epoch counted the first epoch's skips"
    assert t.scaler.get_scale() < 2.0 ** 127


@pytest.mark.slow
def test_peak_memory_is_each_epochs_own(imagefolder_root, tmp_path, capsys, monkeypatch):
    """1.5 GB held for a moment in epoch 1 only: epoch 2's peak must not show it. (On a GPU
    the same reset applies to max_memory_allocated.)"""
    import train_without
    from ampkit.device import reset_peak_memory

    if not reset_peak_memory(CPU):
        pytest.skip("this system cannot reset a process's peak RSS")
    real_build, calls = train_without.build, []

    def build(*args, **kwargs):
        t = real_build(*args, **kwargs)
        step = t.train_step

        def step_with_a_spike(micro_batches):
            calls.append(1)
            if len(calls) == 1:
                torch.ones(384 * 2**20)  # 1.5 GB, written, then let go
            return step(micro_batches)

        t.train_step = step_with_a_spike
        return t

    monkeypatch.setattr(train_without, "build", build)
    code, out, err = _run("train_without", _args(imagefolder_root, tmp_path), capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in
            (tmp_path / "train_without" / "log.jsonl").read_text().splitlines()]
    assert [r["peak_mem_kind"] for r in rows] == ["max_rss", "max_rss"]
    assert rows[0]["peak_mem_mb"] - rows[1]["peak_mem_mb"] > 1000, rows


@pytest.fixture
def torchrun_env_of_one(monkeypatch):
    """What torchrun would set for a group of one, undone after the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("script", ["train_without",
                                    pytest.param("train_DDP", marks=pytest.mark.slow)])
def test_every_epoch_trains_in_a_new_order(script, imagefolder_root, tmp_path, capsys,
                                           monkeypatch, torchrun_env_of_one):
    """The DDP script's own sampler.set_epoch(epoch), and the trainer's for a one-process
    script: without it, every epoch repeats the first one's order (the article's DDP bug)."""
    from torch.utils.data import distributed

    orders = []
    real_iter = distributed.DistributedSampler.__iter__

    def recording(self):
        order = list(real_iter(self))
        orders.append(order)
        return iter(order)

    monkeypatch.setattr(distributed.DistributedSampler, "__iter__", recording)
    code, out, err = _run(script, _args(imagefolder_root, tmp_path), capsys)
    assert code == 0, err
    assert len(orders) == 2 and sorted(orders[0]) == sorted(orders[1]) == list(range(48))
    assert orders[0] != orders[1], "the second epoch repeated the first one's order"


@pytest.mark.slow
def test_a_log_file_gets_a_few_progress_lines_not_one_per_step(imagefolder_root, tmp_path):
    """Where stderr is not a terminal (a log file, SLURM, compare.py's children), the bars
    redraw at most every LOG_REDRAW_S seconds: 48 images in batches of 2 are 24 steps an
    epoch and 11 validation batches, and the log holds a handful of redraws, not 35."""
    from conftest import FAST_ARCH, run_main, tiny_args

    res = run_main("train_without", *tiny_args(tmp_path, imagefolder_root, batch_size=2),
                   "--arch", FAST_ARCH)
    assert res.returncode == 0, res.describe()
    assert res.raw_stderr.count("\r") <= 8, res.raw_stderr.count("\r")


@pytest.mark.parametrize("shown", [True, False], ids=["rank0", "other-rank"])
def test_a_progress_bar_starts_and_ends_no_thread(shown):
    """Every epoch ends one bar and starts the next (validation's) just as the validation
    loader forks its workers; a thread starting or ending in that moment can leave a worker
    deadlocked in the fork (CPython gh-112275: a DDP run hung so, its rank waiting for the
    worker's first batch). tqdm starts a monitor thread with a bar, a disabled one too."""
    import threading

    from ampkit.engine import progress_bar

    before = set(threading.enumerate())
    with progress_bar(total=3, desc="train", disable=not shown) as bar:
        bar.update(3)
        assert not set(threading.enumerate()) - before
    assert not set(threading.enumerate()) - before
    # Nor would it use a monitor another tqdm bar of the process had started.
    assert type(bar).monitor_interval == 0


@pytest.mark.slow
def test_each_epoch_reports_its_achieved_tflops_and_share_of_the_peak(imagefolder_root,
                                                                     tmp_path):
    """TFLOP/s = the images trained x one image's forward and backward FLOPs (counted here
    on its own) / the training loop's seconds; with --peak_tflops, its share of the peak;
    on the CPU without it, no share at all."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ampkit.models import build_model
    from conftest import FAST_ARCH, run_main, tiny_args

    torch.manual_seed(0)
    model = build_model(FAST_ARCH, 3)
    counter = FlopCounterMode(display=False)
    with counter:
        torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 64, 64)),
                                          torch.zeros(4, dtype=torch.long)).backward()
    per_image = counter.get_total_flops() / 4
    for peak in ("2", None):
        folder = tmp_path / str(peak)
        res = run_main("train_without", *tiny_args(folder, imagefolder_root), "--arch", FAST_ARCH,
                       *(["--peak_tflops", peak] if peak else []))
        assert res.returncode == 0, res.describe()
        row = json.loads((folder / "checkpoint" / "train_without" / "log.jsonl").read_text())
        assert row["tflops"] == pytest.approx(48 * per_image / row["train_time"] / 1e12, rel=1e-3)
        epoch_line = next(ln for ln in res.stdout.splitlines() if ln.startswith("epoch 1/1"))
        summary = next(ln for ln in res.stdout.splitlines() if ln.startswith("done:"))
        assert "TFLOP/s" in epoch_line and "TFLOP/s" in summary and "on average" in summary
        if peak:
            assert row["utilisation"] == pytest.approx(row["tflops"] / 2)
            assert f"({100 * row['utilisation']:.1f}% of peak)" in epoch_line
        else:
            assert row["utilisation"] is None and "of peak" not in res.stdout


def test_the_peak_is_the_gpus_by_its_name_and_a_missing_one_is_said(monkeypatch):
    import torch

    from ampkit.device import run_peak

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200 NVL")
    assert run_peak(None, cuda, torch.float16, "") == (835, "")
    assert run_peak(None, cuda, None, "fp32") == (60, "")  # --no-tf32: the CUDA cores
    assert run_peak(None, cuda, None, "tf32 conv, fp32 matmul") == (418, "")
    assert run_peak(3.0, cuda, None, "fp32") == (3.0, "")  # --peak_tflops wins
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    peak, note = run_peak(None, cuda, torch.float16, "")
    assert peak is None and "no peak TFLOP/s known for Tesla T4" in note
    assert run_peak(None, torch.device("cpu"), torch.bfloat16, "") == (None, "")
