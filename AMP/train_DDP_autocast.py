"""Train AlexNet with DistributedDataParallel under autocast: one process per GPU, mixed precision.

    torchrun --nproc_per_node=2 AMP/train_DDP_autocast.py --epochs 20
    torchrun --nproc_per_node=2 AMP/train_DDP_autocast.py --amp_dtype bfloat16

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_DDP_autocast.py

DDP (see train_DDP.py) runs one process per GPU and averages the gradients during
backward(); autocast (see train_autocast.py) runs convolutions and matmuls in float16
(bfloat16 with --amp_dtype bfloat16). The gradients stay float32, as the weights, so
the all-reduce moves float32. Each process is single-threaded, so autocast needs no help
here (compare train_DP_autocast.py).

Pitfall: --batch_size is per process: the global batch is batch_size x world size.
float16 without a GradScaler risks underflowing gradients (train_DDP_GradScaler.py).
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DDP_autocast.py --help` lists the flags.
"""
import torch
from torch.nn.parallel import DistributedDataParallel

from ampkit.engine import Parts, Variant
from ampkit.machinery.errors import report_user_errors
from ampkit.train import Trainer


def build(parts: Parts) -> Variant:
    criterion, optimizer = parts.criterion, parts.optimizer
    device = parts.device  # this process's GPU (cuda:LOCAL_RANK), or the CPU
    model = DistributedDataParallel(parts.model,
                                    device_ids=[device.index] if device.type == "cuda" else None)
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)

    def train_step(images, targets):
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients during backward
        optimizer.step()
        return loss

    return Variant(model, train_step, autocast)


@report_user_errors
def main(argv=None):
    Trainer("train_DDP_autocast", argv, ddp=True).fit(build)


if __name__ == "__main__":
    main()
