"""Train AlexNet with DistributedDataParallel in fp32: one process per GPU, started by torchrun.

    torchrun --nproc_per_node=2 AMP/train_DDP.py --epochs 20
    python AMP/train_DDP.py --epochs 20      # a group of one process
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_DDP.py  # each node

Each process holds a whole replica, and backward() averages the gradients over the
processes (all-reduce, in buckets, overlapped with the rest of backward). DDP's recipe, and
the process group's of every DDP and FSDP2 script, is commented at its lines below.
Pitfall: --batch_size is per process (two at 64 train on 128 images a step); on several
nodes --checkpoint must be a folder every node sees.
"""
import contextlib
import math
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from ampkit.checkpoint import CheckpointManager, Progress
from ampkit.data import build_loaders
from ampkit.device import choose_device, refuse_unsupported, set_cuda_math
from ampkit.comm_hooks import CommHook
from ampkit.distributed import (GROUP_TIMEOUT, group_store, local_main_first, settle_buckets,
                                torchrun_ranks)
from ampkit.engine import Technique, count_correct, train_one_epoch
from ampkit.flags import parse_train_args
from ampkit.meters import Meters
from ampkit.models import compile_in_place, make_network
from ampkit.run import RunFolder, header_line, report_user_errors


def build(network, criterion, *, lr, clip_grad, comm_hook):
    # A whole replica, already on its device.
    model = torch.nn.parallel.DistributedDataParallel(network)
    # What the all-reduce sends (--comm_hook): the fp32 gradients, by DDP's own in C++ (a Python
    # hook adds ~20 ops a step), a hook's fp16/bf16 cast (half the bytes) or PowerSGD's factors.
    if comm_hook is not None:
        model.register_comm_hook(comm_hook.state, comm_hook.hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def forward_backward(images, targets, weight):
        loss = criterion(model(images), targets)
        loss.backward(torch.full_like(loss, weight))
        return loss.detach()

    def train_step(micro_batches):
        n = sum(len(y) for _, y in micro_batches)
        optimizer.zero_grad(set_to_none=True)
        losses = []
        # All micro-batches but the last inside no_sync, forward too: one all-reduce a step.
        for i, (x, y) in enumerate(micro_batches):
            with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                losses.append(forward_backward(x, y, len(y) / n))
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])
        if clip_grad is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_grad, norm)
        optimizer.step()
        return losses, norm

    return Technique(model, optimizer, train_step)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_DDP", argv, __doc__, process_group=True)
    # One process per device, in a group made from torchrun's RANK, WORLD_SIZE and
    # LOCAL_RANK.
    rank, world_size, local_rank = torchrun_ranks()
    device = choose_device(args.device, local_rank)
    # One line for a group on MPS (c10d moves no MPS tensors).
    refuse_unsupported(device, process_group=True)
    if device.type != "cpu":
        # Before any work on it, or every rank would use device 0.
        torch.accelerator.set_device_index(device.index)
    fp32_math = set_cuda_math(args.tf32, device)
    dist.init_process_group(dist.get_default_backend_for_device(device), rank=rank,
                            world_size=world_size, store=group_store(rank, world_size),
                            timeout=GROUP_TIMEOUT, device_id=device.index)
    # The group is left on every way out, a stop or an error too.
    try:
        return train(args, device=device, fp32_math=fp32_math)
    finally:
        dist.destroy_process_group()


def train(args, *, device, fp32_math):
    with RunFolder(args.checkpoint / args.variant, device,
                   args.tensorboard_log / args.variant if args.tensorboard else None) as run:
        # A download by one process per node, the others after it.
        with local_main_first(run.info):
            data = build_loaders(args.dataset, args.dataset_root, args.img_size,
                                 args.batch_size, run.info, loader=args.loader,
                                 num_workers=args.num_workers,
                                 channels_last=args.channels_last,
                                 train_subset=args.train_subset,
                                 skip_bad=args.skip_bad_images)
        # Each process its own share of the data, in an order new every epoch and the
        # same on every rank (set_epoch).
        sampler = DistributedSampler(data.train_set, shuffle=True, seed=args.seed)
        loader = data.train_loader(sampler)
        network = make_network(args.arch, data, run.info, seed=args.seed,
                               pretrained=args.pretrained, channels_last=args.channels_last)
        steps = args.epochs * math.ceil(len(loader) / args.accum_steps)
        comm_hook = None if args.comm_hook == "none" else CommHook(
            args.comm_hook, powersgd_rank=args.powersgd_rank,
            start_iter=args.powersgd_start_iter, run_steps=steps, seed=args.seed)
        technique = build(network, torch.nn.CrossEntropyLoss(), lr=args.lr,
                          clip_grad=args.clip_grad, comm_hook=comm_hook)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(technique.optimizer, mode="max",
                                                               patience=3)

        progress = Progress()
        state = {"model": network, "optimizer": technique.optimizer, "scheduler": scheduler,
                 "comm_hook": comm_hook, "progress": progress}
        # DDP's buckets in their final order from the first step, as in a run never stopped.
        settle_buckets(technique.model, data.image_shape, run.info, comm_hook)

        with (run.logger(args.epochs) as log,
              CheckpointManager(run.dir, state, run.info, save_every=args.save_every,
                                epochs=args.epochs, num_classes=data.num_classes,
                                args=args) as checkpoint,
              run.stop(log.print) as stop):
            checkpoint.load(args.resume, init_from=args.init_from, say=log.print)
            if args.compile:
                compile_in_place(technique.model, mode=args.compile)
            meters = Meters(technique, data, run.info, log, progress=progress, arch=args.arch,
                            accum_steps=args.accum_steps, peak_tflops=args.peak_tflops,
                            fp32_math=fp32_math, comm_hook=comm_hook,
                            profile_dir=run.dir / "profile" if args.profile else None)
            log.print(header_line(args.variant, technique, data, run.info,
                                  accum_steps=args.accum_steps, clip_grad=args.clip_grad,
                                  fp32_math=fp32_math))

            for epoch in range(progress.epoch, args.epochs):
                sampler.set_epoch(epoch)
                technique.model.train()
                stats = train_one_epoch(technique.train_step, loader, run.info, meters=meters,
                                        start=progress.step, accum_steps=args.accum_steps,
                                        stop=stop, log_every=args.log_every,
                                        desc=f"epoch {epoch + 1}/{args.epochs}")
                if stats.stopped_at is not None:
                    checkpoint.save_stop(stats)
                    break
                counts = count_correct(technique.model, data.val, run.info, technique.autocast,
                                       desc="val")
                # Every rank's counts summed.
                dist.all_reduce(counts)
                correct, seen = counts.tolist()
                scheduler.step(correct / seen)
                checkpoint.save(epoch + 1, val_acc=correct / seen)
                log.epoch(meters.row(epoch, stats, correct, seen) | checkpoint.timing)
            run.end(checkpoint, meters, stop, log)
    return run.status


if __name__ == "__main__":
    sys.exit(main())
