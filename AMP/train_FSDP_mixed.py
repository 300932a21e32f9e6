"""Train with FSDP2 (fully_shard) in its own mixed precision: MixedPrecisionPolicy, no autocast.

    torchrun --nproc_per_node=2 AMP/train_FSDP_mixed.py --epochs 20     # float16 (CUDA's default)
    torchrun --nproc_per_node=2 AMP/train_FSDP_mixed.py --amp_dtype bfloat16

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_FSDP_mixed.py

DDP's recipe, FSDP2 the wrapper, every step in main() and build() [the article's bugs]:
1. one process per GPU, in a process group from torchrun's environment (RANK, LOCAL_RANK,
   WORLD_SIZE): torch.cuda.set_device before any CUDA work, then init_process_group, NCCL
   on GPUs and gloo on the CPU [rank and address by hand, gloo on GPUs too, no set_device];
2. fully_shard on each block, then on the root: each process holds a shard of every
   parameter, gradient and AdamW state; the optimizer is made after sharding, over
   the shards;
3. DistributedSampler: each process its own share of the data; sampler.set_epoch(epoch)
   every epoch [never called: every epoch repeated the first one's order];
4. global rank 0 alone writes, the full weights, gathered from the shards (machinery/saving.py)
   [every rank saved, with DDP's `module.` prefix];
5. the loss and the accuracy summed over the processes by all_reduce [each rank divided
   its own count by the whole test set];
6. destroy_process_group at the end [never called].

How this differs from autocast (train_FSDP_autocast.py): autocast decides per operator,
as each one runs, and keeps float32 weights around it. MixedPrecisionPolicy decides per
block: when FSDP2 gathers a block's parameters, it casts them to param_dtype (--amp_dtype),
so the all-gather moves half the bytes and the whole block computes in that dtype,
normalisation and softmax included; gradients are reduce-scattered in reduce_dtype
(float32 here, as torchtitan trains) and the sharded parameters and AdamW stay float32.
The root's output is cast back to float32, so the loss is computed in float32.

Pitfall: float16 still needs loss scaling (the scaler is on for float16, off for
bfloat16). Buffers are not cast: BatchNorm's float32 running statistics cannot run beside
bf16/fp16 weights, so networks with BatchNorm (ResNets...) take train_FSDP_autocast.py.
--batch_size is per process.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_FSDP_mixed.py --help` lists the flags.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler

from ampkit.distributed import GROUP_TIMEOUT, elastic_store, process_device, torchrun_env
from ampkit.engine import Parts, Technique
from ampkit.machinery.config import parse_train_args
from ampkit.machinery.errors import report_user_errors
from ampkit.models import check_param_dtype_fits, shard_units
from ampkit.train import Trainer


def build(parts: Parts) -> Technique:
    check_param_dtype_fits(parts.model, parts.arch)  # BatchNorm: no (its statistics are fp32)
    dtype, fp32 = parts.amp_dtype, torch.float32
    model = parts.model.to(memory_format=torch.contiguous_format)  # what fully_shard takes
    # 2. Each block is gathered, cast to param_dtype, to run; reduced in float32.
    for block in shard_units(model):  # each layer or residual block, then the root
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=fp32))
    model = fully_shard(model, mp_policy=MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=fp32, output_dtype=fp32))
    criterion = parts.criterion
    # After fully_shard, which replaced the parameters: AdamW over this process's shards.
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.lr, fused=True)
    scaler = torch.amp.GradScaler(parts.device.type, enabled=dtype == torch.float16)

    def train_step(images, targets):
        loss = criterion(model(images), targets)  # each block computes in param_dtype
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # float16: gradients of loss x scale; bfloat16: as is
        scaler.step(optimizer)         # unscales them; skips the step if any is inf/NaN
        scaler.update()                # halves the scale after a skip, grows it after good steps
        return loss

    return Technique(model, optimizer, train_step,
                     scaler=scaler if scaler.is_enabled() else None, param_dtype=dtype)


@report_user_errors  # after an error or a stop, also leaves the process group
def main(argv=None):
    args = parse_train_args("train_FSDP_mixed", argv, __doc__, process_group=True)
    # 1. One process per device, in a process group from torchrun's environment.
    rank, local_rank, world_size = torchrun_env()  # plain python: a group of one
    device = process_device(args.cuda, local_rank)  # cuda:LOCAL_RANK, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank would use GPU 0
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=world_size, store=elastic_store(rank, world_size),
                            timeout=GROUP_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    with Trainer(args, device) as trainer:  # run folder, data, model, resumed state
        # 3. Each process trains on its own share of the data.
        sampler = DistributedSampler(trainer.train_set, shuffle=True, seed=args.seed)
        technique = trainer.start(build, sampler)
        for epoch in trainer.epochs():
            sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
            # 4-5: rank 0 alone saves, the unwrapped weights (machinery/saving.py); loss and
            # accuracy are summed over the ranks by all_reduce (engine.py, train.py)
            trainer.train_epoch(technique, epoch)
    dist.destroy_process_group()  # 6. leave the group


if __name__ == "__main__":
    main()
