"""Train AlexNet on one device under autocast with GradScaler: mixed precision with loss scaling.

    python AMP/train_GradScaler.py --epochs 20
    python AMP/train_GradScaler.py --amp_dtype bfloat16    # works, but bf16 needs no scaler

GradScaler multiplies the loss by a large factor (65536 at first) before backward(), so
float16 gradients that would underflow to zero stay representable. scaler.step() divides
the gradients by the factor again before the optimizer uses them, and skips the step when
they hold inf/NaN (the factor was too large); scaler.update() then halves the factor, and
doubles it after 2000 steps without overflow. The skipped steps are counted in the epoch
line and in TensorBoard. The article's torch.cuda.amp.GradScaler() is
torch.amp.GradScaler("cuda") now.

Pitfall: anything that reads the gradients (clipping, the norm) must come after
scaler.unscale_(optimizer), called once per optimizer step: with --accum_steps, after the
window's last backward(), never per micro-batch ("unscale_() has already been called");
step() and update() at the window's end only. fp16 needs loss scaling, bf16 does not.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_GradScaler.py --help` lists the flags.
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
    args = parse_train_args("train_GradScaler", argv, __doc__)
    with Trainer(args) as trainer:  # device, run folder, data, model, resumed state
        technique = trainer.start(build)  # trained in one process's order, reshuffled each epoch
        for epoch in trainer.epochs():
            trainer.train_epoch(technique, epoch)  # train, validate, LR schedule, save, log


if __name__ == "__main__":
    main()
