"""Train AlexNet on one device under autocast: mixed precision without loss scaling.

    python AMP/train_autocast.py --epochs 20
    python AMP/train_autocast.py --amp_dtype bfloat16      # GPUs from Ampere on, and the CPU

autocast runs each operator in the precision that suits it: convolutions and matmuls in
float16 (the default on CUDA) or bfloat16 (the default on the CPU); reductions, softmax and
the loss in float32. The weights, their gradients and the optimizer stay in float32, and
backward() needs no autocast: each operator's gradient runs in the dtype of its forward.
The article's torch.cuda.amp.autocast() is torch.autocast("cuda") now, and CUDA-only.

Pitfall: float16's range is narrow (its smallest normal number is 6e-5), so small gradients
can underflow to zero and training quietly stalls; GradScaler prevents that
(train_GradScaler.py). bfloat16 has float32's range and needs no scaler.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_autocast.py --help` lists the flags.
"""
import torch

from ampkit.engine import Parts, Technique
from ampkit.machinery.config import parse_train_args
from ampkit.machinery.errors import report_user_errors
from ampkit.train import Trainer


def build(parts: Parts) -> Technique:
    model = parts.model
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
    args = parse_train_args("train_autocast", argv, __doc__)
    with Trainer(args) as trainer:  # device, run folder, data, model, resumed state
        technique = trainer.start(build)  # trained in one process's order, reshuffled each epoch
        for epoch in trainer.epochs():
            trainer.train_epoch(technique, epoch)  # train, validate, LR schedule, save, log


if __name__ == "__main__":
    main()
