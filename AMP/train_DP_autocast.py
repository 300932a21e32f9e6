"""Train AlexNet with nn.DataParallel under autocast: all visible GPUs, mixed precision.

    python AMP/train_DP_autocast.py --epochs 20
    python AMP/train_DP_autocast.py --amp_dtype bfloat16 --dp_scope features

DataParallel (see train_DP.py) splits each batch across the GPUs and runs one replica per
GPU in its own thread; autocast (see train_autocast.py) runs convolutions and matmuls in
float16 (bfloat16 with --amp_dtype bfloat16) and keeps the weights in float32.

Pitfall: autocast state is thread-local. DataParallel's replica threads re-enter autocast
with the caller's on/off flag but their own default dtype (float16 on CUDA), so a bf16 run
would silently compute in fp16 there. The article decorated AlexNet's forward with
@autocast(); here whatever DataParallel replicates -- the model, or model.features with
--dp_scope features -- is wrapped so that it re-enters autocast with the run's dtype in
every thread (autocast_in_replicas, ampkit/models.py), for any --arch.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DP_autocast.py --help` lists the flags.
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

    def forward_backward(images, targets, weight):  # one micro-batch, its share of the step
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets) * weight
        loss.backward()  # adds its gradients to the step's
        return loss.detach()

    def train_step(window):  # one optimizer step over --accum_steps micro-batches
        n = sum(len(y) for _, y in window)  # its images (fewer at an epoch's end)
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for x, y in window:
            loss += forward_backward(x, y, len(y) / n)  # the mean over all n images
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), parts.clip_grad)
        optimizer.step()
        return loss, norm

    return Technique(model, optimizer, train_step, autocast)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_DP_autocast", argv, __doc__)
    with Trainer(args) as trainer:  # device, run folder, data, model, resumed state
        technique = trainer.start(build)  # trained in one process's order, reshuffled each epoch
        for epoch in trainer.epochs():
            trainer.train_epoch(technique, epoch)  # train, validate, LR schedule, save, log


if __name__ == "__main__":
    main()
