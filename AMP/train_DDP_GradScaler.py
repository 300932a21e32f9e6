"""Train AlexNet with DistributedDataParallel under autocast with GradScaler loss scaling.

    torchrun --nproc_per_node=2 AMP/train_DDP_GradScaler.py --epochs 20

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_DDP_GradScaler.py --epochs 20

Under torchrun, --batch_size is per process. Plain `python AMP/train_DDP_GradScaler.py` runs one
process (world size 1).

See --help for the flags; the loop itself is ampkit.engine.train_one_epoch.
"""
from ampkit.train import main

if __name__ == "__main__":
    main(parallel="ddp", precision="grad_scaler")
