"""Train AlexNet on one device in fp32: the baseline the other variants are compared with.

    python AMP/train_without.py --epochs 20
    python AMP/train_without.py --dataset ImageFolder --dataset_root data/flowers --img_size 224

`build` below is the whole technique of this variant: the plain training step, with no
wrapper and no mixed precision, and its optimizer (AdamW, fused: one kernel for all the
parameters, several times faster than the default on the CPU too).

--accum_steps K: one optimizer step over K micro-batches of --batch_size, each one's loss
weighted by its share of the step's images, so a step is the mean over all of them; the
last step of an epoch may have fewer, and is not halved for it. --clip_grad N: the
gradients' norm is clipped to N before the step; it is logged per epoch either way.

What the article got wrong, fixed in the shared loop: it read the loss back with .item()
every step (the host waits for the GPU each time), stepped the LR schedule on the last
batch's loss, and shuffled nothing. Here the loss is read every --log_every steps, the
schedule steps on validation accuracy, and every epoch has a new order.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_without.py --help` lists the flags.
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

    def forward_backward(images, targets, weight):  # one micro-batch, its share of the step
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

    return Technique(model, optimizer, train_step)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_without", argv, __doc__)
    with Trainer(args) as trainer:  # device, run folder, data, model, resumed state
        technique = trainer.start(build)  # trained in one process's order, reshuffled each epoch
        for epoch in trainer.epochs():
            trainer.train_epoch(technique, epoch)  # train, validate, LR schedule, save, log


if __name__ == "__main__":
    main()
