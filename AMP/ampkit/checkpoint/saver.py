"""When a run saves, and what: the :class:`Saver` a script saves through.

- ``last.pth``: each entry of the script's ``state`` (name -> object) by its ``state_dict()``
  -- its unwrapped weights as "model", the optimizer, LR schedule, GradScaler, an EMA of its
  own -- beside the run's record (``files.Record``: epoch, step, best accuracy, the run's
  flags, ...) and every rank's random streams; written as ``--save_every`` says, after the last epoch, and
  at a stop.
- ``best.pth``: the weights and record of the best validation accuracy. When that epoch is
  one last.pth is written for (every epoch by default), best.pth is a second name for that
  very file (a hard link: nothing more is written, and it holds the full state); a best
  epoch between two saves of last.pth waits in memory, and is written after the next one,
  whose last.pth carries its weights too (``best_model``). There is never a best.pth
  without a last.pth to resume from, and last.pth always holds what its record's best
  epoch needs: a kill between the two files, or a full disk at best.pth's, is repaired by
  the next ``--resume`` (:func:`.resume.repair_best`).
- Every rank calls every method, in the same order (an entry that cannot be saved and loaded
  back safely is refused as the Saver is made, on every rank; a save gathers FSDP2's shards,
  agrees on its time and gathers the random streams); global rank 0 alone writes, in the
  background (:mod:`.writer`).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch

from ..distributed import DistInfo, any_rank, gather_from_ranks, rank_random_states, state_dicts
from ..errors import Interrupted, UserError
from .files import BEST, LAST, Record, args_to_plain, refusal, strip_prefixes, weights_of
from .writer import BackgroundWriter, Link, Snapshot, remove_spares


def parse_interval(text: str) -> tuple:
    """``--save_every``: ``"2"`` -> ``(2, None)`` epochs; ``"5m"`` -> ``(None, 300)`` seconds."""
    unit = {"s": 1, "m": 60, "h": 3600}.get(text[-1])
    return (None, int(text[:-1]) * unit) if unit else (int(text), None)


def _describe(epoch: int, step: int) -> str:
    return f"epoch {epoch}" + (f" and {step} steps of the next" if step else "")


class Saver:
    """A run's saves, as the script makes them (a ``with``): :meth:`save` after each epoch
    (last.pth as ``--save_every`` says, best.pth at a new best), :meth:`save_stop` at a stop;
    after a second Ctrl-C, what was saved, in one line. ``resumed``: where a resumed run's
    last.pth stands (``resume.Resumed``); ``state``: what is saved, name -> object (its
    ``state_dict()``); ``args``: the run's flags, recorded."""

    def __init__(self, run_dir: Path, info: DistInfo, resumed, state: Mapping[str, Any], *,
                 save_every: str, epochs: int, num_classes: int, args) -> None:
        # Every rank's verdict, so that all stop alike, before any epoch is spent.
        refused = [(rank, why) for rank, why in enumerate(
            gather_from_ranks([refusal(state)], info)) if why]
        if refused:
            rank, why = refused[0]
            raise UserError(why if info.world_size == 1 else f"rank {rank}: {why}")
        self.state = state
        self.run_dir, self.info, self.resumed, self.epochs = Path(run_dir), info, resumed, epochs
        self.num_classes, self.args = num_classes, args
        self.every_epochs, self.every_seconds = parse_interval(save_every)
        self.writer = BackgroundWriter(_describe(resumed.epoch, resumed.step)
                                       if resumed.path is not None else "")
        # What the last last.pth submitted holds, in words and as (epoch, step): a second
        # Ctrl-C says it, and a stop at that very point writes nothing more.
        self.writing, self.last_saved = "", None
        self.snapshots = {"last": Snapshot(), "best": Snapshot()}
        # A best epoch between two saves of last.pth waits here, in memory, for the next.
        self.pending_best: Optional[Dict[str, Any]] = None
        self.last_save = time.perf_counter()
        self.best_acc, self.best_epoch = resumed.best_acc, resumed.best_epoch
        self.val_acc: Optional[float] = None
        self.timing: dict = {}
        self.stopped_at: Optional[tuple] = None

    def __enter__(self) -> "Saver":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A second Ctrl-C: what was saved, in one line, and the process ends at once.
        if exc_type is KeyboardInterrupt:
            raise Interrupted(*self._abandon()) from None

    def save(self, epochs_done: int, val_acc: float) -> None:
        """After ``epochs_done`` epochs: last.pth as ``--save_every`` says (its time: on any
        rank's clock), best.pth at a new best."""
        self.val_acc = val_acc
        if val_acc > self.best_acc:
            self.best_acc, self.best_epoch = val_acc, epochs_done
        time_up = bool(self.every_seconds) and (
            time.perf_counter() - self.last_save >= self.every_seconds)
        # --save_every 30m: on any rank's clock, so that every rank saves alike.
        due = bool(epochs_done == self.epochs
                   or (self.every_epochs and epochs_done % self.every_epochs == 0)
                   or any_rank(time_up, self.info))
        self.timing = self._save(epochs_done, 0, val_acc, None, due=due,
                                 is_best=self.best_epoch == epochs_done)

    def save_stop(self, epoch: int, stats) -> None:
        """A stop's last.pth, written before the run goes on to its end, at the point the
        epoch ``epoch`` stopped (``stats.stopped_at``, its steps: saved with its figures so
        far; 0, before it began: after ``epoch`` epochs), unless last.pth holds it already."""
        step = stats.stopped_at
        self.stopped_at, self.timing = (epoch, step), {}
        if self.last_saved == (epoch, step):
            self.writer.wait()
            return
        val_acc, so_far = (None, stats) if step else (self.val_acc, None)
        self._save(epoch, step, val_acc, so_far, due=True, is_best=False,
                   wait=True)

    def finish(self) -> None:
        """After the last epoch: the last save written; rank 0: no spare file left."""
        self.writer.wait()
        if self.info.is_main:
            remove_spares(self.run_dir)

    def _save(self, epoch: int, step: int, val_acc: Optional[float], so_far, *, due: bool,
              is_best: bool, wait: bool = False) -> Dict[str, float]:
        """last.pth if ``due``, best.pth if ``is_best`` (``wait``: until written); the
        timing of it for the epoch's log row (rank 0)."""
        if not (is_best or due):
            return {}
        # The snapshot buffers are the ones the previous save is written from: wait for it
        # (0 s: that write overlapped training).
        timing = {"save_wait_s": self.writer.wait(), "save_write_s": self.writer.write_seconds}
        t0 = time.perf_counter()
        state = self._checkpoint(state_dicts(self.state), epoch, step, val_acc, so_far,
                                 resume=due)
        if due:
            self.last_save, self.last_saved = time.perf_counter(), (epoch, step)
        if not self.info.is_main:
            return {}
        if is_best and not due:
            self.pending_best = self.snapshots["best"].take(weights_of(state))
        # last.pth first: a best.pth never stands without a last.pth to resume from.
        if due:
            last, best = self.run_dir / LAST, self.run_dir / BEST
            files = [(self.snapshots["last"].take(state), last)]
            # best.pth: a second name for this very file, nothing more written.
            if is_best:
                files.append(Link(last, best, fallback=weights_of(files[0][0])))
            elif self.pending_best is not None:
                # last.pth first, with the best epoch's weights, which a resume rebuilds
                # best.pth from should the process die before best.pth is written.
                files[0][0]["best_model"] = self.pending_best["model"]
                files.append((self.pending_best, best))
            self.pending_best = None
            self.writer.submit(files, _describe(epoch, step))
            self.writing = _describe(epoch, step)
            if wait:
                self.writer.wait()
        timing["save_snapshot_s"] = time.perf_counter() - t0
        return timing

    def _checkpoint(self, state: dict, epoch: int, step: int, val_acc: Optional[float],
                    so_far, resume: bool) -> dict:
        """``state`` (the entries' state dicts, every rank's) beside the run's record; with
        ``resume`` every rank's random streams too (a collective). A wrapper's prefix still
        in a weight's key (DataParallel around ``model.features``) is dropped."""
        record = dataclasses.asdict(Record(
            epoch=epoch, step=step, best_acc=self.best_acc, best_epoch=self.best_epoch,
            val_acc=val_acc, arch=self.args.arch, num_classes=self.num_classes,
            variant=self.args.variant, world_size=self.info.world_size,
            args=args_to_plain(self.args), torch_version=str(torch.__version__)))
        if so_far is not None:
            record["epoch_so_far"] = dataclasses.asdict(so_far)
        if resume:
            record["rng"] = rank_random_states(self.info)
        return state | {"model": strip_prefixes(state["model"])} | record

    def _abandon(self) -> tuple:
        """A second Ctrl-C: (what was and was not saved, in words; whether a write was cut
        short). A write in flight cannot be stopped, and Python must not finalize while
        torch.save runs in its thread (the C++ runtime aborts): its temporary and spare
        files are removed now, and the caller ends the process at once."""
        if not self.info.is_main:
            return "", False
        path, holds = self.run_dir / LAST, self.writer.landed
        if self.writer.busy:
            remove_spares(self.run_dir, temps=True)
            return ((f"{path} still holds {holds}" if holds else f"no {path} was written")
                    + f"; the save of {self.writing} was cut short and not kept", True)
        return (f"{path} holds {holds}; nothing after it was saved" if holds
                else "nothing was saved"), False
