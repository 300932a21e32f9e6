"""Train AlexNet with nn.DataParallel under autocast: all visible GPUs, mixed precision.

    python AMP/train_DP_autocast.py --epochs 20
    python AMP/train_DP_autocast.py --amp_dtype bfloat16 --dp_scope features

Pitfall: autocast state is thread-local. DataParallel's replica threads re-enter autocast
with the caller's on/off flag but their own default dtype (float16 on CUDA), so a bf16 run
would silently compute in fp16 there. The article decorated AlexNet's forward with
@autocast(); here what DataParallel replicates (the model, or model.features) re-enters
autocast with the run's dtype in every thread, for any --arch (autocast_replicas).
"""
import sys

import torch

from ampkit.checkpoint import Saver, restore, resume
from ampkit.data import build_loaders
from ampkit.data.samplers import one_process_sampler
from ampkit.device import single_process_device
from ampkit.distributed import stop_vote
from ampkit.engine import count_correct, train_one_epoch
from ampkit.errors import report_user_errors
from ampkit.flags import parse_train_args
from ampkit.log import header_line
from ampkit.meters import Meters
from ampkit.models import autocast_replicas, compile_in_place, make_network
from ampkit.precision import set_cuda_math
from ampkit.run_folder import RunFolder
from ampkit.technique import Parts, Technique


def build(parts: Parts) -> Technique:
    model = parts.network
    # DataParallel replicates over CUDA GPUs alone: built on another device it would still
    # move the model to a GPU the machine has (it looks at the machine, not the model).
    # Elsewhere the model runs as it is.
    # autocast is thread-local, and DataParallel runs each replica in a thread of its
    # own: what it replicates re-enters autocast with the run's dtype there.
    if parts.device.type == "cuda" and parts.dp_scope == "features":
        model.features = torch.nn.DataParallel(autocast_replicas(model.features,
                                                                 parts.amp_dtype))
    elif parts.device.type == "cuda":
        model = torch.nn.DataParallel(autocast_replicas(model, parts.amp_dtype))
    criterion = parts.criterion
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.lr, fused=True)
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)

    def forward_backward(images, targets, weight):
        with autocast:
            loss = criterion(model(images), targets)
        loss.backward(torch.full_like(loss, weight))
        return loss.detach()

    def train_step(micro_batches):
        n = sum(len(y) for _, y in micro_batches)
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for x, y in micro_batches:
            losses.append(forward_backward(x, y, len(y) / n))
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])
        if parts.clip_grad is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), parts.clip_grad, norm)
        optimizer.step()
        return losses, norm

    return Technique(model, optimizer, train_step, autocast)


@report_user_errors
def main(argv=None):
    args = parse_train_args("train_DP_autocast", argv, __doc__)
    device = single_process_device(args.device, data_parallel=True)
    fp32_math = set_cuda_math(args.tf32, device)
    with RunFolder(args.checkpoint / args.variant, device,
                   args.tensorboard_log / args.variant if args.tensorboard else None) as run:
        data = build_loaders(args.dataset, args.dataset_root, args.img_size,
                             args.batch_size, run.info, loader=args.loader,
                             num_workers=args.num_workers,
                             channels_last=args.channels_last,
                             skip_bad=args.skip_bad_images)
        sampler = one_process_sampler(len(data.train_set), seed=args.seed)
        loader = data.train_loader(sampler)
        network = make_network(args.arch, data.num_classes, run.info, seed=args.seed,
                               pretrained=args.pretrained, channels_last=args.channels_last)
        resumed = resume(args.resume, run.dir, network, run.info, init_from=args.init_from,
                         args=args)
        technique = build(Parts(network, lr=args.lr, clip_grad=args.clip_grad,
                                amp_dtype=args.amp_dtype, dp_scope=args.dp_scope))
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(technique.optimizer, mode="max",
                                                               patience=3)

        def training_state():
            model = technique.model
            bare = model.module if isinstance(model, torch.nn.DataParallel) else model
            return {"model": bare.state_dict(),
                    "optimizer": technique.optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}

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
                                        max_nonfinite=5,
                                        stop=vote, log_every=args.log_every,
                                        desc=f"epoch {epoch + 1}/{args.epochs}")
                if stats.stopped_at is not None:
                    saver.save_stop(training_state, epoch, stats)
                    break
                counts = count_correct(technique.model, data.val, run.info, technique.autocast,
                                       desc="val")
                correct, seen = counts.tolist()
                scheduler.step(correct / seen)
                saver.save(training_state, epoch + 1, val_acc=correct / seen)
                log.epoch(meters.row(epoch, stats, correct, seen) | saver.timing)
            run.end(meters, saver, vote, log)
    return run.status


if __name__ == "__main__":
    sys.exit(main())
