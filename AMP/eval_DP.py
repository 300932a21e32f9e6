"""Evaluate a checkpoint with nn.DataParallel: each test batch split over all visible GPUs.

    python AMP/eval_DP.py                        # newest last.pth in checkpoint/
    python AMP/eval_DP.py --checkpoint checkpoint/train_DDP/best.pth --autocast --batch_size 256

The checkpoint holds the bare model's weights: they are loaded into the model once, and the
model is wrapped afterwards. Off CUDA the model runs as it is, without DataParallel. With
--autocast, the model re-enters autocast with the run's dtype in each replica thread, for any
--arch (autocast_replicas, ampkit/models.py), as autocast state is thread-local. `--help`
lists the flags.
"""
from torch import nn

from ampkit.device import choose_device, refuse_unsupported
from ampkit.evaluate import Evaluation
from ampkit.flags import parse_eval_args
from ampkit.run import report_user_errors


@report_user_errors
def main(argv=None):
    args = parse_eval_args("eval_DP", argv, __doc__)
    device = choose_device(args.device)
    refuse_unsupported(device, data_parallel=True)
    ev = Evaluation(args, device, data_parallel=True)
    # DataParallel is CUDA's: on another device it would still move the model to a GPU the
    # machine has, so there the model runs as it is.
    model = nn.DataParallel(ev.model) if device.type == "cuda" else ev.model
    ev.report(*ev.count(model).tolist())


if __name__ == "__main__":
    main()
