"""Resuming a run, in the two calls a script makes: :func:`resume` before ``build()`` wraps
the network, :func:`restore` after it.

``resume``: which checkpoint (``--resume``: this variant's last.pth; ``--resume PATH``; or a
torchrun restart, which continues from last.pth by itself), chosen by rank 0 and seen by
every rank; whether it fits this run (variant, data, image size and global batch, and
mid-epoch the world size, must match: what differs is said in one line); its weights into
the bare network and this rank's random streams back; every rank must have read the same
bytes. ``restore``: each other entry back into the object of its name in the script's
``state``, by its ``load_state_dict`` (the optimizer's: FSDP2's sharded again); where
the run starts, the flags it changes against the checkpoint's run, and an entry no object
took, said. :class:`Resumed` then says where each epoch starts.
Every rank makes both calls, together.
"""
from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from ..distributed import DistInfo, gather_from_ranks, load_state, torchrun_attempt
from ..errors import UserError
from ..flags import DEFAULT_LR
from ..randomness import restore_random_state
from . import files as checkpoint_files
from .files import entries_of, plain
from .writer import Link, atomic_save, link_or_write


def resume_path(resume_flag: Optional[str], run_dir: Path) -> Optional[Path]:
    """The checkpoint this run continues (``--resume``: None, "auto" or a PATH), or None for
    a new run."""
    if resume_flag == "auto":
        path = run_dir / checkpoint_files.LAST
        if not path.is_file():
            raise UserError(f"--resume: no checkpoint to resume at {path}")
        return path
    if resume_flag:
        return checkpoint_files.resolve(Path(resume_flag), "--resume")
    # Restarted by torchrun (--max-restarts): continue from the latest checkpoint.
    if torchrun_attempt() > 0 and (run_dir / checkpoint_files.LAST).is_file():
        return run_dir / checkpoint_files.LAST
    return None


def what_this_rank_sees(resume_flag: Optional[str], run_dir: Path) -> tuple:
    """What this rank finds to resume (:func:`agreed_path` compares every rank's):
    (host, the path it looked at, found, why it cannot use it or None, its identity)."""
    try:
        mine, error = resume_path(resume_flag, run_dir), None
    except UserError as e:
        mine, error = None, str(e)
    looked = str(mine or (Path(resume_flag) if resume_flag not in (None, "auto")
                          else run_dir / checkpoint_files.LAST))
    identity, unreadable = _identity(mine)
    return socket.gethostname(), looked, mine is not None, error or unreadable, identity


SHARED_FOLDER = ("the checkpoint folder must be shared by every node (--checkpoint on a shared "
                 "file system), or the same file copied to each")


def agreed_path(seen: List[tuple], rank: int) -> Optional[Path]:
    """The checkpoint ``rank`` resumes (None: a new run), from every rank's
    :func:`what_this_rank_sees` in rank order: rank 0's choice, which every rank must see.
    Each loads the file at its own
    path (its own ``--checkpoint``), which must be the one rank 0 resumes -- the same size and
    zip directory (``files.identity``); a rank that cannot read it stops every rank too.
    Rank 0 alone writes them, so on several nodes the folder must be shared (or copied): a
    node that sees no checkpoint, or another one, would start afresh or fail while its peers
    wait. Instead every rank stops with one line naming the first such rank, its host and
    its path -- also where ``--resume`` finds nothing for rank 0 but a checkpoint for
    another rank."""
    host0, path0, found0, error0, identity0 = seen[0]
    if error0 is not None:
        # Rank 0 finds no checkpoint where another rank finds one: the nodes see different
        # folders, the fault to name (rank 0's own error would send the user after a lost file).
        other = None if found0 else next((i for i, (_, _, found, _, _) in enumerate(seen)
                                          if found), None)
        if other is not None:
            raise UserError(f"--resume: rank 0 on {host0} finds no checkpoint at {path0}, but "
                            f"rank {other} on {seen[other][0]} finds one at {seen[other][1]}: "
                            + SHARED_FOLDER)
        raise UserError(error0)  # every rank stops; rank 0 says why
    # One process: loading the file says what is wrong with it.
    if len(seen) == 1:
        return Path(path0) if found0 else None
    for other, (host, path, found, error, identity) in enumerate(seen):
        if found and error is not None:
            raise UserError(f"rank {other} on {host}: {error}")
    if not found0:
        return None
    for other, (host, path, found, error, identity) in enumerate(seen):
        if identity != identity0:
            found = (f"cannot use it ({error})" if error is not None
                     else f"finds none at {path}" if not found
                     else f"finds another file at {path}")
            raise UserError(f"rank 0 on {host0} resumes {path0}, but rank {other} on {host} "
                            f"{found}: " + SHARED_FOLDER)
    # This rank's own path to the same file.
    return Path(seen[rank][1])


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
    """What differs between a checkpoint and the run about to continue it (``args``: this
    run's flags), in words."""
    trained, diffs, variant = state.get("args") or {}, [], args.variant
    if state.get("variant", variant) != variant:
        diffs.append(f"it is a {state['variant']} run, this is {variant}")
    for key in ("dataset", "img_size", "arch", "train_subset"):
        if key in trained and trained[key] != getattr(args, key):
            diffs.append(f"--{key} {trained[key]} (this run: {getattr(args, key)})")
    root = trained.get("dataset_root")
    if root and args.dataset != "FakeData" and \
            Path(root).resolve() != Path(args.dataset_root).resolve():
        diffs.append(f"--dataset_root {root} (this run: {args.dataset_root})")
    # Older checkpoints have no accum_steps: they did not accumulate.
    world, batch, accum = state.get("world_size"), trained.get("batch_size"), \
        trained.get("accum_steps", 1)
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
    """Where a run continues: its counters; ``state``, the entries that wait for ``build()``
    (all but the weights); ``trained``, the checkpoint's run's flags; ``identity``, of the
    bytes loaded (``files.identity``); ``so_far``, a stopped epoch's figures up to its stop;
    ``streams``, how this rank's random streams go on when not as saved; ``repaired``, what
    was done to best.pth to match the record (:func:`repair_best`)."""
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

    @property
    def loaded(self) -> Optional[Dict[str, Any]]:
        """What every rank must have loaded alike (:func:`_agree_on_resumed`)."""
        if self.path is None:
            return None
        return {"epoch": self.epoch, "step": self.step, "identity": self.identity}

    def step_in(self, epoch: int) -> int:
        """The step ``epoch`` starts from: a resumed epoch's, where its stop saved; else 0."""
        return self.step if epoch == self.epoch else 0

    def so_far_in(self, epoch: int) -> Optional[Dict[str, Any]]:
        """A resumed epoch's figures up to its stop (None: ``epoch`` starts afresh)."""
        return self.so_far if epoch == self.epoch else None


def load_resume(path: Path, args, network: nn.Module, info: DistInfo,
                run_dir: Optional[Path] = None) -> Resumed:
    """Check ``path`` against this run (``args``: its flags), load its weights into the bare
    ``network`` and this rank's random streams (dropout's, per GPU too), so that it goes on
    drawing where the stopped run was. ``path`` is ``run_dir``'s last.pth: rank 0 makes its
    best.pth hold the record's best epoch (:func:`repair_best`)."""
    state, identity = checkpoint_files.load_with_identity(path, map_location="cpu")
    if "optimizer" not in state:
        raise UserError(f"{path}: holds weights only (no optimizer state); cannot resume "
                        f"from it (--init_from {path} starts a new run from its weights)")
    diffs = resume_mismatches(state, args, info.world_size)
    if diffs:
        raise UserError(f"--resume {path} does not fit this run: {'; '.join(diffs)}. Resume "
                        f"with the same settings, or start a new run from its weights with "
                        f"--init_from {path}")
    checkpoint_files.load_weights(network, state, path)
    streams = restore_random_state(state.get("rng"), info.rank, info.world_size, info.device)
    repaired = ""
    if info.is_main and run_dir is not None and \
            Path(path).resolve() == (run_dir / checkpoint_files.LAST).resolve():
        repaired = repair_best(Path(path), state)
    return Resumed(path, int(state["epoch"]), int(state.get("step", 0)),
                   float(state.get("best_acc", -1.0)), int(state.get("best_epoch", -1)),
                   entries_of(state), state.get("args") or {}, identity,
                   state.get("epoch_so_far"), streams, repaired)


def repair_best(last: Path, state: Dict[str, Any]) -> str:
    """best.pth beside ``last`` made to hold the best epoch that last.pth's record names
    (``state``: last.pth's, loaded), where a kill between the two files, or a full disk at
    best.pth's write, left it behind or missing: a second name for last.pth when that is
    the best epoch, else written from the weights last.pth carries (``best_model``). What
    was done, in words ("" for nothing)."""
    epoch, acc = int(state.get("best_epoch", -1)), float(state.get("best_acc", -1.0))
    best = last.with_name(checkpoint_files.BEST)
    held = _record_of(best)
    if epoch < 1 or held == (epoch, acc):
        return ""
    if int(state["epoch"]) == epoch and not state.get("step"):
        link_or_write(Link(last, best, fallback=checkpoint_files.weights_of(state)))
    elif isinstance(state.get("best_model"), dict):
        atomic_save(checkpoint_files.weights_of(state) | {
            "model": state["best_model"], "epoch": epoch, "step": 0, "val_acc": acc}, best)
    else:
        return (f"{best} holds {_held(held)}, not the best epoch last.pth records (epoch "
                f"{epoch}, val_acc {acc:.4f}), whose weights no file holds: left as it is")
    return f"{best} held {_held(held)}: restored epoch {epoch} (val_acc {acc:.4f}) from {last}"


def _record_of(best: Path) -> Optional[Tuple[int, float]]:
    """(epoch, val_acc) of the checkpoint at ``best``; None if there is none to read."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(best, map_location="cpu", weights_only=True, mmap=True)
        return int(state["epoch"]), float(state["val_acc"])
    # Missing, truncated, not a checkpoint: nothing that names an epoch.
    except Exception:
        return None


def _held(record: Optional[Tuple[int, float]]) -> str:
    return "nothing" if record is None else f"epoch {record[0]} (val_acc {record[1]:.4f})"


def resume(resume_flag: Optional[str], run_dir: Path, network: nn.Module, info: DistInfo, *,
           init_from: Optional[Path], args) -> Resumed:
    """Where the run starts, before ``build()`` wraps the bare ``network``: the checkpoint to
    continue (``--resume``, or a torchrun restart; rank 0's choice, which every rank must see:
    :func:`agreed_path`) loaded into it, or for a new run ``init_from``'s weights (None: the
    network as built). ``args``: this run's flags, which the checkpoint's must fit. Every rank
    together: each must have read the same bytes, or every rank stops with one line."""
    seen = gather_from_ranks([what_this_rank_sees(resume_flag, run_dir)], info)
    path = agreed_path(seen, info.rank)
    resumed, failed = Resumed(), None
    try:
        if path is not None:
            resumed = load_resume(path, args, network, info, run_dir)
    # This rank's failure: every rank stops, in one line.
    except UserError as e:
        failed = str(e)
    _agree_on_resumed(failed or resumed.loaded, info)
    if path is None and init_from is not None:
        checkpoint_files.load_weights_from(network, init_from, "--init_from")
    return resumed


def restore(resumed: Resumed, state: Mapping[str, Any], log, *, args) -> None:
    """After ``build()``: each entry of the checkpoint (but its weights, loaded before) back
    into the object of the same name in the script's ``state`` (the Saver's) by its
    ``load_state_dict``; an object the checkpoint holds nothing for starts anew, and an
    entry no object takes is not restored: both said. A saved state that does not fit its
    object is one line. The optimizer keeps how it was built (fused) and, over an FSDP2
    model, has its full state sharded again. What a loading says (a comm hook's step count)
    is said by ``log``, with where the run starts and the flags it changes against the
    checkpoint's run (``args``: this run's)."""
    notes = []
    if resumed.path is not None:
        for name in dict.fromkeys([*resumed.state, *state]):
            saved, target = resumed.state.get(name), state.get(name)
            if name == "model":
                continue
            if target is None or saved is None:
                notes.append(f"the checkpoint's {name!r} is not restored: this run has none"
                             if target is None else f"{name} starts anew: the checkpoint "
                             "holds none")
                continue
            try:
                said = load_state(target, saved, state["model"])
            except (KeyError, RuntimeError, TypeError, ValueError) as e:
                # load_state_dict's reasons follow its first line: all of it, on one.
                why = " ".join(str(e).split())[:300] or type(e).__name__
                raise UserError(f"{resumed.path}: its {name!r} does not fit this run's {name} "
                                f"({why})") from None
            notes.append(said if isinstance(said, str) else "")
        if resumed.state and isinstance(state.get("optimizer"), torch.optim.Optimizer):
            notes.append(changes(resumed.trained, args, state["optimizer"]))
    resumed.state = {}
    log.print(start_message(resumed, args.variant, args.epochs, args.init_from,
                            "\n".join(filter(None, notes))))


# Refused when they differ (resume_mismatches), or not flags of the run: not named again.
NOT_COMPARED = {"dataset", "dataset_root", "img_size", "arch", "train_subset", "variant", "resume",
                "init_from", "lr", "start_lr"}


def changes(trained: Dict[str, Any], args, optimizer: torch.optim.Optimizer) -> str:
    """Every flag of this run that differs from the checkpoint's run, in one line; this run's
    value is used. The learning rate lives in the optimizer's saved state (the LR schedule
    may have lowered it): ``--lr`` on the command line sets it, else it goes on as saved."""
    now = {key: plain(value) for key, value in vars(args).items() if key not in NOT_COMPARED}
    notes = [f"--{key} {now[key]} (was {then})" for key, then in sorted(trained.items())
             if key in now and now[key] != then]
    saved_lr, started_lr = optimizer.param_groups[0]["lr"], trained.get("lr") or DEFAULT_LR
    if args.lr is not None and args.lr != saved_lr:
        for group in optimizer.param_groups:
            group["lr"] = args.lr
        notes.append(f"--lr {args.lr:g} (the optimizer was at {saved_lr:g}: now at {args.lr:g})")
    elif args.lr is None and started_lr != DEFAULT_LR:
        notes.append(f"--lr not given: the optimizer goes on at its saved {saved_lr:g} (the run "
                     f"was started with --lr {started_lr:g}; give --lr to set it)")
    if not notes:
        return ""
    return "flags that differ from the checkpoint's run (this run's are used): " + "; ".join(notes)


def start_message(resumed: Resumed, variant: str, epochs: int, init_from: Optional[Path],
                  changed: str = "") -> Optional[str]:
    """The lines that say where a resumed run, or one started from ``init_from``'s weights,
    begins, and (``changed``) what it changes against the checkpoint's run; None for a new
    run."""
    if resumed.path is not None and resumed.epoch >= epochs:
        return (f"{variant}: {resumed.path} has already trained {resumed.epoch} of "
                f"--epochs {epochs}; nothing to do (raise --epochs to train on)"
                + (f"\n{resumed.repaired}" if resumed.repaired else ""))
    if resumed.path is not None:
        return (f"resumed from {resumed.path}: epoch {resumed.epoch + 1}, step {resumed.step}"
                + (f"; {resumed.streams}" if resumed.streams else "")
                + (f"\n{resumed.repaired}" if resumed.repaired else "")
                + (f"\n{changed}" if changed else ""))
    if init_from is not None:
        return f"starting from the weights of {init_from} (epoch 1, a new optimizer)"
    return None


def _agree_on_resumed(loaded: Union[dict, str, None], info: DistInfo) -> None:
    """After each rank loaded the checkpoint rank 0 chose: every rank must have read the same
    bytes at the same point (``loaded``: its ``{"epoch", "step", "identity"}``; a string: why
    it could not load it; None on every rank: a new run). Else every rank stops with one
    line naming the first rank that differs (a collective)."""
    if not info.distributed:
        if isinstance(loaded, str):
            raise UserError(loaded)
        return
    seen = gather_from_ranks([(socket.gethostname(), loaded)], info)
    host0, first = seen[0]
    for rank, (host, theirs) in enumerate(seen):
        if isinstance(theirs, str):
            raise UserError(f"rank {rank} on {host}: {theirs}")
        if theirs != first:
            raise UserError(f"rank 0 on {host0} resumed {_where(first)}, but rank {rank} on "
                            f"{host} {_where(theirs)}: the checkpoint changed while the ranks "
                            "read it, or they read different files; resume again")


def _where(loaded: Optional[dict]) -> str:
    if loaded is None:
        return "started a new run"
    return (f"loaded epoch {loaded['epoch']}, step {loaded['step']} of a {loaded['identity'][0]}"
            f"-byte file (directory hash {loaded['identity'][1][:12]})")
