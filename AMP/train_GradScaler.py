"""Train AlexNet on one device under autocast with GradScaler: mixed precision with loss scaling.

    python AMP/train_GradScaler.py --epochs 20
    python AMP/train_GradScaler.py --amp_dtype bfloat16    # works, but bf16 needs no scaler

GradScaler multiplies the loss by a large factor (65536 at first) before backward(), so
float16 gradients that would underflow to zero stay representable. scaler.step() divides
the gradients by the factor again before the optimizer uses them, and skips the step when
they hold inf/NaN (the factor was too large); scaler.update() then halves the factor, and
doubles it after 2000 steps without overflow. The skipped steps are counted in the epoch
line and in TensorBoard.

Pitfall: fp16 needs loss scaling, bf16 does not: bfloat16 has float32's exponent range.
Anything that reads the gradients between backward() and step() (clipping, say) must call
scaler.unscale_(optimizer) first. The scaler's state is saved with the checkpoint.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_GradScaler.py --help` lists the flags.
"""
import torch

from ampkit.engine import Parts, Variant
from ampkit.machinery.errors import report_user_errors
from ampkit.train import Trainer


def build(parts: Parts) -> Variant:
    criterion, optimizer = parts.criterion, parts.optimizer
    model = parts.model
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
    Trainer("train_GradScaler", argv).fit(build)


if __name__ == "__main__":
    main()
