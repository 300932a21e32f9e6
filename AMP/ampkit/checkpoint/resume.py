"""Resuming a run, in the two calls a script makes, on every rank together: :func:`resume`
before ``build()`` wraps the network, :func:`restore` after it.

``resume``: the checkpoint to continue (``--resume``: this variant's last.pth; ``--resume
PATH``; or a torchrun restart, which continues from last.pth by itself) must fit this run
(variant, data, image size and global batch, and mid-epoch the world size); its weights go
into the bare network and this rank's random streams back. Each rank loads the file at its
own path, and one gather checks that every rank read the bytes rank 0 read (:func:`agree`).
``restore``: each other entry into the object of its name in the script's ``state``.
:class:`Resumed` then says where each epoch starts.
"""
from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..distributed import DistInfo, gather_from_ranks, load_state, torchrun_attempt
from ..errors import UserError
from ..flags import DEFAULT_LR, train_parser
from ..randomness import restore_random_state
from . import messages
from .files import (BEST, LAST, RECORD, RESUMING, args_to_plain, load, load_weights,
                    load_with_identity, resolve, weights_of)
from .validate import misfit, optimizer_misfit
from .writer import Link, atomic_save, link_or_write


@dataclass
class Resumed:
    """Where a run continues: its counters; ``state``, the entries that wait for ``build()``;
    ``trained``, the checkpoint's run's flags; ``identity``, of the bytes loaded;
    ``so_far``, a stopped epoch's figures up to its stop; ``streams``, how this rank's random
    streams go on when not as saved; ``repaired``, what was done to best.pth."""
    path: Optional[Path] = None
    epoch: int = 0
    step: int = 0
    best_acc: float = -1.0
    best_epoch: int = -1
    state: Dict[str, Any] = field(default_factory=dict)
    trained: Dict[str, Any] = field(default_factory=dict)
    identity: Optional[Tuple[int, str]] = None
    so_far: Optional[Dict[str, Any]] = None
    streams: str = ""
    repaired: str = ""

    def step_in(self, epoch: int) -> int:
        """The step ``epoch`` starts from: a resumed epoch's, where its stop saved; else 0."""
        return self.step if epoch == self.epoch else 0

    def so_far_in(self, epoch: int) -> Optional[Dict[str, Any]]:
        """A resumed epoch's figures up to its stop (None: ``epoch`` starts afresh)."""
        return self.so_far if epoch == self.epoch else None


def resume(resume_flag: Optional[str], run_dir: Path, network: nn.Module, info: DistInfo, *,
           init_from: Optional[Path], args) -> Resumed:
    """Where the run starts, before ``build()`` wraps the bare ``network``: the checkpoint
    ``resume_flag`` names (None, "auto" or a PATH) loaded into it, or for a new run
    ``init_from``'s weights (None: the network as built). ``args``: this run's flags."""
    resumed, path, error = Resumed(), None, None
    try:
        path = resume_path(resume_flag, run_dir)
        if path is not None:
            resumed = load_resume(path, args, network, info, run_dir)
    # This rank's failure: every rank stops, in one line.
    except UserError as e:
        error = str(e)
    looked = path or (run_dir / LAST if resume_flag in (None, "auto") else Path(resume_flag))
    agree(gather_from_ranks([(socket.gethostname(), str(looked), path is not None, error,
                              resumed.identity)], info))
    if path is None and init_from is not None:
        init_path = resolve(init_from, "--init_from")
        load_weights(network, load(init_path), init_path)
    return resumed


def resume_path(resume_flag: Optional[str], run_dir: Path) -> Optional[Path]:
    if resume_flag == "auto":
        if not (run_dir / LAST).is_file():
            raise UserError(f"--resume: no checkpoint to resume at {run_dir / LAST}")
        return run_dir / LAST
    if resume_flag:
        return resolve(Path(resume_flag), "--resume")
    # Restarted by torchrun (--max-restarts): continue from the latest checkpoint.
    if torchrun_attempt() > 0 and (run_dir / LAST).is_file():
        return run_dir / LAST
    return None


def agree(seen: List[tuple]) -> None:
    """Every rank's (host, the path it looked at, found, why it cannot use it, the identity
    of what it loaded), in rank order: each must have loaded what rank 0 loaded, or like it
    nothing; else every rank stops with one line naming the first rank that differs. Rank 0
    alone writes checkpoints: on several nodes the folder must be shared, or copied."""
    for rank, (host, path, found, error, _) in enumerate(seen):
        if found and error is not None:
            raise UserError(error if len(seen) == 1 else f"rank {rank} on {host}: {error}")
    host0, path0, found0, error0, identity0 = seen[0]
    for rank, (host, path, found, error, identity) in enumerate(seen[1:], 1):
        if (found, identity) != (found0, identity0):
            raise UserError(messages.other_checkpoint((host0, path0, found0), rank,
                                                      (host, path, found)))
    if error0 is not None:
        raise UserError(error0)


def load_resume(path: Path, args, network: nn.Module, info: DistInfo,
                run_dir: Optional[Path] = None) -> Resumed:
    """``path`` checked against this run, its weights loaded into the bare ``network`` and
    this rank's random streams (dropout's, per GPU too) set to go on where the stopped run
    was. Where ``path`` is ``run_dir``'s last.pth, rank 0 repairs its best.pth."""
    state, identity = load_with_identity(path)
    if "epoch" not in state:
        raise UserError(f"{path}: holds no epoch: not a checkpoint of a run (--init_from {path} "
                        "starts a new run from its weights)")
    if "optimizer" not in state:
        raise UserError(f"{path}: holds weights only (no optimizer state); cannot resume "
                        f"from it (--init_from {path} starts a new run from its weights)")
    # A flag an older checkpoint does not record did not exist then: its run had the default.
    defaults = vars(train_parser(args.variant).parse_args([]))
    diffs = messages.mismatches(state, args, info.world_size, defaults)
    if diffs:
        raise UserError(f"--resume {path} does not fit this run: {'; '.join(diffs)}. Resume "
                        f"with the same settings, or start a new run from its weights with "
                        f"--init_from {path}")
    load_weights(network, state, path)
    streams = restore_random_state(state.get("rng"), info.rank, info.world_size, info.device)
    repaired = ""
    if info.is_main and run_dir is not None and Path(path).resolve() == (run_dir / LAST).resolve():
        repaired = repair_best(Path(path), state)
    return Resumed(path, int(state["epoch"]), int(state.get("step", 0)),
                   float(state.get("best_acc", -1.0)), int(state.get("best_epoch", -1)),
                   {k: x for k, x in state.items() if k not in ("model", *RECORD, *RESUMING)},
                   state.get("args") or {}, identity, state.get("epoch_so_far"), streams,
                   repaired)


def repair_best(last: Path, state: Dict[str, Any]) -> str:
    """best.pth made to hold the best epoch last.pth's record names, where a kill between
    the two files, or a full disk at best.pth's write, left it behind or missing: a second
    name for last.pth if that is the best epoch, else written from the weights last.pth
    carries (``best_model``). What was done, in words ("" for nothing)."""
    epoch, acc = int(state.get("best_epoch", -1)), float(state.get("best_acc", -1.0))
    best = last.with_name(BEST)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            held = torch.load(best, map_location="cpu", weights_only=True, mmap=True)
        held = int(held["epoch"]), float(held["val_acc"])
    # Missing, truncated, not a checkpoint: nothing that names an epoch.
    except Exception:
        held = None
    if epoch < 1 or held == (epoch, acc):
        return ""
    if int(state["epoch"]) == epoch and not state.get("step"):
        link_or_write(Link(last, best, fallback=weights_of(state)))
    elif isinstance(state.get("best_model"), dict):
        atomic_save(weights_of(state) | {"model": state["best_model"], "epoch": epoch,
                                         "step": 0, "val_acc": acc}, best)
    else:
        return messages.repaired(best, held, epoch, acc, done=False)
    return messages.repaired(best, held, epoch, acc, done=True)


def restore(resumed: Resumed, state: Mapping[str, Any], log, *, args) -> None:
    """After ``build()``: each entry of the checkpoint but its weights into the object of the
    same name in the script's ``state``, by its ``load_state_dict`` (the optimizer keeps how
    it was built; over FSDP2 its full state is sharded again). An object the checkpoint
    holds nothing for starts anew, and an entry no object takes is left: both said, with
    where the run starts and the flags it changes (``args``: this run's), by ``log``."""
    notes = []
    for name in dict.fromkeys([*resumed.state, *state]) if resumed.path else ():
        saved, target = resumed.state.get(name), state.get(name)
        if name == "model":
            continue
        if target is None or saved is None:
            notes.append(f"the checkpoint's {name!r} is not restored: this run has none"
                         if target is None else f"{name} starts anew: the checkpoint holds none")
            continue
        why = (optimizer_misfit(saved, target) if isinstance(target, torch.optim.Optimizer)
               else misfit(saved, target.state_dict()))
        if why:
            raise UserError(f"{resumed.path}: its {name!r} does not fit this run's {name}: "
                            f"{why}")
        try:
            said = load_state(target, saved, state["model"])
        except (KeyError, RuntimeError, TypeError, ValueError) as e:
            # load_state_dict's reasons follow its first line: all of it, on one.
            why = " ".join(str(e).split())[:300] or type(e).__name__
            raise UserError(f"{resumed.path}: its {name!r} does not fit this run's {name} "
                            f"({why})") from None
        notes.append(said if isinstance(said, str) else "")
    optimizer = state.get("optimizer")
    if resumed.path and isinstance(optimizer, torch.optim.Optimizer):
        # The learning rate lives in the optimizer's saved state (the schedule may have
        # lowered it): --lr sets it, else it goes on as saved.
        saved_lr = optimizer.param_groups[0]["lr"]
        if args.lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = args.lr
        notes.append(messages.changes(resumed.trained, args_to_plain(args), args.lr, saved_lr,
                                      DEFAULT_LR))
    resumed.state = {}
    log.print(messages.start(resumed, args.variant, args.epochs, args.init_from,
                             "\n".join(filter(None, notes))))
