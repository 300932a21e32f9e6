"""Train with FSDP2 (fully_shard), autocast and GradScaler: one process per GPU, fp16.

    torchrun --nproc_per_node=2 AMP/train_FSDP_GradScaler.py --epochs 20

The gradients are sharded DTensors, and torch.amp.GradScaler takes them as they are: an
inf/NaN in any process's shard skips the step everywhere, so the shards stay in step (FSDP1
needed its own ShardedGradScaler for that). Sharding: train_FSDP.py.
Pitfall: --batch_size is per process. fp16 needs the scaler; bf16 (--amp_dtype bfloat16)
does not.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler

from ampkit.checkpoint import Saver, restore, resume
from ampkit.data import build_loaders
from ampkit.distributed import (GROUP_TIMEOUT, elastic_store, local_main_first, stop_vote,
                                torchrun_env)
from ampkit.engine import count_correct, train_one_epoch
from ampkit.errors import report_user_errors
from ampkit.flags import parse_train_args
from ampkit.log import header_line
from ampkit.meters import Meters
from ampkit.models import compile_in_place, make_network, shard_units
from ampkit.precision import set_cuda_math
from ampkit.run_folder import RunFolder
from ampkit.technique import Parts, Technique


def build(parts: Parts) -> Technique:
    model = parts.network.to(memory_format=torch.contiguous_format)
    for block in shard_units(model):
        fully_shard(block)
    model = fully_shard(model)
    criterion = parts.criterion
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.lr, fused=True)
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)
    scaler = torch.amp.GradScaler(parts.device.type)

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
        if parts.clip_grad is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), parts.clip_grad, norm)
        scaler.step(optimizer)
        scaler.update()
        return losses, norm

    return Technique(model, optimizer, train_step, autocast, scaler)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_FSDP_GradScaler", argv, __doc__, process_group=True)
    rank, world_size, device = torchrun_env(args.device, loss_scaling=True)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(dist.get_default_backend_for_device(device), rank=rank,
                            world_size=world_size, store=elastic_store(rank, world_size),
                            timeout=GROUP_TIMEOUT, device_id=device.index)
    fp32_math = set_cuda_math(args.tf32, device)
    try:
        with RunFolder(args.checkpoint / args.variant, device,
                       args.tensorboard_log / args.variant if args.tensorboard else None) as run:
            with local_main_first(run.info):
                data = build_loaders(args.dataset, args.dataset_root, args.img_size,
                                     args.batch_size, run.info, loader=args.loader,
                                     num_workers=args.num_workers,
                                     channels_last=args.channels_last,
                                     skip_bad=args.skip_bad_images)
            sampler = DistributedSampler(data.train_set, shuffle=True, seed=args.seed)
            loader = data.train_loader(sampler)
            network = make_network(args.arch, data.num_classes, run.info, seed=args.seed,
                                   pretrained=args.pretrained, channels_last=args.channels_last)
            resumed = resume(args.resume, run.dir, network, run.info, init_from=args.init_from,
                             args=args)
            technique = build(Parts(network, lr=args.lr, clip_grad=args.clip_grad,
                                    amp_dtype=args.amp_dtype))
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(technique.optimizer, mode="max",
                                                                   patience=3)

            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            def training_state():
                model, optimizer = technique.model, technique.optimizer
                return {"model": get_model_state_dict(model, options=full),
                        "optimizer": get_optimizer_state_dict(model, optimizer, options=full),
                        "scheduler": scheduler.state_dict(),
                        "scaler": technique.scaler.state_dict()}

            with (run.logger(resumed, args.epochs) as log,
                  Saver(run.dir, run.info, resumed, save_every=args.save_every, epochs=args.epochs,
                        num_classes=data.num_classes, args=args) as saver,
                  stop_vote(run.info, log.print) as vote):
                restore(resumed, technique, scheduler, log, args=args)
                if args.compile:
                    compile_in_place(technique.model, mode=args.compile)
                meters = Meters(technique, data, run.info, resumed, log, arch=args.arch,
                                accum_steps=args.accum_steps, peak_tflops=args.peak_tflops,
                                fp32_math=fp32_math,
                                profile_dir=run.dir / "profile" if args.profile else None)
                log.print(header_line(args.variant, technique, data, run.info,
                                      accum_steps=args.accum_steps, clip_grad=args.clip_grad,
                                      fp32_math=fp32_math))

                for epoch in range(resumed.epoch, args.epochs):
                    sampler.set_epoch(epoch)
                    technique.model.train()
                    stats = train_one_epoch(technique.train_step, loader, run.info, epoch=epoch,
                                            meters=meters, accum_steps=args.accum_steps,
                                            max_nonfinite=None,
                                            stop=vote, log_every=args.log_every,
                                            desc=f"epoch {epoch + 1}/{args.epochs}")
                    if stats.stopped_at is not None:
                        saver.save_stop(training_state, epoch, stats)
                        break
                    counts = count_correct(technique.model, data.val, run.info, technique.autocast,
                                           desc="val")
                    dist.all_reduce(counts)
                    correct, seen = counts.tolist()
                    scheduler.step(correct / seen)
                    saver.save(training_state, epoch + 1, val_acc=correct / seen)
                    log.epoch(meters.row(epoch, stats, correct, seen) | saver.timing)
                run.end(meters, saver, vote, log)
    finally:
        dist.destroy_process_group()
    return run.status


if __name__ == "__main__":
    sys.exit(main())
