"""Evaluate a checkpoint in several processes, each counting its own shard, exactly.

    torchrun --nproc_per_node=2 AMP/eval_DDP.py  # newest last.pth in checkpoint/
    torchrun --nproc_per_node=2 AMP/eval_DDP.py --checkpoint checkpoint/train_DP_autocast/best.pth
    python AMP/eval_DDP.py                                       # one process

The process group is the DDP train scripts' (train_DDP.py). Each process counts the correct
predictions on its shard of the test split, one all_reduce sums the counts: the shards are
disjoint and cover every image once, so the result is eval_without's for any number of
processes. The article evaluated with a DistributedSampler, which pads the shards with
repeated images (counted twice), and divided each process's own count by the whole test
set. No DDP wrapper is needed: there are no gradients to synchronise.
"""
import torch
import torch.distributed as dist

from ampkit.distributed import GROUP_TIMEOUT, elastic_store, torchrun_env
from ampkit.evaluate import Evaluation
from ampkit.machinery.config import parse_eval_args
from ampkit.machinery.process import report_user_errors


@report_user_errors  # a user's mistake: one line and exit status 2
def main(argv=None):
    args = parse_eval_args("eval_DDP", argv, __doc__, process_group=True)
    rank, world_size, device = torchrun_env(args.cuda)  # device: cuda:LOCAL_RANK, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank would use GPU 0
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=world_size, store=elastic_store(rank, world_size),
                            timeout=GROUP_TIMEOUT, device_id=device.index)  # None on the CPU
    try:  # the group is left on every way out: the end or an error
        ev = Evaluation(args, device)  # checkpoint, test split, model with its weights
        shard = range(rank, ev.test_size, world_size)  # every world_size-th image, from `rank` on
        counts = ev.count_correct(ev.model, shard)  # tensor([correct, seen]) of this shard
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # summed over all processes: exact totals
        ev.report(*counts.tolist())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
