"""Train AlexNet with nn.DataParallel under autocast: all visible GPUs, mixed precision.

    python AMP/train_DP_autocast.py --epochs 20
    python AMP/train_DP_autocast.py --amp_dtype bfloat16 --dp_scope features

DataParallel (see train_DP.py) splits each batch across the GPUs and runs one replica per
GPU in its own thread; autocast (see train_autocast.py) runs convolutions and matmuls in
float16 (bfloat16 with --amp_dtype bfloat16) and keeps the weights in float32.

Pitfall: autocast state is thread-local. DataParallel's replica threads re-enter autocast
with the caller's on/off flag but their own default dtype (float16 on CUDA), so a bf16 run
would silently compute in fp16 there. So the model's forward re-enters autocast itself with
the run's dtype, in every thread: AlexNet by its own amp_dtype (alexnet.py), any other
--arch in an AutocastForward wrapper (autocast_in_replicas, ampkit/models.py).
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DP_autocast.py --help` lists the flags.
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

    def train_step(images, targets):
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    return Variant(model, train_step, autocast)


@report_user_errors
def main(argv=None):
    Trainer("train_DP_autocast", argv).fit(build)


if __name__ == "__main__":
    main()
