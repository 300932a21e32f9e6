"""Evaluate a checkpoint on one device: top-1 accuracy on the test split.

    python AMP/eval_without.py                   # newest last.pth in checkpoint/
    python AMP/eval_without.py --checkpoint checkpoint/train_DP_autocast/best.pth --autocast

Every variant's checkpoint loads here (weights are saved without DataParallel's or DDP's
`module.` prefix); the data set, its root and the image size default to the ones the
checkpoint was trained with. `--help` lists the flags.
"""
from ampkit.device import choose_device
from ampkit.evaluate import Evaluation
from ampkit.flags import parse_eval_args
from ampkit.run import report_user_errors


@report_user_errors
def main(argv=None):
    args = parse_eval_args("eval_without", argv, __doc__)
    device = choose_device(args.device)
    ev = Evaluation(args, device)
    ev.report(*ev.count(ev.model).tolist())


if __name__ == "__main__":
    main()
