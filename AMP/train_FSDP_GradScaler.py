"""Train with FSDP2 (fully_shard), autocast and GradScaler: one process per GPU, fp16.

    torchrun --nproc_per_node=2 AMP/train_FSDP_GradScaler.py --epochs 20

The gradients are sharded DTensors, and torch.amp.GradScaler takes them as they are: an
inf/NaN in any process's shard skips the step everywhere, so the shards stay in step (FSDP1
needed its own ShardedGradScaler for that). Sharding: train_FSDP.py; the process group:
train_DDP.py; loss scaling: train_GradScaler.py.
Pitfall: --batch_size is per process. fp16 needs the scaler; bf16 (--amp_dtype bfloat16)
does not.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler

from ampkit.checkpoint import CheckpointManager, Progress
from ampkit.data import build_loaders
from ampkit.device import choose_device, refuse_unsupported, resolve_amp_dtype, set_cuda_math
from ampkit.distributed import GROUP_TIMEOUT, group_store, local_main_first, torchrun_ranks
from ampkit.engine import Technique, count_correct, train_one_epoch
from ampkit.flags import parse_train_args
from ampkit.meters import Meters
from ampkit.models import compile_in_place, make_network, shard_units
from ampkit.run import RunFolder, header_line, report_user_errors


def build(network, criterion, *, device, lr, amp_dtype, clip_grad):
    model = network.to(memory_format=torch.contiguous_format)
    for block in shard_units(model):
        fully_shard(block)
    model = fully_shard(model)
    scaler = torch.amp.GradScaler(device.type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    autocast = torch.autocast(device.type, dtype=amp_dtype)

    def forward_backward(images, targets, weight):
        with autocast:
            loss = criterion(model(images), targets)
        scaler.scale(loss).backward(torch.full_like(loss, weight))
        return loss.detach()

    def train_step(micro_batches):
        n = sum(len(y) for _, y in micro_batches)
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            losses.append(forward_backward(x, y, len(y) / n))
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]).full_tensor()
        if clip_grad is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_grad, norm)
        scaler.step(optimizer)
        scaler.update()
        return losses, norm

    return Technique(model, optimizer, train_step, autocast, scaler)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_FSDP_GradScaler", argv, __doc__, process_group=True)
    rank, world_size, local_rank = torchrun_ranks()
    device = choose_device(args.device, local_rank)
    amp_dtype = resolve_amp_dtype(args.amp_dtype, device)
    refuse_unsupported(device, process_group=True, loss_scaling=True)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    fp32_math = set_cuda_math(args.tf32, device)
    dist.init_process_group(dist.get_default_backend_for_device(device), rank=rank,
                            world_size=world_size, store=group_store(rank, world_size),
                            timeout=GROUP_TIMEOUT, device_id=device.index)
    try:
        return train(args, device=device, amp_dtype=amp_dtype, fp32_math=fp32_math)
    finally:
        dist.destroy_process_group()


def train(args, *, device, amp_dtype, fp32_math):
    with RunFolder(args.checkpoint / args.variant, device,
                   args.tensorboard_log / args.variant if args.tensorboard else None) as run:
        with local_main_first(run.info):
            data = build_loaders(args.dataset, args.dataset_root, args.img_size,
                                 args.batch_size, run.info, loader=args.loader,
                                 num_workers=args.num_workers,
                                 channels_last=args.channels_last,
                                 train_subset=args.train_subset,
                                 skip_bad=args.skip_bad_images)
        sampler = DistributedSampler(data.train_set, shuffle=True, seed=args.seed)
        loader = data.train_loader(sampler)
        network = make_network(args.arch, data, run.info, seed=args.seed,
                               pretrained=args.pretrained, channels_last=args.channels_last)
        technique = build(network, torch.nn.CrossEntropyLoss(), device=device, lr=args.lr,
                          amp_dtype=amp_dtype, clip_grad=args.clip_grad)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(technique.optimizer, mode="max",
                                                               patience=3)

        progress = Progress()
        state = {"model": network, "optimizer": technique.optimizer, "scheduler": scheduler,
                 "scaler": technique.scaler, "progress": progress}

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
                            fp32_math=fp32_math,
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
                dist.all_reduce(counts)
                correct, seen = counts.tolist()
                scheduler.step(correct / seen)
                checkpoint.save(epoch + 1, val_acc=correct / seen)
                log.epoch(meters.row(epoch, stats, correct, seen) | checkpoint.timing)
            run.end(checkpoint, meters, stop, log)
    return run.status


if __name__ == "__main__":
    sys.exit(main())
