"""A run's checkpoints, from where it starts to its end: the :class:`CheckpointManager` a script
makes (a ``with``) once its ``state`` exists -- name -> object: the weights ("model"), the
optimizer, ..., and where the run stands ("progress", a :class:`~.progress.Progress`).

- :meth:`~CheckpointManager.load`: where the run starts. ``--resume`` (this variant's
  last.pth, or PATH) or a torchrun restart (last.pth by itself) continues a run whose file
  fits this one (variant, data, image size and global batch; mid-epoch, the world size);
  each rank loads it at its own path, one gather checks that every rank read rank 0's bytes,
  then every entry goes into the object of its name, with this rank's random streams, and
  rank 0 repairs best.pth. ``--init_from`` starts a new run from another file's weights.
- :meth:`~CheckpointManager.save` after each epoch, :meth:`~CheckpointManager.save_stop` at
  a stop: last.pth (every entry's ``state_dict()`` beside the run's record and every rank's
  random streams) as ``--save_every`` says, after the last epoch and at a stop. best.pth at a
  new best: a second name for that very last.pth (a hard link), or, between two saves of
  last.pth, held in memory for the next, which carries its weights too (``best_model``): there
  is never a best.pth without a last.pth to resume from, and a kill between the two is
  repaired by the next ``--resume``.
- :meth:`~CheckpointManager.end`: the last write waited for; a second Ctrl-C says what was saved.

Every rank calls every method, in the same order; global rank 0 alone writes, in the
background (:mod:`.writer`).
"""
from __future__ import annotations

import dataclasses
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch

from ..distributed import (DistInfo, any_rank, gather_from_ranks, load_state, rank_random_states,
                           state_dicts, torchrun_attempt)
from ..errors import Interrupted, UserError
from ..flags import DEFAULT_LR, train_parser
from ..randomness import restore_random_state
from . import messages
from .files import (BEST, LAST, PROGRESS, RECORD, RESUMING, args_to_plain, load,
                    load_with_identity, load_weights, progress_of, resolve, strip_prefixes,
                    unsaveable, weights_of)
from .progress import Progress
from .validate import misfit, optimizer_misfit, shown
from .writer import (BackgroundWriter, Link, Snapshot, atomic_save, link_or_write,
                     remove_temporaries)


class CheckpointManager:
    """The run's checkpoints in ``run_dir`` (the module docstring): ``state``, what is saved,
    name -> object ("progress" among them); ``save_every``: --save_every (``"2"`` epochs,
    ``"30m"``); ``epochs``: the run's; ``args``: its flags, recorded and compared on a resume.
    ``timing``: the last save's, for the epoch's log row. Every rank makes it, together: an
    entry that cannot be saved and loaded back safely stops every rank at once."""

    def __init__(self, run_dir: Path, state: Mapping[str, Any], info: DistInfo, *,
                 save_every: str, epochs: int, num_classes: int, args) -> None:
        refused = [(rank, why) for rank, why in enumerate(
            gather_from_ranks([unsaveable(state)], info)) if why]
        if refused:
            rank, why = refused[0]
            raise UserError(why if info.world_size == 1 else f"rank {rank}: {why}")
        self.run_dir, self.state, self.info, self.args = Path(run_dir), state, info, args
        self.progress, self.epochs, self.num_classes = state["progress"], epochs, num_classes
        self.last = self.run_dir / LAST
        unit = {"s": 1, "m": 60, "h": 3600}.get(save_every[-1])
        self.every_epochs, self.every_seconds = \
            (None, int(save_every[:-1]) * unit) if unit else (int(save_every), None)
        self.writer = BackgroundWriter()
        # Where the last last.pth submitted stands: a stop at that very point writes nothing
        # more, and a second Ctrl-C says it.
        self.last_saved: Optional[tuple] = None
        self.last_snapshot, self.best_snapshot = Snapshot(), Snapshot()
        self.pending_best: Optional[Dict[str, Any]] = None
        self.saved_at, self.timing, self.stopped = time.perf_counter(), {}, False
        self.started_at = 0
        if info.is_main:
            # What a killed save left: no live run owns it (the run folder is locked).
            remove_temporaries(self.run_dir)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A second Ctrl-C: what was saved, in one line, and the process ends at once.
        if exc_type is KeyboardInterrupt:
            raise Interrupted(*self._abandon()) from None

    # ----------------------------------------------------------------- where the run starts
    def load(self, resume_flag: Optional[str], *, init_from: Optional[Path], say) -> None:
        """The checkpoint ``resume_flag`` names (None, "auto" or a PATH) into every entry, or
        for a new run ``init_from``'s weights (None: the network as built); ``say``: rank 0's
        print, for where the run starts and what the resume changed (--lr, given, is set on
        a resumed optimizer; else it goes on at its saved rate)."""
        path, error, ckpt, identity = None, None, None, None
        try:
            path = resume_path(resume_flag, self.last)
            if path is not None:
                ckpt, identity = read_resumable(path, self.args, self.info.world_size)
        # This rank's failure: every rank stops, in one line.
        except UserError as e:
            error = str(e)
        looked = path or (self.last if resume_flag in (None, "auto") else Path(resume_flag))
        agree(gather_from_ranks([(socket.gethostname(), str(looked), path is not None, error,
                                  identity)], self.info))
        if path is None:
            if init_from is not None:
                init_path = resolve(init_from, "--init_from")
                load_weights(self.state["model"], load(init_path), init_path)
            say(messages.start(None, self.progress, self.args.variant, self.epochs, init_from))
            return
        notes = [restore_random_state(ckpt.get("rng"), self.info.rank, self.info.world_size,
                                      self.info.device)]
        if self.info.is_main and path.resolve() == self.last.resolve():
            notes.append(repair_best(path, ckpt))
        notes += load_entries(ckpt, path, self.state)
        optimizer = self.state.get("optimizer")
        if isinstance(optimizer, torch.optim.Optimizer):
            saved_lr = optimizer.param_groups[0]["lr"]
            # The learning rate lives in the optimizer's saved state (the schedule may have
            # lowered it): --lr, given, sets it; else it goes on as saved.
            lr = self.args.lr if "lr" in self.args.given else None
            if lr is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            notes.append(messages.changes(ckpt.get("args") or {}, args_to_plain(self.args), lr,
                                          saved_lr, DEFAULT_LR))
        self.started_at = self.progress.epoch
        # What last.pth holds until the next save lands: a second Ctrl-C says it.
        self.writer.landed = messages.saved(self.progress.epoch, self.progress.step)
        say(messages.start(path, self.progress, self.args.variant, self.epochs, None,
                           "\n".join(filter(None, notes))))

    # ----------------------------------------------------------------- saves
    def save(self, epochs_done: int, val_acc: float) -> None:
        """After ``epochs_done`` epochs, validated at ``val_acc``: last.pth if due, best.pth at
        a new best."""
        self.progress.ended_epoch(epochs_done, val_acc)
        time_up = bool(self.every_seconds) and (
            time.perf_counter() - self.saved_at >= self.every_seconds)
        # --save_every 30m: on any rank's clock, so that every rank saves alike.
        due = bool(epochs_done == self.epochs
                   or (self.every_epochs and epochs_done % self.every_epochs == 0)
                   or any_rank(time_up, self.info))
        self.timing = self._save(due=due, is_best=self.progress.best_epoch == epochs_done)

    def save_stop(self, stats) -> None:
        """A stop's last.pth, written before the run goes on to its end: where its epoch
        stopped (``stats.stopped_at`` steps, saved with its figures so far; 0: at its start),
        unless last.pth holds that already."""
        step = stats.stopped_at
        self.progress.stopped(step, dataclasses.asdict(stats))
        self.stopped, self.timing = True, {}
        if self.last_saved == (self.progress.epoch, step):
            self.writer.wait()
            return
        self._save(due=True, is_best=False, wait=True)

    def _save(self, *, due: bool, is_best: bool, wait: bool = False) -> Dict[str, float]:
        """last.pth if ``due``, best.pth if ``is_best``; the save's timing for the log row."""
        if not (is_best or due):
            return {}
        # The snapshot's buffers are the previous save's: wait for it (0 s: it overlapped).
        timing = {"save_wait_s": self.writer.wait(), "save_write_s": self.writer.write_seconds}
        t0 = time.perf_counter()
        ckpt = self._checkpoint(rng=due)
        where = (self.progress.epoch, self.progress.step)
        if due:
            self.saved_at, self.last_saved = time.perf_counter(), where
        if not self.info.is_main:
            return {}
        if is_best and not due:
            self.pending_best = self.best_snapshot.take(weights_of(ckpt))
        if due:
            files = [(self.last_snapshot.take(ckpt), self.last)]
            # last.pth first: a best.pth never stands without a last.pth to resume from.
            if is_best:
                files.append(Link(self.last, self.run_dir / BEST,
                                  fallback=weights_of(files[0][0])))
            elif self.pending_best is not None:
                # Should the process die before best.pth is written, a resume rebuilds it
                # from these weights.
                files[0][0]["best_model"] = self.pending_best["model"]
                files.append((self.pending_best, self.run_dir / BEST))
            self.pending_best = None
            self.writer.submit(files, messages.saved(*where))
            if wait:
                self.writer.wait()
        timing["save_snapshot_s"] = time.perf_counter() - t0
        return timing

    def _checkpoint(self, rng: bool) -> dict:
        """Each entry's state dict beside the run's record; with ``rng`` every rank's random
        streams too (a collective)."""
        saved = state_dicts(self.state)
        record = {"arch": self.args.arch, "num_classes": self.num_classes,
                  "variant": self.args.variant, "world_size": self.info.world_size,
                  "args": args_to_plain(self.args), "torch_version": str(torch.__version__)}
        if rng:
            record["rng"] = rank_random_states(self.info)
        return saved | {"model": strip_prefixes(saved["model"])} | record

    # ----------------------------------------------------------------- the end
    def end(self, stop) -> bool:
        """After the epochs, on every rank together: the last save written; a stop asked for
        during the last epoch's end (validation, save, log) taken, the run complete. Whether
        the run stopped (``stop``: the ranks' stop)."""
        self.writer.wait()
        if not self.stopped and self.started_at < self.epochs and stop.any_rank_asked():
            self.stopped = True
        return self.stopped

    def _abandon(self) -> tuple:
        """A second Ctrl-C: (what was saved and not, in words; whether a write was cut short).
        A write in flight cannot be stopped, and Python must not finalize while torch.save
        runs in its thread (the C++ runtime aborts): its temporary files are removed now, and
        the caller ends the process at once."""
        if not self.info.is_main:
            return "", False
        busy = self.writer.busy
        if busy:
            remove_temporaries(self.run_dir)
        return messages.abandoned(self.last, self.writer.landed,
                                  messages.saved(*self.last_saved) if busy else None), busy


def resume_path(resume_flag: Optional[str], last: Path) -> Optional[Path]:
    """The checkpoint a run continues: --resume's (None, "auto": ``last``, or a PATH), or
    after a torchrun restart ``last`` where it exists; None for a new run."""
    if resume_flag == "auto":
        if not last.is_file():
            raise UserError(f"--resume: no checkpoint to resume at {last}")
        return last
    if resume_flag:
        return resolve(Path(resume_flag), "--resume")
    # Restarted by torchrun (--max-restarts): continue from the latest checkpoint.
    if torchrun_attempt() > 0 and last.is_file():
        return last
    return None


def read_resumable(path: Path, args, world_size: int) -> tuple:
    """(the checkpoint at ``path``, its identity), once it is known to be a run's that fits
    this one (``args``: this run's flags, of ``world_size`` processes)."""
    ckpt, identity = load_with_identity(path)
    if "optimizer" not in ckpt:
        raise UserError(f"{path}: holds weights only (no optimizer state); cannot resume "
                        f"from it (--init_from {path} starts a new run from its weights)")
    if "progress" in ckpt and not isinstance(ckpt["progress"], dict):
        raise UserError(f"{path}: not a checkpoint a run of this project writes: its "
                        f"'progress' is {shown(ckpt['progress'])}, not a dict")
    if "epoch" not in progress_of(ckpt):
        raise UserError(f"{path}: holds no epoch: not a checkpoint of a run (--init_from "
                        f"{path} starts a new run from its weights)")
    # Where its run stood is read before its entries are loaded (best.pth's repair).
    try:
        Progress().load_state_dict(progress_of(ckpt))
    except ValueError as e:
        raise UserError(f"{path}: not a checkpoint a run of this project writes: "
                        f"{e}") from None
    # A flag an older checkpoint does not record did not exist then: its run had the default.
    defaults = vars(train_parser(args.variant).parse_args([]))
    diffs = messages.mismatches(ckpt, args, world_size, defaults,
                                mid_epoch=bool(progress_of(ckpt).get("step")))
    if diffs:
        raise UserError(f"--resume {path} does not fit this run: {'; '.join(diffs)}. "
                        f"Resume with the same settings, or start a new run from its "
                        f"weights with --init_from {path}")
    return ckpt, identity


def load_entries(ckpt: Dict[str, Any], path: Path, state: Mapping[str, Any]) -> List[str]:
    """Each entry of ``ckpt`` into the object of its name in the script's ``state``, checked
    to fit it first: the optimizer keeps how it was built (over FSDP2 its full state is
    sharded again). An object the checkpoint holds nothing for starts anew, and an entry no
    object takes is left: both said, in the lines returned."""
    saved = {k: x for k, x in ckpt.items() if k not in (*RECORD, *RESUMING, *PROGRESS)}
    saved["progress"] = progress_of(ckpt)
    notes = []
    for name in dict.fromkeys([*saved, *state]):
        value, target = saved.get(name), state.get(name)
        if target is None or value is None:
            notes.append(f"the checkpoint's {name!r} is not restored: this run has none"
                         if target is None else f"{name} starts anew: the checkpoint holds none")
            continue
        if name == "model":
            load_weights(target, ckpt, path)
            continue
        why = (optimizer_misfit(value, target) if isinstance(target, torch.optim.Optimizer)
               else misfit(value, target.state_dict()))
        try:
            if why:
                raise ValueError(why)
            said = load_state(target, value, state["model"])
        except (KeyError, RuntimeError, TypeError, ValueError) as e:
            # load_state_dict's reasons follow its first line: all of it, on one.
            why = " ".join(str(e).split())[:300] or type(e).__name__
            raise UserError(f"{path}: its {name!r} does not fit this run's {name} "
                            f"({why})") from None
        notes.append(said if isinstance(said, str) else "")
    return notes


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


def repair_best(last: Path, ckpt: Dict[str, Any]) -> str:
    """best.pth made to hold the best epoch last.pth's progress names, where a kill between
    the two files, or a full disk at best.pth's write, left it behind or missing: a second
    name for last.pth if that is the best epoch, else written from the weights last.pth
    carries (``best_model``). What was done, in words ("" for nothing)."""
    progress = progress_of(ckpt)
    epoch, acc = progress.get("best_epoch", -1), progress.get("best_acc", -1.0)
    best = last.with_name(BEST)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            held = progress_of(torch.load(best, map_location="cpu", weights_only=True,
                                          mmap=True))
        held = int(held["epoch"]), float(held["val_acc"])
    # Missing, truncated, not a checkpoint: nothing that names an epoch.
    except Exception:
        held = None
    if epoch < 1 or held == (epoch, acc):
        return ""
    if progress.get("epoch") == epoch and not progress.get("step"):
        link_or_write(Link(last, best, fallback=weights_of(ckpt)))
    elif isinstance(ckpt.get("best_model"), dict):
        atomic_save(weights_of(ckpt) | {"model": ckpt["best_model"],
                                        "progress": {"epoch": epoch, "step": 0,
                                                     "best_acc": acc, "best_epoch": epoch,
                                                     "val_acc": acc}}, best)
    else:
        return messages.repaired(best, held, epoch, acc, done=False)
    return messages.repaired(best, held, epoch, acc, done=True)
