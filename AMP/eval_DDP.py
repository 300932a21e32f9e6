"""Evaluate an AlexNet checkpoint with DistributedDataParallel: top-1 accuracy on the test split.

    torchrun --nproc_per_node=2 AMP/eval_DDP.py                      # the newest checkpoint under checkpoint/
    torchrun --nproc_per_node=2 AMP/eval_DDP.py --checkpoint checkpoint/train_DP_autocast/best.pth
"""
from ampkit.evaluate import main

if __name__ == "__main__":
    main(parallel="ddp")
