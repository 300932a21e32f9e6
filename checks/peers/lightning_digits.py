"""The peer comparison's job (checks/peers.sh) written with PyTorch Lightning, as its docs show.

    python checks/peers/lightning_digits.py --data DIR --out DIR --processes 1
    OMP_NUM_THREADS=1 python checks/peers/lightning_digits.py --data DIR --out DIR --processes 2

AlexNet (10 classes) on the digits ImageFolder at 64 px, batch 64 per process, AdamW 1e-4,
ReduceLROnPlateau on the validation accuracy, bf16-mixed (--precision fp32: 32-true), 3 epochs,
a checkpoint every epoch.
--processes 2: Trainer(accelerator="cpu", devices=2, strategy="ddp"), the docs' CPU DDP: the
Trainer starts the second process itself (this script again, as rank 1), a gloo group, and a
DistributedSampler for each loader. No progress bar (enable_progress_bar=False), no logger;
one line per epoch from rank 0.
"""
import argparse
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, models, transforms

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DigitsAlexNet(L.LightningModule):
    def __init__(self, num_classes: int, lr: float = 1e-4):
        super().__init__()
        self.lr = lr
        self.model = models.alexnet(num_classes=num_classes)
        self.criterion = nn.CrossEntropyLoss()
        self.counts = torch.zeros(2, dtype=torch.long)  # this rank's correct, seen
        self.images, self.t_epoch = 0, 0.0  # this rank's training images, the epoch's start

    def on_train_epoch_start(self):
        self.images, self.t_epoch = 0, time.perf_counter()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.images += len(y)
        return self.criterion(self.model(x), y)  # under the Trainer's precision (bf16 autocast)

    def on_validation_epoch_start(self):
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
        self.print(f"epoch {self.current_epoch + 1}/{self.trainer.max_epochs} train "
                   f"{self.images} images on rank 0, val {correct}/{seen} = {correct / seen:.4f} "
                   f"{time.perf_counter() - self.t_epoch:.1f}s")

    def configure_optimizers(self):
        # fused=True, as the project's scripts: on this CPU several times faster a step than
        # the default (foreach: ~0.9 s against ~0.15 s for AlexNet's 57M parameters).
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=3)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "val_acc", "interval": "epoch"}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the digits ImageFolder (train/, val/)")
    p.add_argument("--out", required=True, help="ModelCheckpoint's folder")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=64, help="per process")
    p.add_argument("--processes", type=int, default=1, help="CPU processes (DDP when > 1)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="bf16 autocast (the job), or fp32 where the CPU has no bf16 instructions")
    args = p.parse_args()
    t0 = time.perf_counter()

    train_tf = transforms.Compose([
        transforms.Resize((64, 64), antialias=True), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    val_tf = transforms.Compose([
        transforms.Resize((64, 64), antialias=True),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_set = datasets.ImageFolder(f"{args.data}/train", transform=train_tf)
    val_set = datasets.ImageFolder(f"{args.data}/val", transform=val_tf)
    # Under DDP the Trainer replaces the samplers by DistributedSamplers (shuffled for training).
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=0, drop_last=False)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False,
                            num_workers=0, drop_last=False)

    torch.manual_seed(0)
    module = DigitsAlexNet(len(train_set.classes))
    # save_last="link": one full checkpoint an epoch (epoch=N-step=M.ckpt, the previous one
    # removed) and last.ckpt a link to it; save_last=True would write the same state twice.
    checkpoint = ModelCheckpoint(dirpath=args.out, save_last="link", every_n_epochs=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.processes,
        strategy="ddp" if args.processes > 1 else "auto",
        precision="bf16-mixed" if args.precision == "bf16" else "32-true", max_epochs=args.epochs,
        enable_progress_bar=False, logger=False, callbacks=[checkpoint],
        num_sanity_val_steps=0)  # no extra validation batches before training: the same work
    trainer.fit(module, train_loader, val_loader)
    if trainer.is_global_zero:
        print(f"done: {args.epochs} epochs, {trainer.world_size} process(es), "
              f"{time.perf_counter() - t0:.1f}s after start-up; {checkpoint.last_model_path}",
              flush=True)


if __name__ == "__main__":
    main()
