"""Evaluate a checkpoint with nn.DataParallel: each test batch split over all visible GPUs.

    python AMP/eval_DP.py                        # newest last.pth in checkpoint/
    python AMP/eval_DP.py --checkpoint checkpoint/train_DDP/best.pth --autocast --batch_size 256

The checkpoint holds the bare model's weights: they are loaded into the model first, and the
model is wrapped afterwards. Without CUDA, DataParallel just calls the model. With --autocast,
AlexNet's forward re-enters autocast with the run's dtype in each replica thread (alexnet.py),
as autocast state is thread-local. `--help` lists the flags.
"""
from torch import nn

from ampkit.machinery.errors import report_user_errors
from ampkit.evaluate import Evaluation


@report_user_errors
def main(argv=None):
    ev = Evaluation("eval_DP", argv)  # flags, checkpoint, test split, model on the device
    model = nn.DataParallel(ev.model)  # all visible GPUs; each batch is split between them
    counts = ev.count_correct(model, range(ev.test_size))  # tensor([correct, seen])
    ev.report(*counts.tolist())


if __name__ == "__main__":
    main()
