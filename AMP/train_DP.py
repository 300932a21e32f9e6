"""Train AlexNet with nn.DataParallel in fp32: one process drives all visible GPUs.

    python AMP/train_DP.py --epochs 20
    CUDA_VISIBLE_DEVICES=0,1 python AMP/train_DP.py --dp_scope features

Every step, DataParallel copies the model to each GPU, splits the batch between them,
runs the replicas in one thread per GPU, gathers the outputs on GPU 0, and backward()
sums the gradients there. One process and no launcher, but GPU 0 does extra work and the
copies and Python threads cost time: DistributedDataParallel (train_DDP.py) is faster and
is what PyTorch recommends. Without CUDA, DataParallel just calls the model.
--dp_scope features replicates only the convolutions (model.features), as pytorch/examples'
ImageNet script does for AlexNet: the 54M-parameter classifier then stays on GPU 0 and is
not copied every step.

Pitfall: --batch_size is the whole batch, split across the GPUs (under DDP it is per
process). The article saved the wrapped model, whose keys carry a `module.` prefix that
no unwrapped model loads; checkpoints here hold the bare model's weights.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DP.py --help` lists the flags.
"""
import torch

from ampkit.engine import Parts, Technique
from ampkit.machinery.config import parse_train_args
from ampkit.machinery.errors import report_user_errors
from ampkit.train import Trainer


def build(parts: Parts) -> Technique:
    model = parts.model
    if parts.dp_scope == "features":
        model.features = torch.nn.DataParallel(model.features)  # the conv layers only
    else:
        model = torch.nn.DataParallel(model)  # all visible GPUs; each batch split over them
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
    args = parse_train_args("train_DP", argv, __doc__)
    with Trainer(args) as trainer:  # device, run folder, data, model, resumed state
        technique = trainer.start(build)  # trained in one process's order, reshuffled each epoch
        for epoch in trainer.epochs():
            trainer.train_epoch(technique, epoch)  # train, validate, LR schedule, save, log


if __name__ == "__main__":
    main()
