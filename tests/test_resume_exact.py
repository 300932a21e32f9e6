"""A stop + resume loses nothing: on the CPU, in fp32, a run stopped by a signal and resumed
ends with the weights and optimizer state of the run that never stopped, bit for bit, and
the same figures for every epoch -- whether it stopped in the middle of an epoch or in its
last, short step. A network with dropout (the random stream a rank goes on drawing from)
and BatchNorm, the classic input path with its flips. DDP at 2 ranks: test_scheduler_stops.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
from functools import partial
from pathlib import Path
from typing import Iterator

import pytest
import torch

from conftest import FSDP_ARCH, quick_flags, run_main

# 6 training images, batch 4: steps of 4 and 2 images, the last one short; 2 epochs.


@contextlib.contextmanager
def _sigterm_at_loss(n: int) -> Iterator[None]:
    """SIGTERM to this process as its ``n``-th training loss is made (0: none)."""
    original, losses = torch.nn.CrossEntropyLoss.forward, []

    def forward(self, *args, **kwargs):
        losses.append(1)
        if len(losses) == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    torch.nn.CrossEntropyLoss.forward = forward
    try:
        yield
    finally:
        torch.nn.CrossEntropyLoss.forward = original


def _run(root: Path, ckpt: Path, *extra: str, stop_at_loss: int = 0,
         dataset: str = "ImageFolder", batch_size: int = 4) -> tuple:
    with _sigterm_at_loss(stop_at_loss):
        return run_main("train_without", *quick_flags(root, ckpt, *extra, dataset=dataset,
                                                      img_size=32, arch=FSDP_ARCH,
                                                      batch_size=batch_size, epochs=2,
                                                      lr="1e-3"))


def _final(ckpt: Path) -> tuple:
    run_dir = ckpt / "train_without"
    state = torch.load(run_dir / "last.pth", map_location="cpu", weights_only=True)
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return state, rows


def _assert_equal_states(got, want, where="") -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{where} differs"
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_equal_states(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_equal_states(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.fixture(scope="module")
def never_stopped(mini_imagefolder_root, tmp_path_factory) -> tuple:
    ckpt = tmp_path_factory.mktemp("never_stopped")
    code, out, err = _run(mini_imagefolder_root, ckpt)
    assert code == 0, err
    return _final(ckpt)


@pytest.mark.parametrize("stop_at_loss,stopped", [
    (2, "at epoch 1, step 2"),  # the epoch's last step, a short batch: resumed with none left
    (3, "at epoch 2, step 1"),  # mid-epoch
])
def test_stop_and_resume_ends_bit_for_bit_as_the_run_that_never_stopped(
        stop_at_loss, stopped, never_stopped, mini_imagefolder_root, tmp_path):
    want, want_rows = never_stopped
    ckpt = tmp_path / "stopped"
    code, out, err = _run(mini_imagefolder_root, ckpt, stop_at_loss=stop_at_loss)
    assert code == 143 and f"stopped by SIGTERM {stopped}" in out, out + err
    assert not list((ckpt / "train_without").glob(".*.tmp"))
    code, out, err = _run(mini_imagefolder_root, ckpt, "--resume")
    assert code == 0 and "resumed from" in out, out + err
    got, rows = _final(ckpt)
    for key in ("model", "optimizer", "scheduler", "progress"):
        _assert_equal_states(got[key], want[key], key)
    # Every epoch's figures are whole: the stopped epoch's steps before the stop count too.
    for row, want_row in zip(rows, want_rows, strict=True):
        for key in ("epoch", "val_acc", "optimizer_steps", "train_loss", "grad_norm_mean",
                    "grad_norm_max"):
            assert row[key] == pytest.approx(want_row[key], rel=1e-12), (key, row, want_row)


def test_a_stop_in_the_last_step_on_the_fast_path_resumes_with_no_step_left(
        cifar_root, tmp_path):
    """The fast path (CIFAR-10 held on the device: 30 training images, batch 8, steps of 8,
    8, 8 and 6) after a stop in the epoch's last step: the resumed epoch has no batch left
    -- not one of 0 images -- and the run ends as the one that never stopped."""
    run = partial(_run, cifar_root, dataset="CIFAR10", batch_size=8)
    code, out, err = run(tmp_path / "whole")
    assert code == 0, err
    want, want_rows = _final(tmp_path / "whole")
    ckpt = tmp_path / "stopped"
    code, out, err = run(ckpt, stop_at_loss=4)
    assert code == 143 and "stopped by SIGTERM at epoch 1, step 4" in out, out + err
    code, out, err = run(ckpt, "--resume")
    assert code == 0 and "resumed from" in out, out + err
    got, rows = _final(ckpt)
    for key in ("model", "optimizer", "scheduler", "progress"):
        _assert_equal_states(got[key], want[key], key)
    assert [r["optimizer_steps"] for r in rows] == [r["optimizer_steps"] for r in want_rows]
