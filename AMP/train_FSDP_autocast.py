"""Train with FSDP2 (fully_shard) under autocast: sharded model, mixed-precision operators.

    torchrun --nproc_per_node=2 AMP/train_FSDP_autocast.py --epochs 20
    torchrun --nproc_per_node=2 AMP/train_FSDP_autocast.py --amp_dtype bfloat16 --arch resnet50

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_FSDP_autocast.py

FSDP2 (see train_FSDP.py) shards the parameters, gradients and optimizer state across the
processes; autocast (see train_autocast.py) runs convolutions and matmuls in float16
(bfloat16 with --amp_dtype bfloat16). The sharded parameters stay float32, and so do the
all-gathered ones and the reduce-scattered gradients: autocast casts each operator's inputs
as it runs. train_FSDP_mixed.py shows FSDP2's own mixed precision, which casts per block.

Pitfall: --batch_size is per process. float16 without a GradScaler risks underflowing
gradients (train_FSDP_GradScaler.py).
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_FSDP_autocast.py --help` lists the flags.
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

    def train_step(images, targets):
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # FSDP2 reduce-scatters the gradients during backward
        optimizer.step()
        return loss

    return Variant(model, train_step, autocast)


@report_user_errors
def main(argv=None):
    Trainer("train_FSDP_autocast", argv, ddp=True).fit(build)


if __name__ == "__main__":
    main()
