"""Train AlexNet with nn.DataParallel, autocast and GradScaler: all visible GPUs, fp16.

    python AMP/train_DP_GradScaler.py --epochs 20
    python AMP/train_DP_GradScaler.py --dp_scope features

One scaler for all the GPUs: DataParallel sums the replicas' gradients on GPU 0 before
scaler.step() looks at them. What DataParallel replicates re-enters autocast with the run's
dtype in every replica thread (train_DP_autocast.py); loss scaling: train_GradScaler.py.
Pitfall: fp16 needs the scaler, bf16 (--amp_dtype bfloat16) does not. --batch_size is the
whole batch, split across the GPUs.
"""
import sys

import torch

from ampkit.checkpoint import CheckpointManager, Progress
from ampkit.data import build_loaders, one_process_sampler
from ampkit.device import choose_device, refuse_unsupported, resolve_amp_dtype, set_cuda_math
from ampkit.engine import Technique, count_correct, train_one_epoch
from ampkit.flags import parse_train_args
from ampkit.meters import Meters
from ampkit.models import autocast_replicas, compile_in_place, make_network
from ampkit.run import RunFolder, header_line, report_user_errors


def build(network, criterion, *, device, lr, amp_dtype, clip_grad, dp_scope):
    model = network
    if device.type == "cuda" and dp_scope == "features":
        model.features = torch.nn.DataParallel(autocast_replicas(model.features, amp_dtype))
    elif device.type == "cuda":
        model = torch.nn.DataParallel(autocast_replicas(model, amp_dtype))
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
        for x, y in micro_batches:
            losses.append(forward_backward(x, y, len(y) / n))
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])
        if clip_grad is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_grad, norm)
        scaler.step(optimizer)
        scaler.update()
        return losses, norm

    return Technique(model, optimizer, train_step, autocast, scaler)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_DP_GradScaler", argv, __doc__)
    device = choose_device(args.device)
    amp_dtype = resolve_amp_dtype(args.amp_dtype, device, data_parallel=True)
    refuse_unsupported(device, data_parallel=True, loss_scaling=True)
    fp32_math = set_cuda_math(args.tf32, device)
    return train(args, device=device, amp_dtype=amp_dtype, fp32_math=fp32_math)


def train(args, *, device, amp_dtype, fp32_math):
    with RunFolder(args.checkpoint / args.variant, device,
                   args.tensorboard_log / args.variant if args.tensorboard else None) as run:
        data = build_loaders(args.dataset, args.dataset_root, args.img_size,
                             args.batch_size, run.info, loader=args.loader,
                             num_workers=args.num_workers,
                             channels_last=args.channels_last,
                             train_subset=args.train_subset,
                             skip_bad=args.skip_bad_images)
        sampler = one_process_sampler(len(data.train_set), seed=args.seed)
        loader = data.train_loader(sampler)
        network = make_network(args.arch, data, run.info, seed=args.seed,
                               pretrained=args.pretrained, channels_last=args.channels_last)
        technique = build(network, torch.nn.CrossEntropyLoss(), device=device, lr=args.lr,
                          amp_dtype=amp_dtype, clip_grad=args.clip_grad, dp_scope=args.dp_scope)
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
                                  fp32_math=fp32_math, data_parallel=True))

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
                correct, seen = counts.tolist()
                scheduler.step(correct / seen)
                checkpoint.save(epoch + 1, val_acc=correct / seen)
                log.epoch(meters.row(epoch, stats, correct, seen) | checkpoint.timing)
            run.end(checkpoint, meters, stop, log)
    return run.status


if __name__ == "__main__":
    sys.exit(main())
