"""Evaluate a checkpoint in several processes, each counting its own shard, exactly.

    torchrun --nproc_per_node=2 AMP/eval_DDP.py  # newest last.pth in checkpoint/
    torchrun --nproc_per_node=2 AMP/eval_DDP.py --checkpoint checkpoint/train_DP_autocast/best.pth
    python AMP/eval_DDP.py                                       # one process

The process group is the DDP train scripts' (train_DDP.py). Each process counts the correct
predictions on its shard of the test split, one all_reduce sums the counts: the shards are
disjoint and cover every image once, so the result is eval_without's for any number of
processes (a DistributedSampler pads its shards with repeated images, counted twice). No
DDP wrapper is needed: there are no gradients to synchronise.
"""
import torch
import torch.distributed as dist

from ampkit.device import choose_device, refuse_unsupported
from ampkit.distributed import GROUP_TIMEOUT, group_store, torchrun_ranks
from ampkit.evaluate import Evaluation
from ampkit.flags import parse_eval_args
from ampkit.run import report_user_errors


@report_user_errors
def main(argv=None):
    args = parse_eval_args("eval_DDP", argv, __doc__, process_group=True)
    rank, world_size, local_rank = torchrun_ranks()
    device = choose_device(args.device, local_rank)
    refuse_unsupported(device, process_group=True)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(dist.get_default_backend_for_device(device), rank=rank,
                            world_size=world_size, store=group_store(rank, world_size),
                            timeout=GROUP_TIMEOUT, device_id=device.index)
    try:
        ev = Evaluation(args, device)
        # This rank's shard: every world_size-th test image from its rank's on, disjoint
        # shards that cover each image once; the counts summed over the ranks.
        counts = ev.count(ev.model)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        ev.report(*counts.tolist())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
