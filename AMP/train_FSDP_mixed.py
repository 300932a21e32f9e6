"""Train with FSDP2 (fully_shard) in its own mixed precision: MixedPrecisionPolicy, no autocast.

    torchrun --nproc_per_node=2 AMP/train_FSDP_mixed.py --epochs 20     # float16 (CUDA's default)
    torchrun --nproc_per_node=2 AMP/train_FSDP_mixed.py --amp_dtype bfloat16

MixedPrecisionPolicy casts per block, not per operator as autocast does: FSDP2 casts a
block's parameters to --amp_dtype as it gathers them (half the bytes moved) and the block
computes in it; gradients are reduced, and with --accum_steps added up, in float32 (or
--reduce_dtype: bfloat16 halves the bytes); shards, AdamW and loss stay float32 (as in torchtitan).
Pitfall: float16, in the blocks or on the wire, needs the GradScaler (off for bfloat16 alone).
Buffers are not cast: networks with BatchNorm take train_FSDP_autocast.py. Sharding:
train_FSDP.py; the process group: train_DDP.py; loss scaling: train_GradScaler.py.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler

from ampkit.checkpoint import CheckpointManager, Progress
from ampkit.data import build_loaders
from ampkit.device import choose_device, refuse_unsupported, resolve_amp_dtype, set_cuda_math
from ampkit.distributed import GROUP_TIMEOUT, group_store, local_main_first, torchrun_ranks
from ampkit.engine import Technique, count_correct, train_one_epoch
from ampkit.flags import parse_train_args
from ampkit.meters import Meters
from ampkit.models import check_param_dtype_fits, compile_in_place, make_network, shard_units
from ampkit.run import RunFolder, header_line, report_user_errors


def build(network, criterion, *, device, lr, amp_dtype, reduce_dtype, loss_scaling, clip_grad):
    check_param_dtype_fits(network)
    model = network.to(memory_format=torch.contiguous_format)
    for block in shard_units(model):
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=amp_dtype,
                                                          reduce_dtype=reduce_dtype))
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=reduce_dtype,
                                  output_dtype=torch.float32)
    model = fully_shard(model, mp_policy=policy)
    scaler = torch.amp.GradScaler(device.type, enabled=loss_scaling)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def forward_backward(images, targets, weight):
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

    return Technique(model, optimizer, train_step, scaler=scaler if loss_scaling else None,
                     mp_policy=policy)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_FSDP_mixed", argv, __doc__, process_group=True)
    rank, world_size, local_rank = torchrun_ranks()
    device = choose_device(args.device, local_rank)
    amp_dtype = resolve_amp_dtype(args.amp_dtype, device)
    reduce_dtype = getattr(torch, args.reduce_dtype)
    loss_scaling = torch.float16 in (amp_dtype, reduce_dtype)
    refuse_unsupported(device, process_group=True, loss_scaling=loss_scaling)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    fp32_math = set_cuda_math(args.tf32, device)
    dist.init_process_group(dist.get_default_backend_for_device(device), rank=rank,
                            world_size=world_size, store=group_store(rank, world_size),
                            timeout=GROUP_TIMEOUT, device_id=device.index)
    try:
        return train(args, device=device, amp_dtype=amp_dtype, reduce_dtype=reduce_dtype,
                     loss_scaling=loss_scaling, fp32_math=fp32_math)
    finally:
        dist.destroy_process_group()


def train(args, *, device, amp_dtype, reduce_dtype, loss_scaling, fp32_math):
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
        technique = build(network, torch.nn.CrossEntropyLoss(), device=device,
                          lr=args.lr, amp_dtype=amp_dtype, reduce_dtype=reduce_dtype,
                          loss_scaling=loss_scaling, clip_grad=args.clip_grad)
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
