"""Train AlexNet on one device in fp32: the baseline the other eight variants are compared with.

    python AMP/train_without.py --epochs 20
    python AMP/train_without.py --dataset ImageFolder --dataset_root data/flowers --img_size 224

The model, loss and optimizer come from ampkit.train.Trainer, which also runs the epoch
loop (data, validation, checkpoints, logs, resume): `build` below is the whole technique
of this variant -- the plain training step, with no wrapper and no mixed precision.
`python AMP/train_without.py --help` lists the flags.
"""
from ampkit.engine import Parts, Variant
from ampkit.machinery.errors import report_user_errors
from ampkit.train import Trainer


def build(parts: Parts) -> Variant:
    criterion, optimizer = parts.criterion, parts.optimizer
    model = parts.model

    def train_step(images, targets):
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    return Variant(model, train_step)


@report_user_errors
def main(argv=None):
    Trainer("train_without", argv).fit(build)


if __name__ == "__main__":
    main()
