"""Train AlexNet with DistributedDataParallel under autocast: one process per GPU, mixed precision.

    torchrun --nproc_per_node=2 AMP/train_DDP_autocast.py --epochs 20
    python AMP/train_DDP_autocast.py --epochs 20      # a group of one process

autocast runs in each process's own thread, so unlike DataParallel nothing has to re-enter
it; the gradients DDP all-reduces are float32. DDP's recipe: train_DDP.py.
Pitfall: --batch_size is per process. float16 without a scaler may underflow:
train_DDP_GradScaler.py, or --amp_dtype bfloat16.
"""
import contextlib
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from ampkit.distributed import GROUP_TIMEOUT, elastic_store, local_main_first, torchrun_env
from ampkit.engine import count_correct, train_one_epoch
from ampkit.precision import compile_in_place
from ampkit.technique import Parts, Technique, make_parts
from ampkit.machinery.config import parse_train_args
from ampkit.machinery.data import build_loaders
from ampkit.machinery.log import header_line
from ampkit.machinery.process import report_user_errors
from ampkit.train import EpochFigures, RunFolder, Saver, restore, resume, stop_vote


def build(parts: Parts) -> Technique:
    model = parts.model  # on this process's device: cuda:LOCAL_RANK, or the CPU
    # A whole replica per process; backward() averages the gradients over them. The model is
    # on its device already (the article wrapped it first, then moved it).
    model = DistributedDataParallel(model)  # device_ids: the model's own device
    # What the all-reduce sends, bucket by bucket (--comm_hook): the fp32 gradients, or cast
    # to fp16/bf16 and back (half the bytes), or PowerSGD's low-rank factors; bytes counted.
    model.register_comm_hook(parts.comm_hook.state, parts.comm_hook.hook)
    criterion = parts.criterion
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.lr, fused=True)
    autocast = torch.autocast(parts.device.type, dtype=parts.amp_dtype)

    def forward_backward(images, targets, weight):  # one micro-batch, its share of the step
        with autocast:  # the forward pass and the loss; backward follows the forward's dtypes
            loss = criterion(model(images), targets) * weight
        loss.backward()  # adds its gradients to the step's
        return loss.detach()

    def train_step(micro_batches):  # one optimizer step over --accum_steps of them
        n = sum(len(y) for _, y in micro_batches)  # its images (fewer at an epoch's end)
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for i, (x, y) in enumerate(micro_batches):
            # All but the last inside no_sync, forward too: one all-reduce a step.
            with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                loss += forward_backward(x, y, len(y) / n)
        # The norm before clipping, logged every epoch; only --clip_grad scales the
        # gradients (clip_grad_norm_ would multiply them all by 1.0 without it).
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])
        if parts.clip_grad is not None:  # --clip_grad MAX_NORM: scaled down to it
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), parts.clip_grad, norm)
        optimizer.step()
        return loss, norm

    return Technique(model, optimizer, train_step, autocast)


@report_user_errors  # a user's mistake: one line and exit status 2, never a traceback
def main(argv=None):
    args = parse_train_args("train_DDP_autocast", argv, __doc__, process_group=True)
    # One process per GPU, in a group from torchrun's RANK, WORLD_SIZE and LOCAL_RANK (the
    # article set rank and address by hand, and used gloo on GPUs too).
    rank, world_size, device = torchrun_env(args.cuda)  # device: cuda:LOCAL_RANK, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank would use GPU 0
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=world_size, store=elastic_store(rank, world_size),
                            timeout=GROUP_TIMEOUT, device_id=device.index)  # None on the CPU
    try:  # the group is left on every way out: the end, a stop, an error
        with RunFolder(args, device) as run:  # the run folder and its lock; the last line
            with local_main_first(run.info):  # a download: one process per node, then the rest
                data = build_loaders(args.dataset, args.dataset_root, args.img_size,
                                     args.batch_size, run.info, loader=args.loader,
                                     num_workers=args.num_workers, channels_last=args.channels_last,
                                     skip_bad=args.skip_bad_images)
            # Each process its own share of the data; the article's never changed its order.
            sampler = DistributedSampler(data.train_set, shuffle=True, seed=args.seed)
            loader = data.train_loader(sampler)  # its batches; resumable mid-epoch
            parts = make_parts(args, run.info, data.num_classes, len(data.train_set))
            resumed = resume(run.resume_path, parts.model, args, run.info)  # its weights
            technique = build(parts)  # the model as the script wraps it, its optimizer and step
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(technique.optimizer, mode="max",
                                                                   patience=3)
            def checkpoint():  # rank 0 writes it: the unwrapped weights, without DDP's
                # "module." prefix (the article saved it on every rank, prefix and all)
                return {"model": technique.model.module.state_dict(),
                        "optimizer": technique.optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "comm_hook": parts.comm_hook.state_dict()}  # PowerSGD's step count

            # Rank 0's logger and saver (in the background), the stop vote: closed in reverse.
            with (run.logger(resumed) as log,
                  Saver(run.dir, args, run.info, resumed, data.num_classes) as saver,
                  stop_vote(run.info, log.print) as vote):
                restore(resumed, technique, scheduler, parts.comm_hook, args, log)  # saved states
                if args.compile:
                    compile_in_place(technique.model)  # torch.compile, around the wrapper
                figures = EpochFigures(args, run, technique, parts, resumed,
                                       loaders=(loader, data.val), log=log)
                log.print(header_line(args, run.info, technique, data, run.fp32_math))

                for epoch in range(resumed.epoch, args.epochs):  # from a resumed run's epoch on
                    sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
                    start_step = resumed.step_in(epoch)  # a resumed epoch's: where its stop saved
                    loader.sampler.start_index = start_step * args.batch_size * args.accum_steps
                    figures.begin_epoch()  # its clock and memory peak
                    technique.model.train()  # dropout on (count_correct turns it off)
                    stats = train_one_epoch(  # the script's step, over the epoch's batches
                        technique.train_step, loader, run.info, accum_steps=args.accum_steps,
                        start_step=start_step, before=resumed.so_far_in(epoch), stop=vote,
                        skipped=figures.skipped, max_nonfinite=5,  # 5 inf/NaN in a row: diverged
                        log_every=args.log_every, desc=f"epoch {epoch + 1}/{args.epochs}",
                        input_format=data.input_format, profiler=figures.profiler(epoch))
                    if stats.stopped_at is not None:  # a signal: every rank stopped at this step
                        saver.save_stop(checkpoint, epoch, stopped=stats)  # with its figures
                        break
                    counts = count_correct(  # tensor([correct, seen]) of this rank's shard
                        technique.model, data.val, run.info, technique.autocast, desc="val",
                        input_format=data.input_format, image_shape=data.image_shape)
                    dist.all_reduce(counts)  # exact (the article divided each rank's own count)
                    correct, seen = counts.tolist()
                    scheduler.step(correct / seen)  # on validation accuracy (mode="max")
                    saver.save(checkpoint, epoch + 1, val_acc=correct / seen)  # last.pth, best.pth
                    row = figures.row(epoch, stats, (correct, seen))  # every rank: it gathers
                    log.epoch(row | saver.timing, args.epochs, (correct, seen))  # line, jsonl, TB
                    if vote.any_rank_asked():  # a signal during validation, the save or the log
                        saver.save_stop(checkpoint, epoch + 1)  # unless last.pth is this point
                        break
                run.end(figures, saver, vote, log)  # the summary, or where a stop saved
    finally:
        dist.destroy_process_group()  # leave the group (the article never did)
    return run.status  # 0, or 128 + the signal after a stop


if __name__ == "__main__":
    sys.exit(main())
