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

from ampkit.engine import Parts, Technique
from ampkit.machinery.config import parse_train_args
from ampkit.machinery.errors import report_user_errors
from ampkit.models import autocast_replicas
from ampkit.train import Trainer


def build(parts: Parts) -> Technique:
    model = parts.model
    # autocast is thread-local: what DP replicates re-enters it in each replica's thread
    if parts.dp_scope == "features":  # the conv layers only
        model.features = torch.nn.DataParallel(autocast_replicas(model.features, parts.amp_dtype))
    else:  # all visible GPUs; each batch split over them
        model = torch.nn.DataParallel(autocast_replicas(model, parts.amp_dtype))
    criterion = parts.criterion
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.lr, fused=True)
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)
    scaler = torch.amp.GradScaler(parts.device.type)

    def forward_backward(images, targets, weight):  # one micro-batch, its share of the step
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets) * weight
        scaler.scale(loss).backward()  # adds the gradients of loss x scale to the step's
        return loss.detach()

    def train_step(window):  # one optimizer step over --accum_steps micro-batches
        n = sum(len(y) for _, y in window)  # its images (fewer at an epoch's end)
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for x, y in window:
            loss += forward_backward(x, y, len(y) / n)  # the mean over all n images
        scaler.unscale_(optimizer)  # once a step, before anything reads the gradients
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), parts.clip_grad)
        scaler.step(optimizer)  # skips the step if any gradient is inf/NaN
        scaler.update()         # halves the scale after a skip, grows it after good steps
        return loss, norm

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
