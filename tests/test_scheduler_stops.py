"""Stops as schedulers send them: a signal to a whole process group (the DataLoader workers
included), one process or a DDP job under torchrun; then --resume finishes the run -- and
at 2 ranks it ends bit for bit as the run that never stopped. Ctrl-C to the benchmark's
input pipeline, loader workers included, is one line. (SIGUSR1's stop and resume at
2 ranks: test_stop_rule.py; through SLURM and torchrun: checks/slurm_check.sh.)
Real interpreters: what is tested is the processes' exit status, streams and teardown."""
from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from functools import partial

import pytest
import torch

from conftest import FSDP_ARCH, REPO_ROOT, assert_no_traceback_of_ours, quick_flags, run_script
from helpers.processes import (PYTHON, children, finish, kill_job, run, start, torchrun,
                               wait_for)
from test_resume_exact import _assert_equal_states
from test_world_size import _torchrun

HELPER = REPO_ROOT / "tests" / "helpers" / "faulty_train.py"
pytestmark = pytest.mark.slow


_flags = partial(quick_flags, img_size=32, arch=None, num_workers=2)  # loader workers: 2


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_a_signal_to_the_whole_group_with_loader_workers_stops_one_process(
        imagefolder_root, tmp_path):
    """SIGTERM to the process group in the middle of step 3 -- the main process and its two
    DataLoader workers, as a terminal's Ctrl-C or `kill -- -PGID` reaches them: the workers
    ignore it, the step finishes, last.pth is saved, exit 143; --resume goes on to the end."""
    ckpt = tmp_path / "ckpt"
    flags = _flags(imagefolder_root, ckpt, "--arch", "shufflenet_v2_x0_5", "--batch_size", "8",
                   "--epochs", "2")
    code, out, err = run([PYTHON, HELPER, "train_without", *flags],
                         {"FAULT_SIGTERM_AT_LOSS": "3", "FAULT_TO_GROUP": "1"}, timeout=300)
    assert code == 143, err[-3000:]
    assert "stopped by SIGTERM at epoch 1, step 3" in out, out
    assert_no_traceback_of_ours(out, err)
    code, out, err = run_script("train_without", *flags, "--resume")
    assert code == 0 and "resumed from" in out and "done: train_without, 2 epochs" in out, err
    assert_no_traceback_of_ours(out, err)


def test_sigterm_to_a_whole_torchrun_job_stops_it_and_the_resume_ends_bit_for_bit(
        imagefolder_root, tmp_path):
    """SIGTERM to every process of a torchrun job once epoch 1 is done, as a scheduler sends
    it: torchrun passes it on to each worker's process group (loader workers included:
    two per rank, on the classic path); every rank exits 143 with the stop saved and the
    epochs before it logged. Resumed, each rank goes on drawing from its own random stream,
    and the run ends -- fp32 on the CPU, a network with dropout -- with the weights and
    optimizer state of the run that never stopped, bit for bit, wherever the stop fell."""
    flags = ["--arch", FSDP_ARCH, "--batch_size", "4", "--epochs", "3", "--lr", "1e-3"]
    whole, ckpt = tmp_path / "whole", tmp_path / "stopped"
    res = _torchrun(2, REPO_ROOT / "AMP" / "train_DDP.py", *_flags(imagefolder_root, whole, *flags))
    assert res.returncode == 0, res.stderr[-3000:]

    run_dir = ckpt / "train_DDP"
    proc = start(torchrun("--standalone", "--nproc_per_node=2", HELPER, "train_DDP",
                          *_flags(imagefolder_root, ckpt, *flags)),
                 {"FAULT_EXIT_FILE": str(tmp_path / "exit")})  # each rank's exit status
    wait_for((run_dir / "log.jsonl").exists, 180, proc)  # epoch 1 is done
    kill_job(proc.pid, signal.SIGTERM)  # the whole job: torchrun leads its group
    _, out, err = finish(proc, 120)
    stopped = re.search(r"stopped by SIGTERM (?:at epoch (\d), step (\d+)|after epoch (\d));",
                        out)
    assert stopped, out + err[-3000:]
    # torchrun, stopped by the signal itself, reports no worker's status: they wrote theirs.
    assert [(tmp_path / f"exit.{rank}").read_text() for rank in (0, 1)] == ["143"] * 2, \
        err[-3000:]
    assert_no_traceback_of_ours(out, err)  # torchrun's own SignalException is torchrun's
    epochs, step = ((int(stopped.group(1)) - 1, int(stopped.group(2))) if stopped.group(1)
                    else (int(stopped.group(3)), 0))
    state = _load(run_dir / "last.pth")
    assert (state["progress"]["epoch"], state["progress"]["step"]) == (epochs, step), \
        "both ranks stopped, rank 0 saved"
    logged = [json.loads(row)["epoch"] for row in (run_dir / "log.jsonl").read_text().splitlines()]
    assert logged == list(range(1, epochs + 1))

    res = _torchrun(2, REPO_ROOT / "AMP" / "train_DDP.py",
                    *_flags(imagefolder_root, ckpt, *flags), "--resume")
    assert res.returncode == 0 and "done: train_DDP, 3 epochs" in res.stdout, res.stderr[-3000:]
    want, got = (_load(folder / "train_DDP" / "last.pth") for folder in (whole, ckpt))
    for key in ("model", "optimizer", "progress"):
        _assert_equal_states(got[key], want[key], key)


def test_ctrl_c_to_the_benchmark_with_loader_workers_is_one_line_and_leaves_no_process(tmp_path):
    """The benchmark's input pipeline on the classic path, two DataLoader workers: Ctrl-C to
    the whole group (a terminal's) while it runs. The workers ignore it and end with their
    process; the benchmark says so in one line, exit status 130, no traceback."""
    proc = start([PYTHON, "AMP/benchmark.py", "--variants", "none", "--pipeline", "classic",
                  "--num_workers", "2", "--batch_size", "2", "--img_size", "64",
                  "--pipeline_batches", "200", "--repeat", "1000", "--no-cuda",
                  "--dataset_root", tmp_path / "generated"])
    wait_for(lambda: len(children(proc.pid)) == 2, 120, proc)  # its loader's workers
    workers = children(proc.pid)
    time.sleep(1.0)  # batches in flight
    kill_job(proc.pid, signal.SIGINT)
    code, out, err = finish(proc, 60)
    assert code == 130, err[-3000:]
    assert err.splitlines()[-1] == "benchmark.py: interrupted", err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]  # none, from any process
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 10)
