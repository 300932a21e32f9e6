"""Evaluate an AlexNet checkpoint with a single device: top-1 accuracy on the test split.

    python AMP/eval_without.py                      # the newest checkpoint under checkpoint/
    python AMP/eval_without.py --checkpoint checkpoint/train_DP_autocast/best.pth
"""
from ampkit.evaluate import main

if __name__ == "__main__":
    main(parallel="single")
