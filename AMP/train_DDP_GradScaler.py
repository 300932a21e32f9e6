"""Train AlexNet with DistributedDataParallel, autocast and GradScaler: one process per GPU, fp16.

    torchrun --nproc_per_node=2 AMP/train_DDP_GradScaler.py --epochs 20
    python AMP/train_DDP_GradScaler.py --epochs 20      # one process (a group of one)

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_DDP_GradScaler.py

DDP (see train_DDP.py) runs one process per GPU and averages the gradients during
backward(); autocast computes in float16; GradScaler (see train_GradScaler.py) scales the
loss so float16 gradients do not underflow. Every process has its own scaler, and they
stay in step: the gradients they unscale are the same averaged ones, so all find the same
inf/NaN, skip the same steps and keep the same scale.

Pitfall: --batch_size is per process: the global batch is batch_size x world size.
fp16 needs the scaler; bf16 (--amp_dtype bfloat16) does not.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DDP_GradScaler.py --help` lists the flags.
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
    scaler = torch.amp.GradScaler(parts.device.type)

    def train_step(images, targets):
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # gradients of loss x scale; DDP all-reduces them
        scaler.step(optimizer)         # unscales them; skips the step if any is inf/NaN
        scaler.update()                # halves the scale after a skip, grows it after good steps
        return loss

    return Variant(model, train_step, autocast, scaler)


@report_user_errors
def main(argv=None):
    Trainer("train_DDP_GradScaler", argv, ddp=True).fit(build)


if __name__ == "__main__":
    main()
