"""The peer comparison's job (checks/peers.sh) written with HF accelerate, as its docs show.

    python checks/peers/accelerate_digits.py --data DIR --out DIR                 # one process
    OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision bf16 --dynamo_backend no \
        checks/peers/accelerate_digits.py --data DIR --out DIR --processes 2      # 2, on the CPU

AlexNet (10 classes) on the digits ImageFolder at 64 px, batch 64 per process, AdamW 1e-4,
ReduceLROnPlateau on the validation accuracy, bf16 autocast (--precision fp32: none), 3 epochs,
save_state every epoch.
On a machine without CUDA `accelerate launch --multi_gpu` is torchrun underneath and the
Accelerator makes a gloo group of CPU processes (MULTI_CPU); `--cpu` keeps it on the CPU where
there is a GPU (accelerate launch's `--cpu` alone starts one process: its multi-CPU path
is mpirun's). The world size is the launcher's; --processes only checks it.
"""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, models, transforms
from accelerate import Accelerator

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the digits ImageFolder (train/, val/)")
    p.add_argument("--out", required=True, help="where save_state writes, every epoch")
    p.add_argument("--epochs", type=int, default=3)
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
        transforms.Resize((64, 64), antialias=True), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    val_tf = transforms.Compose([
        transforms.Resize((64, 64), antialias=True),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_set = datasets.ImageFolder(f"{args.data}/train", transform=train_tf)
    val_set = datasets.ImageFolder(f"{args.data}/val", transform=val_tf)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=0, drop_last=False)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False,
                            num_workers=0, drop_last=False)

    torch.manual_seed(0)
    model = models.alexnet(num_classes=len(train_set.classes))
    criterion = nn.CrossEntropyLoss()
    # fused=True, as the project's scripts: on this CPU several times faster a step than the
    # default (foreach: ~0.9 s against ~0.15 s for AlexNet's 57M parameters).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=3)
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler)

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

        model.eval()
        correct, seen = 0, 0
        with torch.no_grad():
            for x, y in val_loader:
                preds = model(x).argmax(dim=1)
                preds, y = accelerator.gather_for_metrics((preds, y))  # without the padding
                correct += (preds == y).sum().item()
                seen += len(y)
        acc = correct / seen
        scheduler.step(acc)
        accelerator.save_state(args.out)  # model, optimizer, scheduler, random states
        own = int(sums[1])  # this process's training images (rank 0's is printed)
        loss_sum, images = accelerator.reduce(sums, "sum").tolist()
        accelerator.print(f"epoch {epoch + 1}/{args.epochs} loss {loss_sum / images:.4f} "
                          f"train {int(images)} images ({own} on rank 0) val {correct}/{seen} = "
                          f"{acc:.4f} {time.perf_counter() - t_epoch:.1f}s")
    accelerator.wait_for_everyone()
    accelerator.print(f"done: {args.epochs} epochs, {accelerator.num_processes} process(es) "
                      f"({accelerator.distributed_type}, {accelerator.mixed_precision}), "
                      f"{time.perf_counter() - t0:.1f}s after start-up")
    accelerator.end_training()


if __name__ == "__main__":
    main()
