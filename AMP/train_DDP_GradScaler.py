"""Train AlexNet with DistributedDataParallel, autocast and GradScaler: one process per GPU, fp16.

    torchrun --nproc_per_node=2 AMP/train_DDP_GradScaler.py --epochs 20
    python AMP/train_DDP_GradScaler.py --epochs 20      # a group of one process

Every process has its own scaler, and they stay in step: the gradients they unscale are the
same averaged ones, so all find the same inf/NaN, skip the same steps and keep the same
scale. DDP's recipe: train_DDP.py.
Pitfall: --batch_size is per process. fp16 needs the scaler; bf16 (--amp_dtype bfloat16)
does not.
"""
import contextlib
import math
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from ampkit.checkpoint import Saver, restore, resume
from ampkit.comm_hooks import CommHook
from ampkit.data import build_loaders
from ampkit.distributed import (GROUP_TIMEOUT, elastic_store, local_main_first, stop_vote,
                                torchrun_env)
from ampkit.engine import count_correct, train_one_epoch
from ampkit.errors import report_user_errors
from ampkit.flags import parse_train_args
from ampkit.log import header_line
from ampkit.meters import Meters
from ampkit.models import compile_in_place, make_network
from ampkit.precision import set_cuda_math
from ampkit.run_folder import RunFolder
from ampkit.technique import Parts, Technique


def build(parts: Parts) -> Technique:
    model = DistributedDataParallel(parts.network)
    if parts.comm_hook.name != "none":
        model.register_comm_hook(parts.comm_hook.state, parts.comm_hook.hook)
    criterion = parts.criterion
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.lr, fused=True)
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)
    scaler = torch.amp.GradScaler(parts.device.type)
    # The buckets carry scaled gradients: PowerSGD's error feedback follows the scale
    # (rescaled as it grows, dropped after a skipped step).
    parts.comm_hook.follow_scale(scaler)

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
            with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                losses.append(forward_backward(x, y, len(y) / n))
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])
        if parts.clip_grad is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), parts.clip_grad, norm)
        scaler.step(optimizer)
        scaler.update()
        return losses, norm

    return Technique(model, optimizer, train_step, autocast, scaler)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_DDP_GradScaler", argv, __doc__, process_group=True)
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
            steps = args.epochs * math.ceil(len(loader) / args.accum_steps)
            comm_hook = CommHook(args.comm_hook, powersgd_rank=args.powersgd_rank,
                                 start_iter=args.powersgd_start_iter, run_steps=steps,
                                 seed=args.seed)
            technique = build(Parts(network, lr=args.lr, clip_grad=args.clip_grad,
                                    amp_dtype=args.amp_dtype, comm_hook=comm_hook))
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(technique.optimizer, mode="max",
                                                                   patience=3)

            def training_state():
                return {"model": technique.model.module.state_dict(),
                        "optimizer": technique.optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": technique.scaler.state_dict(),
                        "comm_hook": comm_hook.state_dict()}

            with (run.logger(resumed, args.epochs) as log,
                  Saver(run.dir, run.info, resumed, save_every=args.save_every, epochs=args.epochs,
                        num_classes=data.num_classes, args=args) as saver,
                  stop_vote(run.info, log.print) as vote):
                restore(resumed, technique, scheduler, log, args=args, comm_hook=comm_hook)
                if args.compile:
                    compile_in_place(technique.model, mode=args.compile)
                meters = Meters(technique, data, run.info, resumed, log, arch=args.arch,
                                accum_steps=args.accum_steps, peak_tflops=args.peak_tflops,
                                comm_hook=comm_hook, fp32_math=fp32_math,
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
