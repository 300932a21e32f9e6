"""Evaluate a checkpoint in several processes, each counting its own shard, exactly.

    torchrun --nproc_per_node=2 AMP/eval_DDP.py  # newest last.pth in checkpoint/
    torchrun --nproc_per_node=2 AMP/eval_DDP.py --checkpoint checkpoint/train_DP_autocast/best.pth
    python AMP/eval_DDP.py                                       # one process

Each process counts the correct predictions on its shard of the test split, then one
all_reduce sums the counts. The shards are disjoint and cover every image once, so the
result is exactly eval_without's for any number of processes.

Pitfall: DistributedSampler pads the shards with repeated images so that all are the same
length; evaluation with it counts some images twice. And no DDP wrapper is needed: there
are no gradients to synchronise, only the counts. `--help` lists the flags.
"""
import torch.distributed as dist

from ampkit.machinery.errors import report_user_errors
from ampkit.evaluate import Evaluation


@report_user_errors
def main(argv=None):
    ev = Evaluation("eval_DDP", argv, ddp=True)  # + the process group, from torchrun's env
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = range(rank, ev.test_size, world_size)  # every world_size-th image, from `rank` on
    counts = ev.count_correct(ev.model, shard)  # tensor([correct, seen]) of this shard
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # summed over all processes: exact totals
    ev.report(*counts.tolist())


if __name__ == "__main__":
    main()
