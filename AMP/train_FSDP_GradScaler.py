"""Train with FSDP2 (fully_shard), autocast and GradScaler: sharded model, fp16 with loss scaling.

    torchrun --nproc_per_node=2 AMP/train_FSDP_GradScaler.py --epochs 20
    python AMP/train_FSDP_GradScaler.py --epochs 20      # one process (a group of one)

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_FSDP_GradScaler.py

FSDP2 (see train_FSDP.py) shards the parameters, gradients and optimizer state; autocast
computes in float16; GradScaler (see train_GradScaler.py) scales the loss so that float16
gradients do not underflow. The gradients are sharded DTensors, and torch.amp.GradScaler
takes them as they are: finding inf/NaN in any process's shard skips the step everywhere,
so the shards stay in step (FSDP1 needed its own ShardedGradScaler for that).

Pitfall: --batch_size is per process. fp16 needs the scaler; bf16 (--amp_dtype bfloat16)
does not.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_FSDP_GradScaler.py --help` lists the flags.
"""
import torch
from torch.distributed.fsdp import fully_shard

from ampkit.engine import Parts, Variant
from ampkit.machinery.errors import report_user_errors
from ampkit.models import shard_units
from ampkit.train import Trainer


def build(parts: Parts) -> Variant:
    for block in shard_units(parts.model):  # each layer or residual block, then the root
        fully_shard(block)
    model = fully_shard(parts.model)
    criterion, optimizer = parts.criterion, parts.optimizer  # AdamW over this process's shards
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)
    scaler = torch.amp.GradScaler(parts.device.type)

    def train_step(images, targets):
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # gradients of loss x scale; FSDP2 reduce-scatters them
        scaler.step(optimizer)         # unscales them; skips the step if any is inf/NaN
        scaler.update()                # halves the scale after a skip, grows it after good steps
        return loss

    return Variant(model, train_step, autocast, scaler)


@report_user_errors
def main(argv=None):
    Trainer("train_FSDP_GradScaler", argv, ddp=True).fit(build)


if __name__ == "__main__":
    main()
