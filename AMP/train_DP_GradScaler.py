"""Train AlexNet with nn.DataParallel under autocast with GradScaler: all visible GPUs, fp16.

    python AMP/train_DP_GradScaler.py --epochs 20
    python AMP/train_DP_GradScaler.py --dp_scope features

DataParallel (see train_DP.py) splits each batch across the GPUs, one replica per GPU in its
own thread; autocast computes in float16; GradScaler (see train_GradScaler.py) scales the
loss so that float16 gradients do not underflow, and skips the steps whose gradients
overflow. The gradients are summed on GPU 0, where the one scaler and optimizer live.

Pitfall: autocast state is thread-local. DataParallel's replica threads re-enter autocast
with the caller's on/off flag but their own default dtype, so the model's forward re-enters
autocast itself with the run's dtype (autocast_in_replicas, ampkit/models.py). fp16 needs
the scaler; bf16 (--amp_dtype bfloat16) does not.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DP_GradScaler.py --help` lists the flags.
"""
import torch
from torch import nn

from ampkit.engine import Parts, Variant
from ampkit.machinery.errors import report_user_errors
from ampkit.models import autocast_in_replicas
from ampkit.train import Trainer


def build(parts: Parts) -> Variant:
    criterion, optimizer = parts.criterion, parts.optimizer
    # autocast is thread-local: the forward re-enters it in DP's replica threads (models.py)
    model = autocast_in_replicas(parts.model, parts.amp_dtype)
    if parts.dp_scope == "features":
        model.features = nn.DataParallel(model.features)  # the conv layers only
    else:
        model = nn.DataParallel(model)  # all visible GPUs; the batch is split between them
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

    return Variant(model, train_step, autocast, scaler)


@report_user_errors
def main(argv=None):
    Trainer("train_DP_GradScaler", argv).fit(build)


if __name__ == "__main__":
    main()
