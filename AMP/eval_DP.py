"""Evaluate a checkpoint with nn.DataParallel: each test batch split over all visible GPUs.

    python AMP/eval_DP.py                        # newest last.pth in checkpoint/
    python AMP/eval_DP.py --checkpoint checkpoint/train_DDP/best.pth --autocast --batch_size 256

The checkpoint holds the bare model's weights: they are loaded into the model first, and the
model is wrapped afterwards (the article loaded a `module.`-prefixed state into it again at
every batch). Without CUDA, DataParallel just calls the model. With --autocast, the model
re-enters autocast with the run's dtype in each replica thread, for any --arch
(autocast_replicas, ampkit/models.py), as autocast state is thread-local. `--help` lists
the flags.
"""
from torch import nn

from ampkit.evaluate import Evaluation
from ampkit.machinery.config import parse_eval_args
from ampkit.machinery.process import report_user_errors


@report_user_errors
def main(argv=None):
    args = parse_eval_args("eval_DP", argv, __doc__)
    ev = Evaluation(args)  # device, checkpoint, test split, model with its weights
    model = nn.DataParallel(ev.model)  # all visible GPUs; each batch is split between them
    counts = ev.count_correct(model, range(ev.test_size))  # tensor([correct, seen])
    ev.report(*counts.tolist())


if __name__ == "__main__":
    main()
