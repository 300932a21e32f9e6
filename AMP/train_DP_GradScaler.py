"""Train AlexNet with nn.DataParallel, autocast and GradScaler: all visible GPUs, fp16.

    python AMP/train_DP_GradScaler.py --epochs 20
    python AMP/train_DP_GradScaler.py --dp_scope features

One scaler for all the GPUs: DataParallel sums the replicas' gradients on GPU 0 before
scaler.step() looks at them. What DataParallel replicates re-enters autocast with the run's
dtype in every replica thread (train_DP_autocast.py).
Pitfall: fp16 needs the scaler, bf16 (--amp_dtype bfloat16) does not. --batch_size is the
whole batch, split across the GPUs.
"""
import sys

import torch

from ampkit.engine import count_correct, train_one_epoch
from ampkit.technique import Parts, Technique, make_parts
from ampkit.machinery.config import parse_train_args
from ampkit.machinery.data import build_loaders
from ampkit.machinery.errors import report_user_errors
from ampkit.machinery.samplers import one_process_sampler
from ampkit.models import autocast_replicas
from ampkit.train import Run


def build(parts: Parts) -> Technique:
    model = parts.model
    # autocast is thread-local: what DP replicates re-enters it in each replica's thread
    if parts.dp_scope == "features":  # the conv layers only
        model.features = torch.nn.DataParallel(autocast_replicas(model.features, parts.amp_dtype))
    else:  # all visible GPUs; each batch split over them
        model = torch.nn.DataParallel(autocast_replicas(model, parts.amp_dtype))
    criterion = parts.criterion
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.lr, fused=True)
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)
    scaler = torch.amp.GradScaler(parts.device.type)

    def forward_backward(images, targets, weight):  # one micro-batch, its share of the step
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets) * weight
        scaler.scale(loss).backward()  # adds the gradients of loss x scale to the step's
        return loss.detach()

    def train_step(window):  # one optimizer step over --accum_steps micro-batches
        n = sum(len(y) for _, y in window)  # its images (fewer at an epoch's end)
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for x, y in window:
            loss += forward_backward(x, y, len(y) / n)  # the mean over all n images
        scaler.unscale_(optimizer)  # once a step, before anything reads the gradients
        # The norm before clipping, logged every epoch; only --clip_grad scales the
        # gradients (clip_grad_norm_ would multiply them all by 1.0 without it).
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])
        if parts.clip_grad is not None:  # --clip_grad MAX_NORM: scaled down to it
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), parts.clip_grad, norm)
        scaler.step(optimizer)  # skips the step if any gradient is inf/NaN
        scaler.update()         # halves the scale after a skip, grows it after good steps
        return loss, norm

    return Technique(model, optimizer, train_step, autocast, scaler)


@report_user_errors  # a user's mistake: one line and exit status 2, never a traceback
def main(argv=None):
    args = parse_train_args("train_DP_GradScaler", argv, __doc__)
    with Run(args) as run:  # device, the run folder and its lock, the resume, the last line
        data = build_loaders(args.dataset, args.dataset_root, args.img_size,
                             args.batch_size, run.info, loader=args.loader,
                             num_workers=args.num_workers, channels_last=args.channels_last,
                             skip_bad=args.skip_bad_images)
        sampler = one_process_sampler(len(data.train_set), seed=args.seed)  # one process's
        loader = data.train_loader(sampler)  # its batches; resumable mid-epoch
        parts = make_parts(args, run.info, data.num_classes, len(data.train_set))
        run.resume(parts.model)  # the network from --seed, or a resumed run's weights
        t = build(parts)  # the model as the script wraps it, its optimizer and step
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(t.optimizer, mode="max",
                                                               patience=3)
        run.start(t, scheduler, data, loader, parts)  # resumed states, --compile, header

        def checkpoint():  # what is saved; rank 0 writes it, in the background
            # Without DataParallel's "module." prefix (the article kept it); inside
            # (--dp_scope features), the prefix is dropped when the file is written.
            bare = t.model.module if isinstance(t.model, torch.nn.DataParallel) else t.model
            return {"model": bare.state_dict(), "optimizer": t.optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": t.scaler.state_dict()}

        for epoch in run.epochs():  # from a resumed run's epoch on; none after a stop
            sampler.set_epoch(epoch)  # a new order every epoch
            start_step = run.begin_epoch(epoch)  # its clock; a resumed epoch's first step
            stats = train_one_epoch(  # the script's step on every window of the epoch
                t.step, loader, run.info, accum_steps=args.accum_steps, start_step=start_step,
                before=run.so_far(epoch), stop=run.vote, skipped=run.skipped,
                max_nonfinite=None,  # the scaler skips inf/NaN steps
                log_every=args.log_every, desc=f"epoch {epoch + 1}/{args.epochs}",
                input_format=run.input_format, profiler=run.profiler(epoch))
            if stats.stopped_at is not None:  # a signal: saved at that step, for --resume
                run.save(checkpoint, epoch, stopped=stats)  # at that step, the epoch so far
                break
            counts = count_correct(  # tensor([correct, seen]): top-1 on the validation split
                t.model, run.data.val, run.info, t.autocast, desc="val",
                input_format=run.input_format, image_shape=run.image_shape)
            correct, seen = counts.tolist()
            scheduler.step(correct / seen)  # on validation accuracy (mode="max")
            run.save(checkpoint, epoch + 1, val_acc=correct / seen)  # last.pth, best.pth
            run.log(epoch, stats, (correct, seen))  # the epoch's line, log.jsonl, TensorBoard
    return run.status  # 0, or 128 + the signal after a stop


if __name__ == "__main__":
    sys.exit(main())
