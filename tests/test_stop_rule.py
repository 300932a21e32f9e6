"""One rule for a stop, wherever the signal lands, and validation that never leaves a rank
waiting: two gloo processes (fresh interpreters, ``torch.multiprocessing.spawn``) run the
DDP script in-process, each scenario a signal to one rank -- or different ones to both --
in a step, in an epoch's last (short) step, in validation, in the save, in the last epoch;
then a ``fully_shard`` model's validation over uneven and empty shards.
The rule: ampkit/stop.py."""
from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from helpers import group_check
from helpers.processes import children, run

TIMEOUT = 240  # seconds for the whole check; a hang fails it instead of the suite


def _free_ports(n: int) -> list:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def ranks_saw(imagefolder_root, tmp_path_factory) -> list:
    out = tmp_path_factory.mktemp("stop_rule")
    ports = _free_ports(len(group_check.SCENARIOS) + 1)
    context = mp.spawn(group_check.main, args=(2, ports, str(imagefolder_root), str(out)),
                       nprocs=2, join=False)
    deadline = time.monotonic() + TIMEOUT
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the two ranks did not end within {TIMEOUT} s (a hang?)")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("scenario,code,saved", [
    # Rank 1's signal in step 3 of 6: the vote cast after step 3 is read after step 4, where
    # both stop.
    ("in_a_step", 143, [0, 4]),
    # Rank 0's SIGUSR1 in the epoch's last step (a short window of one short micro-batch):
    # the epoch's end votes; saved at step 3 of 3, which a resume continues ...
    ("in_the_last_step", 128 + 10, [0, 3]),
    # ... by validating epoch 1 and training epoch 2, where rank 1's SIGTERM during the
    # last epoch's validation stops the run like any other: complete, and 143.
    ("resumed_to_the_last_epoch", 143, [2, 0]),
    # Ctrl-C to rank 1 in validation, SIGTERM to rank 0 in the save that follows: the vote
    # after the save finds both and takes the highest, SIGTERM, for both ranks.
    ("in_validation_and_the_save", 143, [1, 0]),
])
def test_every_rank_stops_at_the_same_point_with_one_status(ranks_saw, scenario, code, saved):
    assert [r[scenario] for r in ranks_saw] == [{"code": code, "saved": saved}] * 2, ranks_saw


def test_validation_of_a_sharded_model_runs_as_many_forwards_on_every_rank(ranks_saw):
    got, want = ranks_saw[0]["padding"]
    assert got == want and ranks_saw[1]["padding"] == [got, want]


def test_loader_workers_ignore_stop_signals_from_outside_but_end_with_their_process(
        imagefolder_root):
    """The classic loader's workers go on through a SIGTERM, SIGUSR1 or SIGINT that another
    process sends them (a scheduler signalling the job's whole group), and end when their own
    process terminates them, as ``multiprocessing`` does at its exit."""
    from ampkit.data.classic import train_dataloader
    from ampkit.data.datasets import build_datasets

    before = children()
    train_set = build_datasets("ImageFolder", imagefolder_root, 32, download=False).train
    loader = train_dataloader(train_set, batch_size=4, num_workers=2, img_size=32)
    batches = iter(loader)
    next(batches)
    workers = children() - before
    assert len(workers) == 2, workers
    for sig in ("TERM", "USR1", "INT"):
        # From a process that is not their parent (which they obey), as a scheduler's.
        assert run(["kill", f"-{sig}", *workers], timeout=30).returncode == 0
    time.sleep(0.5)
    assert sum(len(y) for _, y in batches) == 48 - 4  # the epoch's rest, from live workers
    for pid in workers:
        os.kill(pid, signal.SIGTERM)  # from their own main process
    deadline = time.monotonic() + 10
    while workers & children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not workers & children()
