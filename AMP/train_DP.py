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

Pitfall: --batch_size is the whole batch, split across the GPUs (under DDP it is per process).
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_DP.py --help` lists the flags.
"""
from torch import nn

from ampkit.engine import Parts, Variant
from ampkit.machinery.errors import report_user_errors
from ampkit.train import Trainer


def build(parts: Parts) -> Variant:
    criterion, optimizer = parts.criterion, parts.optimizer
    model = parts.model
    if parts.dp_scope == "features":
        model.features = nn.DataParallel(model.features)  # the conv layers only
    else:
        model = nn.DataParallel(model)  # all visible GPUs; the batch is split between them

    def train_step(images, targets):
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    return Variant(model, train_step)


@report_user_errors
def main(argv=None):
    Trainer("train_DP", argv).fit(build)


if __name__ == "__main__":
    main()
