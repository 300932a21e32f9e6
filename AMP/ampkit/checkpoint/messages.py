"""What the checkpoint code says to the user, each in one line: apart from the logic, which
decides and calls these with what it found."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from ..errors import UserError, first_line

SHARED_FOLDER = ("the checkpoint folder must be shared by every node (--checkpoint on a shared "
                 "file system), or the same file copied to each")

# Refused when they differ (mismatches), or not flags of the run: not named again.
NOT_COMPARED = {"dataset", "dataset_root", "img_size", "arch", "train_subset", "variant",
                "resume", "init_from", "lr"}


class DiskFull(UserError):
    def __init__(self, path: Path, needed: int, free: int) -> None:
        kept = f"the previous {path.name} is unchanged" if path.is_file() else \
            f"nothing was written to {path.name}"
        super().__init__(f"cannot save {path}: it needs {needed / 2**20:,.0f} MB and "
                         f"{path.parent} has {free / 2**20:,.0f} MB free; {kept}. Free some "
                         "space, or give --checkpoint a folder on another disk, then --resume")


def load_failure(e: Exception) -> str:
    """Why torch.load failed, in a few words: the unpickler's own reason, not the advice on
    weights_only torch puts around it."""
    text = str(e)
    if type(e).__name__ == "UnpicklingError":
        lines = [ln.strip() for ln in text.split("WeightsUnpickler error:", 1)[-1].splitlines()
                 if ln.strip() and not ln.startswith(("Weights only load failed", "Check the"))]
        return f"not a PyTorch checkpoint ({(lines or [type(e).__name__])[0][:200]})"
    return f"truncated or corrupt checkpoint ({first_line(e)})"


def other_checkpoint(rank0: tuple, rank: int, theirs: tuple) -> str:
    """Rank ``rank`` found (or not) another checkpoint than rank 0: (host, path, found)."""
    (host0, path0, found0), (host, path, found) = rank0, theirs
    ours = f"resumes {path0}" if found0 else f"finds no checkpoint at {path0}"
    what = ("another file" if found0 else "one") if found else "none"
    return f"rank 0 on {host0} {ours}, but rank {rank} on {host} finds {what} at {path}: " \
        + SHARED_FOLDER


def mismatches(ckpt: dict, args, world_size: int, defaults: Dict[str, Any],
               mid_epoch: bool) -> List[str]:
    """What differs between a checkpoint and the run about to continue it, in words;
    ``defaults``: the flags' (what an older checkpoint's run had of a flag it predates);
    ``mid_epoch``: the checkpoint's run stopped within an epoch."""
    trained, diffs, variant = ckpt.get("args") or {}, [], args.variant
    if ckpt.get("variant", variant) != variant:
        diffs.append(f"it is a {ckpt['variant']} run, this is {variant}")
    for key in ("dataset", "img_size", "arch", "train_subset"):
        then, now = trained.get(key, defaults.get(key)), getattr(args, key)
        if trained and then != now:
            diffs.append(f"--{key} {_given(then)} (this run: {_given(now)})")
    root = trained.get("dataset_root")
    if root and args.dataset != "FakeData" and \
            Path(root).resolve() != Path(args.dataset_root).resolve():
        diffs.append(f"--dataset_root {root} (this run: {args.dataset_root})")
    # Older checkpoints have no accum_steps: they did not accumulate.
    world, batch, accum = ckpt.get("world_size"), trained.get("batch_size"), \
        trained.get("accum_steps", 1)
    if world is not None and batch is not None:
        if world * batch * accum != world_size * args.batch_size * args.accum_steps:
            diffs.append(f"a global batch of {batch} x {accum} micro-batches x {world} "
                         f"processes (this run: {args.batch_size} x {args.accum_steps} x "
                         f"{world_size})")
        elif world != world_size and mid_epoch:
            diffs.append(f"{world} processes, stopped mid-epoch (this run: {world_size})")
    return diffs


def _given(value: Any) -> str:
    return "not given" if value is None else str(value)


def changes(trained: Dict[str, Any], now: Dict[str, Any], lr: Optional[float],
            saved_lr: float, default_lr: float) -> str:
    """This run's flags (``now``, plain) that differ from the checkpoint's run's; ``lr``:
    --lr as given (None: the optimizer goes on at its ``saved_lr``)."""
    notes = [f"--{key} {now[key]} (was {then})" for key, then in sorted(trained.items())
             if key in now and key not in NOT_COMPARED and now[key] != then]
    started_lr = trained.get("lr") or default_lr
    if lr is not None and lr != saved_lr:
        notes.append(f"--lr {lr:g} (the optimizer was at {saved_lr:g}: now at {lr:g})")
    elif lr is None and started_lr != default_lr:
        notes.append(f"--lr not given: the optimizer goes on at its saved {saved_lr:g} (the run "
                     f"was started with --lr {started_lr:g}; give --lr to set it)")
    return ("flags that differ from the checkpoint's run (this run's are used): "
            + "; ".join(notes)) if notes else ""


def repaired(best: Path, held: Optional[tuple], epoch: int, acc: float, done: bool) -> str:
    """best.pth held ``held`` (epoch, val_acc) where last.pth's record names ``epoch``."""
    was = "nothing" if held is None else f"epoch {held[0]} (val_acc {held[1]:.4f})"
    if done:
        return f"{best} held {was}: restored epoch {epoch} (val_acc {acc:.4f}) from last.pth"
    return (f"{best} holds {was}, not the best epoch last.pth records (epoch {epoch}, "
            f"val_acc {acc:.4f}), whose weights no file holds: left as it is")


def start(path: Optional[Path], progress, variant: str, epochs: int,
          init_from: Optional[Path], changed: str = "") -> Optional[str]:
    """Where a run resumed from ``path`` (``progress``: where it stands now; ``changed``: what
    the resume did), or one from ``init_from``'s weights, begins; None for a new run."""
    if path is not None and progress.epoch >= epochs:
        return (f"{variant}: {path} has already trained {progress.epoch} of --epochs "
                f"{epochs}; nothing to do (raise --epochs to train on)"
                + (f"\n{changed}" if changed else ""))
    if path is not None:
        return (f"resumed from {path}: epoch {progress.epoch + 1}, step {progress.step}"
                + (f"\n{changed}" if changed else ""))
    if init_from is not None:
        return f"starting from the weights of {init_from} (epoch 1, a new optimizer)"
    return None


def saved(epoch: int, step: int) -> str:
    return f"epoch {epoch}" + (f" and {step} steps of the next" if step else "")


def abandoned(path: Path, holds: str, writing: Optional[str]) -> str:
    """A second Ctrl-C: what ``path`` (last.pth) holds; ``writing``: the save cut short."""
    if writing:
        return ((f"{path} still holds {holds}" if holds else f"no {path} was written")
                + f"; the save of {writing} was cut short and not kept")
    return f"{path} holds {holds}; nothing after it was saved" if holds else "nothing was saved"
