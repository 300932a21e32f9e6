"""What travels between the processes: --comm_hook on the DDP scripts, --reduce_dtype on FSDP2.

The hooks' numbers (gradients against the fp32 all-reduce, one round a step, half the bytes,
an overflow under PowerSGD + GradScaler, FSDP2's reduce dtype) are checked at 3 gloo
processes by tests/helpers/wire_check.py under torchrun; the flags, the epoch line's bytes
and a resume's words in-process, in a group of one.
"""
import json

import pytest

from ampkit.models import build_model
from conftest import FAST_ARCH, assert_no_traceback_of_ours, run_main, tiny_args
from helpers.processes import run, torchrun


@pytest.mark.parametrize("script, flags, says", [
    ("train_DP", ["--comm_hook", "bf16"], "DataParallel sums the gradients on one GPU"),
    ("train_without", ["--comm_hook", "fp16"], "one device sends no gradients anywhere"),
    ("train_FSDP_autocast", ["--comm_hook", "powersgd"], "train_FSDP_mixed.py has --reduce_dtype"),
    ("train_DDP", ["--powersgd_rank", "2"], "tune --comm_hook powersgd"),
    ("train_DDP", ["--comm_hook", "powersgd", "--powersgd_start_iter", "1"], "at least 2"),
    ("train_DDP", ["--comm_hook", "powersgd", "--powersgd_rank", "0"], "positive integer"),
    ("train_DDP_GradScaler", ["--reduce_dtype", "bfloat16"], "the DDP scripts have --comm_hook"),
])
def test_a_wire_flag_the_run_cannot_honour_is_refused_in_one_line(script, flags, says,
                                                                  imagefolder_root, tmp_path):
    res = run_main(script, *tiny_args(tmp_path, imagefolder_root), *flags)
    assert res.returncode == 2, res.describe()
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], res.describe()
    assert not (tmp_path / "checkpoint").exists()  # refused before the run folder


def _rows(run_dir):
    return [r for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
            if "val_acc" in r]


def test_powersgd_counts_its_bytes_and_a_resume_says_what_restarts(imagefolder_root, tmp_path,
                                                                  gloo_free=None):
    args = tiny_args(tmp_path, imagefolder_root, epochs=1) + [
        "--arch", FAST_ARCH, "--img_size", "32", "--comm_hook", "powersgd",
        "--powersgd_start_iter", "2"]
    first = run_main("train_DDP_GradScaler", *args)
    assert first.returncode == 0, first.describe()
    assert "in a group of one process: nothing travels" in first.stderr, first.describe()
    run_dir = tmp_path / "checkpoint" / "train_DDP_GradScaler"
    (row,) = _rows(run_dir)
    # 48 images in batches of 16: 2 plain all-reduce steps of the network's fp32 gradients
    # (3 classes), then one step of rank-1 factors, counted at the hook.
    params_mb = sum(p.numel() for p in build_model(FAST_ARCH, 3).parameters()) * 4 / 1e6
    assert row["optimizer_steps"] == 3 and row["comm_hook"] == "powersgd"
    assert 2 * params_mb / 3 < row["wire_mb_per_step"] < params_mb, row
    assert f"wire {row['wire_mb_per_step']:.2f} MB/step (powersgd)" in first.stdout

    again = run_main("train_DDP_GradScaler", *args[:-4], "--epochs", "2", "--resume",
                     "--comm_hook", "powersgd", "--powersgd_start_iter", "2")
    assert again.returncode == 0, again.describe()
    assert "PowerSGD's error feedback and warm start restart from zero" in again.stdout
    assert "its step count goes on at 3" in again.stdout, again.stdout
    second = _rows(run_dir)[-1]  # compressed from its first step: no warm-up again
    assert second["wire_mb_per_step"] < params_mb / 10, second  # a warm-up: over 2/3 of it

    plain = run_main("train_DDP_GradScaler", *args[:-4], "--epochs", "3", "--resume")
    assert plain.returncode == 0, plain.describe()
    assert "--comm_hook none (was powersgd)" in plain.stdout, plain.stdout
    assert _rows(run_dir)[-1]["wire_mb_per_step"] == pytest.approx(params_mb)


def test_comm_hook_none_builds_no_hook_and_counts_ddps_own_all_reduce(
        imagefolder_root, tmp_path, monkeypatch):
    """--comm_hook none: no hook object at all (DDP's own all-reduce, in C++); the epoch's row
    still says what it sent, every gradient in float32."""
    from ampkit.comm_hooks import CommHook

    def built(*_, **__):
        raise AssertionError("a CommHook was built for --comm_hook none")

    monkeypatch.setattr(CommHook, "__init__", built)
    res = run_main("train_DDP", *tiny_args(tmp_path, imagefolder_root), "--arch", FAST_ARCH)
    assert res.returncode == 0, res.describe()
    (row,) = _rows(tmp_path / "checkpoint" / "train_DDP")
    params_mb = sum(p.numel() for p in build_model(FAST_ARCH, 3).parameters()) * 4 / 1e6
    assert row["comm_hook"] == "none" and row["wire_mb_per_step"] == pytest.approx(params_mb)


def test_powersgd_keeps_its_warm_up_when_a_resume_trains_longer():
    """The default warm-up is 10 % of the run's optimizer steps: a resume with more --epochs
    keeps the saved one (else a compressed run would go back to plain all-reduce), and says
    so; one given by --powersgd_start_iter is this run's, which the changed-flags line names."""
    from ampkit.comm_hooks import CommHook

    saved = CommHook("powersgd", run_steps=30).state_dict()  # warm-up: 3 steps
    saved["iter"] = 5  # compressing already
    longer = CommHook("powersgd", run_steps=900)  # its own default: 90
    said = longer.load_state_dict(saved)
    assert longer.state.start_powerSGD_iter == 3 and "warm-up ends at step 3, as saved" in said
    given = CommHook("powersgd", start_iter=50, run_steps=900)
    assert "ends at step 50" in given.load_state_dict(saved)
    assert given.state.start_powerSGD_iter == 50


@pytest.mark.slow
def test_hooks_at_three_processes_match_fp32_reduce_once_a_step_and_survive_an_overflow():
    res = run(torchrun("--standalone", "--nproc_per_node=3", "tests/helpers/wire_check.py"),
              timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert_no_traceback_of_ours(res.stdout, res.stderr)
    assert res.stdout.strip().endswith("OK"), res.stdout
