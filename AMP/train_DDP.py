"""Train AlexNet with DistributedDataParallel in fp32: one process per GPU, started by torchrun.

    torchrun --nproc_per_node=2 AMP/train_DDP.py --epochs 20
    python AMP/train_DDP.py --epochs 20      # one process (a group of one)

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_DDP.py --epochs 20

torchrun gives each process its RANK, LOCAL_RANK and WORLD_SIZE; the Trainer joins the
process group from them (NCCL on CUDA, gloo on the CPU), puts each process on GPU
LOCAL_RANK and gives it its own share of every epoch (DistributedSampler). Each process
holds a whole replica; during backward() DDP averages the gradients of all processes
(all-reduce, in buckets, overlapped with the rest of backward), so every replica takes
the same optimizer step. No thread, no per-step copy of the model: DDP is the default
way to use several GPUs.

Pitfall: --batch_size is per process: the global batch is batch_size x world size (two
processes at 64 train on 128 images a step). Only global rank 0 prints, logs and saves.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DDP.py --help` lists the flags.
"""
from torch.nn.parallel import DistributedDataParallel

from ampkit.engine import Parts, Variant
from ampkit.machinery.errors import report_user_errors
from ampkit.train import Trainer


def build(parts: Parts) -> Variant:
    criterion, optimizer = parts.criterion, parts.optimizer
    device = parts.device  # this process's GPU (cuda:LOCAL_RANK), or the CPU
    model = DistributedDataParallel(parts.model,
                                    device_ids=[device.index] if device.type == "cuda" else None)

    def train_step(images, targets):
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients during backward
        optimizer.step()
        return loss

    return Variant(model, train_step)


@report_user_errors
def main(argv=None):
    Trainer("train_DDP", argv, ddp=True).fit(build)


if __name__ == "__main__":
    main()
