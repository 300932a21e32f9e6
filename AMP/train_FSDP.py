"""Train with FSDP2 (fully_shard) in fp32: one process per GPU, each holding a shard of the model.

    torchrun --nproc_per_node=2 AMP/train_FSDP.py --epochs 20
    torchrun --nproc_per_node=2 AMP/train_FSDP.py --arch resnet50 --img_size 224

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_FSDP.py --epochs 20

As under DDP (train_DDP.py), each process trains on its own share of every epoch. Unlike
DDP, no process holds the whole model: fully_shard splits every parameter, its gradient and
its AdamW state across the processes. Before a block runs, its parameters are gathered
(all-gather) and they are freed after; backward reduce-scatters the gradients, so each
process gets the average over all processes of its shard, and AdamW steps on the shards.
Memory for parameters, gradients and optimizer state per process falls by the number of
processes, at the price of more communication: FSDP2 is for models that DDP cannot fit.

Pitfall: make the optimizer after fully_shard, which replaces the parameters with sharded
ones (parts.optimizer is made when first asked for). Checkpoints gather the full weights on
rank 0, so every eval script loads them. --batch_size is per process.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_FSDP.py --help` lists the flags.
"""
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

    def train_step(images, targets):
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # FSDP2 reduce-scatters the gradients during backward
        optimizer.step()
        return loss

    return Variant(model, train_step)


@report_user_errors
def main(argv=None):
    Trainer("train_FSDP", argv, ddp=True).fit(build)


if __name__ == "__main__":
    main()
