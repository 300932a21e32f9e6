"""checks/peers.sh's Fashion-MNIST job (JOB=fashion) with PyTorch Lightning, as its docs show.

    python checks/peers/lightning_fashion.py --data ROOT --subset FILE --out DIR --log FILE
    OMP_NUM_THREADS=1 python checks/peers/lightning_fashion.py --data ROOT --subset FILE \
        --out DIR --processes 2

ROOT is torchvision's layout (ROOT/FashionMNIST/raw/, the four idx files ungzipped); FILE the
training images to take, one index a line. AlexNet (10 classes) at 64 px, batch 64 per
process, AdamW 1e-4, ReduceLROnPlateau on the test accuracy, bf16-mixed (--precision fp32:
32-true), 2 epochs, each tested on the 10,000 test images, then a checkpoint. --log: a JSON row
an epoch (epoch, val_acc, train_time: the epoch's training loop in seconds), written as soon
as the epoch's accuracy is known, before ModelCheckpoint saves. --processes 2, the progress
bar, the logger and the lines printed as in lightning_digits.py.
"""
import argparse
import json
import time
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, models, transforms

# Fashion-MNIST's own statistics, on each of the three channels Grayscale(3) makes.
MEAN, STD = (0.2860,) * 3, (0.3530,) * 3


class FashionAlexNet(L.LightningModule):
    def __init__(self, num_classes: int, log_path: Optional[str] = None, lr: float = 1e-4):
        super().__init__()
        self.lr, self.log_path = lr, log_path
        self.model = models.alexnet(num_classes=num_classes)
        self.criterion = nn.CrossEntropyLoss()
        self.counts = torch.zeros(2, dtype=torch.long)  # this rank's correct, seen
        self.images, self.t_epoch, self.train_time = 0, 0.0, 0.0

    def on_train_epoch_start(self):
        self.images, self.t_epoch = 0, time.perf_counter()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.images += len(y)
        return self.criterion(self.model(x), y)  # under the Trainer's precision (bf16 autocast)

    def on_validation_epoch_start(self):
        # Validation runs after the epoch's last training step (no sanity check before).
        self.train_time = time.perf_counter() - self.t_epoch
        self.counts.zero_()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self.model(x).argmax(dim=1)
        self.counts += torch.stack([(preds == y).sum(), torch.tensor(len(y))])

    def on_validation_epoch_end(self):
        correct, seen = self.trainer.strategy.reduce(self.counts.clone(), reduce_op="sum").tolist()
        # What the schedule reads, the same on every rank (sync_dist: a mean of equal values,
        # which Lightning's DDP asks for; without it, it warns).
        self.log("val_acc", correct / seen, sync_dist=True)
        epoch = self.current_epoch + 1
        self.print(f"epoch {epoch}/{self.trainer.max_epochs} val_acc {correct / seen:.4f} "
                   f"({correct}/{seen}) train {self.images} images on rank 0 in "
                   f"{self.train_time:.1f}s, {time.perf_counter() - self.t_epoch:.1f}s with "
                   "the test", flush=True)
        if self.log_path and self.trainer.is_global_zero:
            with open(self.log_path, "a") as f:
                f.write(json.dumps({"epoch": epoch, "val_acc": correct / seen,
                                    "train_time": self.train_time}) + "\n")

    def configure_optimizers(self):
        # fused=True, as the project's scripts (several times faster a step on the CPU).
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=3)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "val_acc", "interval": "epoch"}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the root of torchvision's FashionMNIST")
    p.add_argument("--subset", required=True, help="the training images' indices, one a line")
    p.add_argument("--out", required=True, help="ModelCheckpoint's folder")
    p.add_argument("--log", default=None, help="a JSON line an epoch is appended here")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=64, help="per process")
    p.add_argument("--processes", type=int, default=1, help="CPU processes (DDP when > 1)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="bf16 autocast (the job), or fp32 where the CPU has no bf16 instructions")
    args = p.parse_args()
    t0 = time.perf_counter()

    train_tf = transforms.Compose([
        transforms.Resize(64), transforms.Grayscale(3), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    test_tf = transforms.Compose([
        transforms.Resize(64), transforms.Grayscale(3),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    full_train = datasets.FashionMNIST(args.data, train=True, transform=train_tf)
    with open(args.subset) as f:
        train_set = Subset(full_train, [int(line) for line in f])
    test_set = datasets.FashionMNIST(args.data, train=False, transform=test_tf)
    # Under DDP the Trainer replaces the samplers by DistributedSamplers (shuffled for training).
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=0, drop_last=False)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, shuffle=False,
                             num_workers=0, drop_last=False)

    torch.manual_seed(0)
    module = FashionAlexNet(len(full_train.classes), args.log)
    # save_last="link": one full checkpoint an epoch (the previous one removed) and last.ckpt
    # a link to it; save_last=True would write the same state twice.
    checkpoint = ModelCheckpoint(dirpath=args.out, save_last="link", every_n_epochs=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.processes,
        strategy="ddp" if args.processes > 1 else "auto",
        precision="bf16-mixed" if args.precision == "bf16" else "32-true", max_epochs=args.epochs,
        enable_progress_bar=False, logger=False, callbacks=[checkpoint],
        num_sanity_val_steps=0)  # no extra validation batches before training: the same work
    trainer.fit(module, train_loader, test_loader)
    if trainer.is_global_zero:
        print(f"done: {args.epochs} epochs, {trainer.world_size} process(es), "
              f"{time.perf_counter() - t0:.1f}s after start-up; {checkpoint.last_model_path}",
              flush=True)


if __name__ == "__main__":
    main()
