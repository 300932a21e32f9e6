"""Train AlexNet with DistributedDataParallel, autocast and GradScaler: one process per GPU, fp16.

    torchrun --nproc_per_node=2 AMP/train_DDP_GradScaler.py --epochs 20
    python AMP/train_DDP_GradScaler.py --epochs 20      # one process (a group of one)

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_DDP_GradScaler.py

DDP's recipe, every step in main() and build() [the article's bugs]:
1. one process per GPU, in a process group from torchrun's environment (RANK, LOCAL_RANK,
   WORLD_SIZE): torch.cuda.set_device before any CUDA work, then init_process_group, NCCL
   on GPUs and gloo on the CPU [rank and address by hand, gloo on GPUs too, no set_device];
2. DistributedDataParallel(model), the model already on its device: each process holds a
   whole replica, and backward() averages the gradients over the processes (all-reduce,
   in buckets, overlapped with the rest of backward) [wrapped first, moved to the GPU after];
3. DistributedSampler: each process its own share of the data; sampler.set_epoch(epoch)
   every epoch [never called: every epoch repeated the first one's order];
4. global rank 0 alone writes, the unwrapped module's weights (machinery/saving.py)
   [every rank saved, with DDP's `module.` prefix];
5. the loss and the accuracy summed over the processes by all_reduce [each rank divided
   its own count by the whole test set];
6. destroy_process_group at the end [never called].
With --accum_steps: every micro-batch but the step's last inside model.no_sync(), its
forward too (DDP arms the all-reduce in forward): one all-reduce per step.

autocast computes in float16; GradScaler (see train_GradScaler.py) scales the loss so
float16 gradients do not underflow. Every process has its own scaler, and they stay in
step: the gradients they unscale are the same averaged ones, so all find the same
inf/NaN, skip the same steps and keep the same scale.

Pitfall: --batch_size is per process. fp16 needs the scaler; bf16 (--amp_dtype bfloat16)
does not.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DDP_GradScaler.py --help` lists the flags.
"""
import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from ampkit.distributed import GROUP_TIMEOUT, elastic_store, torchrun_env
from ampkit.engine import Parts, Technique
from ampkit.machinery.config import parse_train_args
from ampkit.machinery.errors import report_user_errors
from ampkit.train import Trainer


def build(parts: Parts) -> Technique:
    model = parts.model  # on this process's device: cuda:LOCAL_RANK, or the CPU
    # 2. A whole replica per process; backward() averages the gradients over them.
    model = DistributedDataParallel(model)  # device_ids: the model's own device
    criterion = parts.criterion
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.lr, fused=True)
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)
    scaler = torch.amp.GradScaler(parts.device.type)

    def forward_backward(images, targets, weight):  # one micro-batch, its share of the step
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets) * weight
        scaler.scale(loss).backward()  # adds the gradients of loss x scale to the step's
        return loss.detach()

    def train_step(window):  # one optimizer step over --accum_steps micro-batches
        n = sum(len(y) for _, y in window)  # its images (fewer at an epoch's end)
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for i, (x, y) in enumerate(window):
            # All but the last inside no_sync, forward too: one all-reduce a step.
            with model.no_sync() if i < len(window) - 1 else contextlib.nullcontext():
                loss += forward_backward(x, y, len(y) / n)
        scaler.unscale_(optimizer)  # once a step, before anything reads the gradients
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), parts.clip_grad)
        scaler.step(optimizer)  # skips the step if any gradient is inf/NaN
        scaler.update()         # halves the scale after a skip, grows it after good steps
        return loss, norm

    return Technique(model, optimizer, train_step, autocast, scaler)


@report_user_errors  # after an error or a stop, also leaves the process group
def main(argv=None):
    args = parse_train_args("train_DDP_GradScaler", argv, __doc__, process_group=True)
    # 1. One process per device, in a process group from torchrun's environment.
    rank, world_size, device = torchrun_env(args.cuda)  # device: cuda:LOCAL_RANK, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank would use GPU 0
    torch.distributed.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
        store=elastic_store(rank, world_size), timeout=GROUP_TIMEOUT, device_id=device.index)
    with Trainer(args, device) as trainer:  # run folder, data, model, resumed state
        # 3. Each process trains on its own share of the data.
        sampler = DistributedSampler(trainer.train_set, shuffle=True, seed=args.seed)
        technique = trainer.start(build, sampler)
        for epoch in trainer.epochs():
            sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
            # 4-5: rank 0 alone saves, the unwrapped weights (machinery/saving.py); loss and
            # accuracy are summed over the ranks by all_reduce (engine.py, train.py)
            trainer.train_epoch(technique, epoch)
    torch.distributed.destroy_process_group()  # 6. leave the group


if __name__ == "__main__":
    main()
