"""Resuming a run: which checkpoint, whether it fits this run, and loading it.

``--resume`` (this variant's last.pth), ``--resume PATH``, or a torchrun restart, which
continues from last.pth by itself. Variant, data, image size and global batch (and, mid-
epoch, the world size) must match; what differs is said in one line. The weights go into
the bare model before it is wrapped; the other states wait for the script's ``build()``.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import checkpoint_files
from .config import plain
from .process import UserError


def resume_path(args, run_dir: Path) -> Optional[Path]:
    """The checkpoint this run continues, or None for a new run."""
    if args.resume == "auto":
        path = run_dir / checkpoint_files.LAST
        if not path.is_file():
            raise UserError(f"--resume: no checkpoint to resume at {path}")
        return path
    if args.resume:
        return checkpoint_files.resolve(Path(args.resume), "--resume")
    # Restarted by torchrun (--max-restarts): continue from the latest checkpoint.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and (run_dir / checkpoint_files.LAST).is_file():
        return run_dir / checkpoint_files.LAST
    return None


def what_this_rank_sees(args, run_dir: Path) -> tuple:
    """What this rank finds to resume (:func:`agreed_path` compares every rank's):
    (host, the path it looked at, found, why it cannot use it or None, its identity)."""
    try:
        mine, error = resume_path(args, run_dir), None
    except UserError as e:
        mine, error = None, str(e)
    looked = str(mine or (Path(args.resume) if args.resume not in (None, "auto")
                          else run_dir / checkpoint_files.LAST))
    identity, unreadable = _identity(mine)
    return socket.gethostname(), looked, mine is not None, error or unreadable, identity


def agreed_path(seen: List[tuple], rank: int) -> Optional[Path]:
    """The checkpoint ``rank`` resumes (None: a new run), from every rank's
    :func:`what_this_rank_sees` in rank order: rank 0's choice, which every rank must see.
    Each loads the file at its own
    path (its own ``--checkpoint``), which must be the one rank 0 resumes -- the same size and
    zip directory (``checkpoint.identity``); a rank that cannot read it stops every rank too.
    Rank 0 alone writes them, so on several nodes the folder must be shared (or copied): a
    node that sees no checkpoint, or another one, would start afresh or fail while its peers
    wait. Instead every rank stops with one line naming the first such rank, its host and
    its path."""
    host0, path0, found0, error0, identity0 = seen[0]
    if error0 is not None:
        raise UserError(error0)  # every rank stops; rank 0 says why
    if len(seen) == 1:  # one process: loading the file says what is wrong with it
        return Path(path0) if found0 else None
    for other, (host, path, found, error, identity) in enumerate(seen):
        if found and error is not None:  # it is there, but this rank cannot read it
            raise UserError(f"rank {other} on {host}: {error}")
    if not found0:
        return None  # a new run on every rank
    for other, (host, path, found, error, identity) in enumerate(seen):
        if identity != identity0:
            found = (f"cannot use it ({error})" if error is not None
                     else f"finds none at {path}" if not found
                     else f"finds another file at {path}")
            raise UserError(f"rank 0 on {host0} resumes {path0}, but rank {other} on {host} "
                            f"{found}: the checkpoint folder must be shared by every node "
                            "(--checkpoint on a shared file system), or the same file copied "
                            "to each")
    return Path(seen[rank][1])  # this rank's own path to the same file


def _identity(path: Optional[Path]) -> Tuple[Optional[Tuple[int, str]], Optional[str]]:
    """(the checkpoint's :func:`checkpoint_files.identity`, or None; why it cannot be read,
    or None)."""
    if path is None:
        return None, None
    try:
        with open(path, "rb") as f:
            return checkpoint_files.identity(f), None
    except OSError as e:
        return None, f"cannot read {path} ({e.strerror or e})"


def resume_mismatches(state: dict, args, world_size: int) -> List[str]:
    """What differs between a checkpoint and the run about to continue it, in words."""
    trained, diffs, variant = state.get("args") or {}, [], args.variant
    if state.get("variant", variant) != variant:
        diffs.append(f"it is a {state['variant']} run, this is {variant}")
    for key in ("dataset", "img_size", "arch"):
        if key in trained and trained[key] != getattr(args, key):
            diffs.append(f"--{key} {trained[key]} (this run: {getattr(args, key)})")
    root = trained.get("dataset_root")
    if root and args.dataset != "FakeData" and \
            Path(root).resolve() != Path(args.dataset_root).resolve():
        diffs.append(f"--dataset_root {root} (this run: {args.dataset_root})")
    world, batch, accum = state.get("world_size"), trained.get("batch_size"), \
        trained.get("accum_steps", 1)  # older checkpoints: no accumulation
    if world is not None and batch is not None:
        if world * batch * accum != world_size * args.batch_size * args.accum_steps:
            diffs.append(f"a global batch of {batch} x {accum} micro-batches x {world} "
                         f"processes (this run: {args.batch_size} x {args.accum_steps} x "
                         f"{world_size})")
        elif world != world_size and state.get("step", 0):
            diffs.append(f"{world} processes, stopped mid-epoch (this run: {world_size})")
    return diffs


@dataclass
class Resumed:
    """Where a run continues: its counters, and the states that wait for ``build()``."""
    path: Optional[Path] = None
    epoch: int = 0
    step: int = 0
    best_acc: float = -1.0
    best_epoch: int = -1
    states: Dict[str, Any] = field(default_factory=dict)  # optimizer, scheduler, ...
    trained: Dict[str, Any] = field(default_factory=dict)  # the checkpoint's run's flags
    identity: Optional[Tuple[int, str]] = None  # of the bytes loaded (checkpoint.identity)
    so_far: Optional[Dict[str, Any]] = None  # a stopped epoch's figures up to its stop
    streams: str = ""  # how this rank's random streams go on, when not as they were saved

    @property
    def loaded(self) -> Optional[Dict[str, Any]]:
        """What every rank must have loaded alike (``distributed.agree_on_resumed``)."""
        if self.path is None:
            return None
        return {"epoch": self.epoch, "step": self.step, "identity": self.identity}

    def step_in(self, epoch: int) -> int:
        """The step ``epoch`` starts from: a resumed epoch's, where its stop saved; else 0."""
        return self.step if epoch == self.epoch else 0

    def so_far_in(self, epoch: int) -> Optional[Dict[str, Any]]:
        """A resumed epoch's figures up to its stop (None: ``epoch`` starts afresh)."""
        return self.so_far if epoch == self.epoch else None


def load_resume(path: Path, args, model: nn.Module, device: torch.device,
                world_size: int, rank: int) -> Resumed:
    """Check ``path`` against this run, load its weights into the bare ``model`` and this
    rank's random streams (dropout's, per GPU too), so that it goes on drawing where the
    stopped run was."""
    state, identity = checkpoint_files.load_with_identity(path, map_location="cpu")
    if "optimizer" not in state:
        raise UserError(f"{path}: holds weights only (no optimizer state); cannot resume "
                        f"from it (--init_from {path} starts a new run from its weights)")
    diffs = resume_mismatches(state, args, world_size)
    if diffs:
        raise UserError(f"--resume {path} does not fit this run: {'; '.join(diffs)}. Resume "
                        f"with the same settings, or start a new run from its weights with "
                        f"--init_from {path}")
    checkpoint_files.load_weights(model, state, path)
    streams = _restore_random_states(state.get("rng"), rank, world_size, device)
    return Resumed(path, int(state["epoch"]), int(state.get("step", 0)),
                   float(state.get("best_acc", -1.0)), int(state.get("best_epoch", -1)),
                   {k: state.get(k) for k in ("optimizer", "scheduler", "scaler", "comm_hook")},
                   state.get("args") or {}, identity, state.get("epoch_so_far"), streams)


def _restore_random_states(saved: Any, rank: int, world_size: int,
                           device: torch.device) -> str:
    """This rank's saved streams back (``saved``: one entry per rank; an older checkpoint's
    dict: rank 0's alone). "" when restored; else what the streams are instead, in words."""
    if isinstance(saved, dict):  # written before every rank's streams were saved
        saved = [saved] if world_size == 1 else None
    if not isinstance(saved, list) or len(saved) != world_size:
        return (f"the random streams (dropout) start anew from --seed: the checkpoint holds "
                f"{len(saved) if isinstance(saved, list) else 'no'} rank's streams, this run "
                f"has {world_size} processes")
    mine = saved[rank]
    torch.set_rng_state(mine["torch"])
    cuda = mine.get("cuda")
    if device.type == "cuda" and cuda is not None:
        cuda = cuda if isinstance(cuda, list) else [cuda]  # older: this device's alone
        for index, state in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, index)
    return ""


def load_states(resumed: Resumed, technique, scheduler, args) -> str:
    """The LR schedule's and GradScaler's saved states, into the objects the script's
    ``build()`` made, after the optimizer's (``distributed.load_optimizer_state``, on every
    rank). Returns what this run changes against the checkpoint's run, in words ("" for
    nothing): see :func:`changes`."""
    if not resumed.states:
        return ""
    scheduler.load_state_dict(resumed.states["scheduler"])
    if technique.scaler is not None and resumed.states["scaler"]:
        technique.scaler.load_state_dict(resumed.states["scaler"])
    resumed.states = {}
    return changes(resumed.trained, args, technique.optimizer)


# Refused when they differ (resume_mismatches), or not flags of the run: not named again.
NOT_COMPARED = {"dataset", "dataset_root", "img_size", "arch", "variant", "resume", "init_from",
                "given", "lr"}


def changes(trained: Dict[str, Any], args, optimizer: torch.optim.Optimizer) -> str:
    """Every flag of this run that differs from the checkpoint's run, in one line; this run's
    value is used. The learning rate lives in the optimizer's saved state (the LR schedule
    may have lowered it): ``--lr`` on the command line sets it, else it goes on as saved."""
    now = {key: plain(value) for key, value in vars(args).items() if key not in NOT_COMPARED}
    notes = [f"--{key} {now[key]} (was {then})" for key, then in sorted(trained.items())
             if key in now and now[key] != then]
    saved_lr = optimizer.param_groups[0]["lr"]
    if "lr" in args.given and args.lr != saved_lr:
        for group in optimizer.param_groups:
            group["lr"] = args.lr
        notes.append(f"--lr {args.lr:g} (the optimizer was at {saved_lr:g}: now at {args.lr:g})")
    elif "lr" not in args.given and trained.get("lr", args.lr) != args.lr:
        notes.append(f"--lr not given: the optimizer goes on at its saved {saved_lr:g} (the run "
                     f"was started with --lr {trained['lr']:g}; give --lr to set it)")
    if not notes:
        return ""
    return "flags that differ from the checkpoint's run (this run's are used): " + "; ".join(notes)


def start_message(resumed: Resumed, args, changed: str = "") -> Optional[str]:
    """The lines that say where a resumed run, or one started from weights, begins, and
    (``changed``) what it changes against the checkpoint's run; None for a new run."""
    if resumed.path is not None and resumed.epoch >= args.epochs:
        return (f"{args.variant}: {resumed.path} has already trained {resumed.epoch} of "
                f"--epochs {args.epochs}; nothing to do (raise --epochs to train on)")
    if resumed.path is not None:
        return (f"resumed from {resumed.path}: epoch {resumed.epoch + 1}, step {resumed.step}"
                + (f"; {resumed.streams}" if resumed.streams else "")
                + (f"\n{changed}" if changed else ""))
    if args.init_from is not None:
        return f"starting from the weights of {args.init_from} (epoch 1, a new optimizer)"
    return None
