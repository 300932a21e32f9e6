"""Evaluate a checkpoint on one device: top-1 accuracy on the test split.

    python AMP/eval_without.py                   # newest last.pth in checkpoint/
    python AMP/eval_without.py --checkpoint checkpoint/train_DP_autocast/best.pth --autocast

Every variant's checkpoint loads here (weights are saved without DataParallel's or DDP's
`module.` prefix); the data set, its root and the image size default to the ones the
checkpoint was trained with. `--help` lists the flags.
"""
from ampkit.evaluate import Evaluation
from ampkit.machinery.config import parse_eval_args
from ampkit.machinery.process import report_user_errors


@report_user_errors
def main(argv=None):
    args = parse_eval_args("eval_without", argv, __doc__)
    ev = Evaluation(args)  # device, checkpoint, test split, model with its weights
    model = ev.model
    counts = ev.count_correct(model, range(ev.test_size))  # tensor([correct, seen])
    ev.report(*counts.tolist())


if __name__ == "__main__":
    main()
