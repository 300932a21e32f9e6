"""The rank's side of tests/test_stop_rule.py: two processes started by
``torch.multiprocessing.spawn`` (fresh interpreters), each one rank of a gloo group.

Each rank runs ``train_DDP.main(argv)`` in-process, once for each of ``SCENARIOS``, with a
signal sent to itself where the scenario says (in a step, in the epoch's last step, in
validation, in the save); then counts a ``fully_shard`` model's validation over uneven and
empty shards. What it saw goes to ``<out>/rank<R>.json``: each run's exit status and the
(epoch, step) its last.pth holds, and the counts.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

AMP = Path(__file__).resolve().parents[2] / "AMP"
sys.path.insert(0, str(AMP))

import ampkit.checkpoint.manager  # noqa: E402
import train_DDP  # noqa: E402
from ampkit.engine import count_correct  # noqa: E402
from ampkit.distributed import this_process  # noqa: E402

# 48 training images over 2 ranks, per rank: batch 4 -> 6 steps an epoch; batch 5 with
# --accum_steps 2 -> micro-batches of 5, 5, 5, 5, 4 and windows of 2, 2, 1: 3 steps, the
# last one short in both. The faults: {rank: (signal, where, when)}; "loss" counts this
# rank's training losses (micro-batches), "val" and "save" the epoch's validations and
# checkpoints made.
SCENARIOS = [
    ("in_a_step", ["--batch_size", "4"], {1: ("SIGTERM", "loss", 3)}),
    ("in_the_last_step", ["--batch_size", "5", "--accum_steps", "2"],
     {0: ("SIGUSR1", "loss", 5)}),
    ("resumed_to_the_last_epoch", ["--batch_size", "5", "--accum_steps", "2", "--resume"],
     {1: ("SIGTERM", "val", 2)}),
    ("in_validation_and_the_save", ["--batch_size", "4"],
     {1: ("SIGINT", "val", 1), 0: ("SIGTERM", "save", 1)}),
]


class Faults:
    """Sends this process its scenario's signal at the given loss, validation or save."""

    def __init__(self, fault) -> None:
        self.fault, self.counts = fault, {"loss": 0, "val": 0, "save": 0}
        self.loss, self.validate, self.state = (torch.nn.CrossEntropyLoss.forward,
                                                train_DDP.count_correct,
                                                ampkit.checkpoint.manager.CheckpointManager._checkpoint)
        torch.nn.CrossEntropyLoss.forward = self._counted("loss", self.loss)
        train_DDP.count_correct = self._counted("val", self.validate)
        ampkit.checkpoint.manager.CheckpointManager._checkpoint = self._counted("save", self.state)

    def _counted(self, where, call):
        def counted(*args, **kwargs):
            self.counts[where] += 1
            if self.fault and self.fault[1:] == (where, self.counts[where]):
                os.kill(os.getpid(), getattr(signal, self.fault[0]))
            return call(*args, **kwargs)
        return counted

    def remove(self) -> None:
        torch.nn.CrossEntropyLoss.forward = self.loss
        train_DDP.count_correct = self.validate
        ampkit.checkpoint.manager.CheckpointManager._checkpoint = self.state


def _saved(ckpt: Path):
    path = ckpt / "train_DDP" / "last.pth"
    if not path.is_file():
        return None
    progress = torch.load(path, map_location="cpu", weights_only=True)["progress"]
    return [progress["epoch"], progress["step"]]


def _padding_counts(rank: int, world_size: int, port: int) -> list:
    """A fully_shard model's [correct, seen] summed over the ranks, on 3 and on 1 test
    images at batch 1: 2 forwards on rank 0 and 1 on rank 1, then 1 and none. Each forward
    gathers the sharded weights: a rank that skipped one would leave its peer waiting
    (this group times out after 20 s instead). And the unsharded model's count."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=20))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))
        images, targets = torch.randn(3, 3, 2, 2), torch.tensor([0, 1, 2])
        want = [int((model(images[:n]).argmax(1) == targets[:n]).sum()) for n in (3, 1)]
        for layer in (model[1], model[3]):
            fully_shard(layer)
        fully_shard(model)
        info = this_process(torch.device("cpu"))
        got = []
        for n in (3, 1):
            mine = Shard((images[i:i + 1], targets[i:i + 1]) for i in range(rank, n, world_size))
            counts = count_correct(model, mine, info)
            dist.all_reduce(counts)
            got.append(counts.tolist())
        # The sharded model's reference cycles hold gloo's work objects: left to the
        # interpreter's exit, collecting them aborts the process now and then ("terminate
        # called without an active exception", about 1 run in 6 with torch 2.14).
        del model, counts
        gc.collect()
        return [got, [[w, n] for w, n in zip(want, (3, 1))]]
    finally:
        dist.destroy_process_group()


class Shard(list):
    """A rank's validation batches, as a loader gives them: with the shape of a blank image."""
    image_shape, memory_format = (3, 2, 2), torch.contiguous_format


def main(rank: int, world_size: int, ports: list, root: str, out: str) -> None:
    torch.set_num_threads(1)  # as torchrun sets it: two ranks on two cores
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    ckpt = Path(out) / "ckpt"
    seen = {}
    for (name, flags, faults), port in zip(SCENARIOS, ports):
        if "--resume" not in flags:
            ckpt = Path(out) / name
        os.environ["MASTER_PORT"] = str(port)
        fault = Faults(faults.get(rank))
        try:
            code = train_DDP.main(["--dataset", "ImageFolder", "--dataset_root", root,
                                   "--img_size", "32", "--arch", "shufflenet_v2_x0_5",
                                   "--no-cuda", "--no-tensorboard", "--checkpoint", str(ckpt),
                                   "--epochs", "2", *flags])
        except SystemExit as e:
            code = e.code
        finally:
            fault.remove()
        seen[name] = {"code": code, "saved": _saved(ckpt)}
    seen["padding"] = _padding_counts(rank, world_size, ports[-1])
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(seen))
