"""Train AlexNet with nn.DataParallel in fp32 (no AMP).

    python AMP/train_DP.py --epochs 20

See --help for the flags; the loop itself is ampkit.engine.train_one_epoch.
"""
from ampkit.train import main

if __name__ == "__main__":
    main(parallel="dp", precision="fp32")
