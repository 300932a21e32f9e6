"""When a run saves, and what: the :class:`Saver` a script saves through.

- last.pth: each entry of the script's ``state`` (name -> object) by its ``state_dict()``,
  beside the run's record (``files.Record``) and every rank's random streams; written as
  ``--save_every`` says, after the last epoch, and at a stop.
- best.pth: the best validation accuracy's weights and record. Where last.pth is written for
  that epoch, best.pth is a second name for that very file (a hard link: nothing more is
  written); a best epoch between two saves of last.pth waits in memory, and is written after
  the next last.pth, which carries its weights too (``best_model``). So there is never a
  best.pth without a last.pth to resume from, and a kill between the two files, or a full
  disk at best.pth's, is repaired by the next ``--resume`` (``resume.repair_best``).
- Every rank calls every method, in the same order; global rank 0 alone writes, in the
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
from .messages import abandoned, saved
from .writer import BackgroundWriter, Link, Snapshot, remove_temporaries


class Saver:
    """A run's saves, as the script makes them (a ``with``): :meth:`save` after each epoch,
    :meth:`save_stop` at a stop; after a second Ctrl-C, what was saved, in one line.
    ``resumed``: where a resumed run's last.pth stands; ``state``: what is saved, name ->
    object; ``args``: the run's flags, recorded."""

    def __init__(self, run_dir: Path, info: DistInfo, resumed, state: Mapping[str, Any], *,
                 save_every: str, epochs: int, num_classes: int, args) -> None:
        # Every rank's verdict on the state, so that all stop alike before any epoch is spent.
        refused = [(rank, why) for rank, why in enumerate(
            gather_from_ranks([refusal(state)], info)) if why]
        if refused:
            rank, why = refused[0]
            raise UserError(why if info.world_size == 1 else f"rank {rank}: {why}")
        self.run_dir, self.info, self.resumed, self.state = Path(run_dir), info, resumed, state
        self.epochs, self.num_classes, self.args = epochs, num_classes, args
        # --save_every: "2" epochs, or "5m" (seconds, minutes, hours).
        unit = {"s": 1, "m": 60, "h": 3600}.get(save_every[-1])
        self.every_epochs, self.every_seconds = \
            (None, int(save_every[:-1]) * unit) if unit else (int(save_every), None)
        self.writer = BackgroundWriter(saved(resumed.epoch, resumed.step)
                                       if resumed.path is not None else "")
        # Where the last last.pth submitted stands: a second Ctrl-C says it, and a stop at
        # that very point writes nothing more.
        self.last_saved: Optional[tuple] = None
        self.last_snapshot, self.best_snapshot = Snapshot(), Snapshot()
        # A best epoch between two saves of last.pth waits here, in memory, for the next.
        self.pending_best: Optional[Dict[str, Any]] = None
        self.saved_at = time.perf_counter()
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
        """After ``epochs_done`` epochs: last.pth if due, best.pth at a new best."""
        self.val_acc = val_acc
        if val_acc > self.best_acc:
            self.best_acc, self.best_epoch = val_acc, epochs_done
        time_up = bool(self.every_seconds) and (
            time.perf_counter() - self.saved_at >= self.every_seconds)
        # --save_every 30m: on any rank's clock, so that every rank saves alike.
        due = bool(epochs_done == self.epochs
                   or (self.every_epochs and epochs_done % self.every_epochs == 0)
                   or any_rank(time_up, self.info))
        self.timing = self._save(epochs_done, 0, val_acc, None, due=due,
                                 is_best=self.best_epoch == epochs_done)

    def save_stop(self, epoch: int, stats) -> None:
        """A stop's last.pth, written before the run goes on to its end: where epoch ``epoch``
        stopped (``stats.stopped_at`` steps, saved with its figures so far; 0: after
        ``epoch`` epochs), unless last.pth holds that already."""
        step = stats.stopped_at
        self.stopped_at, self.timing = (epoch, step), {}
        if self.last_saved == (epoch, step):
            self.writer.wait()
            return
        val_acc, so_far = (None, stats) if step else (self.val_acc, None)
        self._save(epoch, step, val_acc, so_far, due=True, is_best=False, wait=True)

    def finish(self) -> None:
        """After the last epoch: the last save written."""
        self.writer.wait()

    def _save(self, epoch: int, step: int, val_acc: Optional[float], so_far, *, due: bool,
              is_best: bool, wait: bool = False) -> Dict[str, float]:
        """last.pth if ``due``, best.pth if ``is_best``; the save's timing for the log row."""
        if not (is_best or due):
            return {}
        # The snapshot's buffers are the previous save's: wait for it (0 s: it overlapped).
        timing = {"save_wait_s": self.writer.wait(), "save_write_s": self.writer.write_seconds}
        t0 = time.perf_counter()
        state = self._checkpoint(state_dicts(self.state), epoch, step, val_acc, so_far,
                                 resume=due)
        if due:
            self.saved_at, self.last_saved = time.perf_counter(), (epoch, step)
        if not self.info.is_main:
            return {}
        if is_best and not due:
            self.pending_best = self.best_snapshot.take(weights_of(state))
        if due:
            last, best = self.run_dir / LAST, self.run_dir / BEST
            files = [(self.last_snapshot.take(state), last)]
            # last.pth first: a best.pth never stands without a last.pth to resume from.
            if is_best:
                files.append(Link(last, best, fallback=weights_of(files[0][0])))
            elif self.pending_best is not None:
                # Should the process die before best.pth is written, a resume rebuilds it
                # from these weights.
                files[0][0]["best_model"] = self.pending_best["model"]
                files.append((self.pending_best, best))
            self.pending_best = None
            self.writer.submit(files, saved(epoch, step))
            if wait:
                self.writer.wait()
        timing["save_snapshot_s"] = time.perf_counter() - t0
        return timing

    def _checkpoint(self, state: dict, epoch: int, step: int, val_acc: Optional[float],
                    so_far, resume: bool) -> dict:
        """The entries' state dicts beside the run's record; with ``resume`` every rank's
        random streams too (a collective)."""
        record = dataclasses.asdict(Record(
            epoch=epoch, step=step, best_acc=self.best_acc, best_epoch=self.best_epoch,
            val_acc=val_acc, arch=self.args.arch, num_classes=self.num_classes,
            variant=self.args.variant, world_size=self.info.world_size,
            args=args_to_plain(self.args),
            torch_version=str(torch.__version__)))
        if so_far is not None:
            record["epoch_so_far"] = dataclasses.asdict(so_far)
        if resume:
            record["rng"] = rank_random_states(self.info)
        return state | {"model": strip_prefixes(state["model"])} | record

    def _abandon(self) -> tuple:
        """A second Ctrl-C: (what was saved and not, in words; whether a write was cut short).
        A write in flight cannot be stopped, and Python must not finalize while torch.save
        runs in its thread (the C++ runtime aborts): its temporary files are
        removed now, and the caller ends the process at once."""
        if not self.info.is_main:
            return "", False
        busy = self.writer.busy
        if busy:
            remove_temporaries(self.run_dir)
        return abandoned(self.run_dir / LAST, self.writer.landed,
                         saved(*self.last_saved) if busy else None), busy
