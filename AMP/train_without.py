"""Train AlexNet on one device in fp32: the baseline the other variants are compared with.

    python AMP/train_without.py --epochs 20
    python AMP/train_without.py --dataset ImageFolder --dataset_root data/flowers --img_size 224
    python AMP/train_without.py --accum_steps 4 --clip_grad 1.0   # a step over 4 x 64 images

The loss is read on the host every --log_every steps, not every step (each read waits for
the GPU), the schedule steps on validation accuracy, and every epoch has a new order; the
loop, the stop and the checkpoint are commented here once for every script.
`python AMP/train_without.py --help` lists the flags.
"""
import sys

import torch

from ampkit.checkpoint import CheckpointManager, Progress
from ampkit.data import build_loaders, one_process_sampler
from ampkit.device import choose_device, set_cuda_math
from ampkit.engine import Technique, count_correct, train_one_epoch
from ampkit.flags import parse_train_args
from ampkit.meters import Meters
from ampkit.models import compile_in_place, make_network
from ampkit.run import RunFolder, header_line, report_user_errors


def build(network, criterion, *, lr, clip_grad):
    model = network
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def forward_backward(images, targets, weight):
        loss = criterion(model(images), targets)
        # backward() seeded with the weight instead of 1: the gradients of weight x loss,
        # without a multiply in the forward and another in the backward.
        loss.backward(torch.full_like(loss, weight))
        return loss.detach()

    def train_step(micro_batches):
        # One optimizer step over --accum_steps micro-batches, each loss weighted by its
        # share of the step's n images (fewer at an epoch's end): the gradients are the
        # mean over all n, as from one batch of n. Each micro-batch's mean loss is returned
        # as it is; the loop weighs them by their images on the host.
        n = sum(len(y) for _, y in micro_batches)
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for x, y in micro_batches:
            losses.append(forward_backward(x, y, len(y) / n))
        # The norm before clipping is logged every epoch; only --clip_grad scales the
        # gradients (clip_grad_norm_ would multiply them all by 1.0 without it).
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])
        if clip_grad is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_grad, norm)
        optimizer.step()
        return losses, norm

    return Technique(model, optimizer, train_step)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_without", argv, __doc__)
    device = choose_device(args.device)
    fp32_math = set_cuda_math(args.tf32, device)
    return train(args, device=device, fp32_math=fp32_math)


def train(args, *, device, fp32_math):
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
        # The same initial weights for every variant and world size: built from --seed.
        network = make_network(args.arch, data, run.info, seed=args.seed,
                               pretrained=args.pretrained, channels_last=args.channels_last)
        technique = build(network, torch.nn.CrossEntropyLoss(), lr=args.lr,
                          clip_grad=args.clip_grad)
        # On validation accuracy, stepped once an epoch.
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(technique.optimizer, mode="max",
                                                               patience=3)
        progress = Progress()

        # What a checkpoint holds, named once: each entry is saved by its state_dict() and
        # loaded back into the object of its name; "progress" is where the run stands.
        state = {"model": network, "optimizer": technique.optimizer, "scheduler": scheduler,
                 "progress": progress}

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
                # Dropout on (count_correct turns it off).
                technique.model.train()
                # The loss is read on the host every --log_every steps, not every step; 5
                # inf/NaN losses in a row end the run (a GradScaler's run skips those steps).
                stats = train_one_epoch(technique.train_step, loader, run.info, meters=meters,
                                        start=progress.step, accum_steps=args.accum_steps,
                                        stop=stop, log_every=args.log_every,
                                        desc=f"epoch {epoch + 1}/{args.epochs}")
                # A stop signal (a scheduler's SIGTERM, Ctrl-C): last.pth saved where it
                # stopped, for --resume.
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
