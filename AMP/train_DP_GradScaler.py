"""Train AlexNet with nn.DataParallel, autocast and GradScaler: all visible GPUs, fp16.

    python AMP/train_DP_GradScaler.py --epochs 20
    python AMP/train_DP_GradScaler.py --dp_scope features

DataParallel (see train_DP.py) runs one replica per GPU in its own thread; what it
replicates re-enters autocast with the run's dtype in every thread (see
train_DP_autocast.py); GradScaler (see train_GradScaler.py) scales the loss so float16
gradients do not underflow. There is one scaler: DataParallel sums the replicas'
gradients on GPU 0 before scaler.step() looks at them.

Pitfall: fp16 needs the scaler, bf16 (--amp_dtype bfloat16) does not. --batch_size is the
whole batch, split across the GPUs.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DP_GradScaler.py --help` lists the flags.
"""
import torch
from torch import nn

from ampkit.engine import Parts, Technique
from ampkit.machinery.config import parse_train_args
from ampkit.machinery.errors import report_user_errors
from ampkit.models import autocast_in_replicas
from ampkit.train import Trainer


def build(parts: Parts) -> Technique:
    model = parts.model
    # autocast is thread-local: what DP replicates re-enters it in each replica's thread
    if parts.dp_scope == "features":  # the conv layers only
        model.features = nn.DataParallel(autocast_in_replicas(model.features, parts.amp_dtype))
    else:  # all visible GPUs; the batch is split between them
        model = nn.DataParallel(autocast_in_replicas(model, parts.amp_dtype))
    criterion = parts.criterion
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.lr, fused=True)
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)
    scaler = torch.amp.GradScaler(parts.device.type)

    def train_step(images, targets):
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # gradients of loss x scale
        scaler.step(optimizer)         # unscales them; skips the step if any is inf/NaN
        scaler.update()                # halves the scale after a skip, grows it after good steps
        return loss

    return Technique(model, optimizer, train_step, autocast, scaler)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_DP_GradScaler", argv, __doc__)
    with Trainer(args) as trainer:  # device, run folder, data, model, resumed state
        technique = trainer.start(build)  # trained in one process's order, reshuffled each epoch
        for epoch in trainer.epochs():
            trainer.train_epoch(technique, epoch)  # train, validate, LR schedule, save, log


if __name__ == "__main__":
    main()
