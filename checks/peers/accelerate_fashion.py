"""checks/peers.sh's Fashion-MNIST job (JOB=fashion) with HF accelerate, as its docs show.

    python checks/peers/accelerate_fashion.py --data ROOT --subset FILE --out DIR --log FILE
    OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision bf16 --dynamo_backend no \
        checks/peers/accelerate_fashion.py --data ROOT --subset FILE --out DIR --processes 2

ROOT is torchvision's layout (ROOT/FashionMNIST/raw/, the four idx files ungzipped); FILE the
training images to take, one index a line. AlexNet (10 classes) at 64 px, batch 64 per
process, AdamW 1e-4, ReduceLROnPlateau on the test accuracy, bf16 autocast (--precision fp32:
none), 2 epochs, each tested on the 10,000 test images, then save_state. --log: a JSON row an
epoch (epoch, val_acc, train_time: the epoch's training loop in seconds), written as soon as
the epoch's accuracy is known, before its save. The launcher and --processes as in
accelerate_digits.py.
"""
import argparse
import json
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, models, transforms
from accelerate import Accelerator

# Fashion-MNIST's own statistics, on each of the three channels Grayscale(3) makes.
MEAN, STD = (0.2860,) * 3, (0.3530,) * 3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the root of torchvision's FashionMNIST")
    p.add_argument("--subset", required=True, help="the training images' indices, one a line")
    p.add_argument("--out", required=True, help="where save_state writes, every epoch")
    p.add_argument("--log", default=None, help="a JSON line an epoch is appended here")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=64, help="per process")
    p.add_argument("--processes", type=int, default=None, help="expected world size (a check)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="bf16 autocast (the job), or fp32 where the CPU has no bf16 instructions")
    args = p.parse_args()
    t0 = time.perf_counter()

    # step_scheduler_with_optimizer=False: the schedule steps once an epoch, on the accuracy
    # (otherwise accelerate steps a prepared scheduler once per process at every call).
    accelerator = Accelerator(mixed_precision="bf16" if args.precision == "bf16" else "no",
                              cpu=True, step_scheduler_with_optimizer=False)
    if args.processes is not None and args.processes != accelerator.num_processes:
        raise SystemExit(f"--processes {args.processes}, but the launcher started "
                         f"{accelerator.num_processes}")

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
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=0, drop_last=False)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, shuffle=False,
                             num_workers=0, drop_last=False)

    torch.manual_seed(0)
    model = models.alexnet(num_classes=len(full_train.classes))
    criterion = nn.CrossEntropyLoss()
    # fused=True, as the project's scripts (several times faster a step on the CPU).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=3)
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler)

    for epoch in range(args.epochs):
        t_epoch = time.perf_counter()
        model.train()
        sums = torch.zeros(2)  # loss x images, images
        for x, y in train_loader:
            optimizer.zero_grad(set_to_none=True)
            with accelerator.autocast():  # the model's forward autocasts already; the loss too
                loss = criterion(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            sums += torch.stack([loss.detach().float() * len(y), torch.tensor(float(len(y)))])
        train_time = time.perf_counter() - t_epoch

        model.eval()
        correct, seen = 0, 0
        with torch.no_grad():
            for x, y in test_loader:
                preds = model(x).argmax(dim=1)
                preds, y = accelerator.gather_for_metrics((preds, y))  # without the padding
                correct += (preds == y).sum().item()
                seen += len(y)
        acc = correct / seen
        scheduler.step(acc)
        own = int(sums[1])  # this process's training images (rank 0's is printed)
        loss_sum, images = accelerator.reduce(sums, "sum").tolist()
        accelerator.print(f"epoch {epoch + 1}/{args.epochs} train_loss {loss_sum / images:.4f} "
                          f"val_acc {acc:.4f} ({correct}/{seen}) train {int(images)} images "
                          f"({own} on rank 0) in {train_time:.1f}s, "
                          f"{time.perf_counter() - t_epoch:.1f}s with the test", flush=True)
        if args.log and accelerator.is_main_process:
            with open(args.log, "a") as f:
                f.write(json.dumps({"epoch": epoch + 1, "val_acc": acc,
                                    "train_time": train_time}) + "\n")
        accelerator.save_state(args.out)  # model, optimizer, scheduler, random states
    accelerator.wait_for_everyone()
    accelerator.print(f"done: {args.epochs} epochs, {accelerator.num_processes} process(es) "
                      f"({accelerator.distributed_type}, {accelerator.mixed_precision}), "
                      f"{time.perf_counter() - t0:.1f}s after start-up")
    accelerator.end_training()


if __name__ == "__main__":
    main()
