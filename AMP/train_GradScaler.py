"""Train AlexNet with a single device under autocast with GradScaler loss scaling.

    python AMP/train_GradScaler.py --epochs 20

See --help for the flags; the loop itself is ampkit.engine.train_one_epoch.
"""
from ampkit.train import main

if __name__ == "__main__":
    main(parallel="single", precision="grad_scaler")
