"""When a run saves, and what: the :class:`Saver` a script saves through, its save policy, and
the checkpoint's content.

- ``last.pth``: the full state after an epoch, or at a stop: the script's unwrapped weights,
  optimizer, LR schedule and GradScaler, the counters, every rank's random streams and the
  run's flags; written as
  ``--save_every`` says, after the last epoch, and at a stop.
- ``best.pth``: the checkpoint of the best validation accuracy. When that epoch is one
  last.pth is written for (every epoch by default), best.pth is a second name for that
  very file (a hard link: nothing more is written, and it holds the full state); a best
  epoch between two saves of last.pth waits in memory, weights and metadata, and is
  written after the next one, whose last.pth carries its weights too (``best_model``).
  There is never a best.pth without a last.pth to resume from, and last.pth always holds
  what its record's best epoch needs: a kill between the two files, or a full disk at
  best.pth's, is repaired by the next ``--resume`` (:func:`.resume.repair_best`).
- Every rank makes the state (FSDP2 gathers it) and calls every method of :class:`Saver`
  in the same order (the save's time and the random streams are agreed and gathered);
  global rank 0 alone writes, in the background (:mod:`.writer`).
"""
from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from ..device import DistInfo
from ..distributed import any_rank, rank_random_states
from ..errors import Interrupted
from ..flags import parse_interval
from . import files as checkpoint_files
from .files import args_to_plain, weights_of
from .resume import Resumed
from .writer import BackgroundWriter, Link, Snapshot, remove_spares, remove_stale_temps



def checkpoint_state(saved: Dict[str, Any], args, info: DistInfo, counters: Dict[str, Any],
                     num_classes: int, random_states: Optional[List[dict]]) -> Dict[str, Any]:
    """The checkpoint's content (live tensors): the script's ``saved`` (``model``: its
    unwrapped weights, ``optimizer``, ``scheduler``, ``scaler``, DDP's ``comm_hook``),
    ``counters`` (epoch, step, best_acc, best_epoch, val_acc; at a stop the epoch's figures
    so far) and the run's flags (``args``, recorded); with ``random_states`` (every rank's,
    in rank order), what only resuming needs. A wrapper's prefix still in a key (DataParallel around ``model.features``,
    autocast's wrapper in DataParallel's replicas) is dropped."""
    state = {"model": checkpoint_files.strip_prefixes(saved["model"]), "arch": args.arch,
             **counters, "num_classes": num_classes, "variant": args.variant,
             "world_size": info.world_size, "args": args_to_plain(args),
             "torch_version": str(torch.__version__)}
    if random_states is not None:
        state |= {"optimizer": saved["optimizer"], "scheduler": saved["scheduler"],
                  "scaler": saved.get("scaler"), "comm_hook": saved.get("comm_hook"),
                  "rng": random_states}
    return state


class SavePolicy:
    """Decides when to write last.pth and best.pth, and hands them to the background writer."""

    def __init__(self, run_dir: Path, save_every: str, epochs: int, info: DistInfo,
                 resumed: Optional[Resumed] = None) -> None:
        """``resumed``: where a resumed run's last.pth stands."""
        self.run_dir, self.epochs, self.info = run_dir, epochs, info
        self.every_epochs, self.every_seconds = parse_interval(save_every)
        landed = (_describe(resumed.epoch, resumed.step)
                  if resumed is not None and resumed.path is not None else "")
        self.writer = BackgroundWriter(landed)
        self.writing = ""  # what the last save submitted holds
        self.snapshots = {"last": Snapshot(), "best": Snapshot()}
        self.pending_best: Optional[Dict[str, Any]] = None
        self.last_save = time.perf_counter()
        self.last_saved: Optional[tuple] = None  # (epoch, step) of the last last.pth submitted

    def due(self, epoch: int, now: bool, time_up: bool = False) -> bool:
        """Whether last.pth is written after ``epoch`` epochs (the same answer on every rank,
        given the same ``time_up``)."""
        return bool(now or epoch == self.epochs
                    or (self.every_epochs and epoch % self.every_epochs == 0)
                    or (self.every_seconds and time_up))

    def time_up_here(self) -> bool:
        """Whether --save_every's time has come on this rank's clock (the ranks' clocks
        differ: the caller asks whether it has on any rank's)."""
        return bool(self.every_seconds) and (
            time.perf_counter() - self.last_save >= self.every_seconds)

    def save(self, make_state, epoch: int, is_best: bool, now: bool = False,
             step: int = 0, time_up: bool = False) -> Dict[str, float]:
        """Save after ``epoch`` epochs (and ``step`` steps of the next, at a stop):
        ``make_state(resume)`` makes the content (every rank calls it). ``now``: a stop,
        which also waits for the write. ``time_up``: --save_every's time has come on some
        rank. Returns the save's timing for the epoch's log row (rank 0)."""
        due = self.due(epoch, now, time_up)
        if not (is_best or due):
            return {}
        # The snapshot buffers are the ones the previous save is written from: wait for it.
        timing = {"save_wait_s": self.writer.wait(),  # 0: the previous save overlapped training
                  "save_write_s": self.writer.write_seconds}  # how long that write took
        t0 = time.perf_counter()
        state = make_state(resume=due)  # every rank: FSDP2 gathers its shards here
        if due:
            self.last_save, self.last_saved = time.perf_counter(), (epoch, step)
        if not self.info.is_main:
            return {}
        if is_best and not due:  # kept in memory until the next save of last.pth
            self.pending_best = self.snapshots["best"].take(weights_of(state))
        if due:  # last.pth first: a best.pth never stands without a last.pth to resume from
            last, best = self.run_dir / checkpoint_files.LAST, self.run_dir / checkpoint_files.BEST
            files = [(self.snapshots["last"].take(state), last)]
            if is_best:  # best.pth: a second name for this very file, nothing more written
                files.append(Link(last, best, fallback=weights_of(files[0][0])))
            elif self.pending_best is not None:
                # last.pth first, with the best epoch's weights, which a resume rebuilds
                # best.pth from should the process die before best.pth is written.
                files[0][0]["best_model"] = self.pending_best["model"]
                files.append((self.pending_best, best))
            self.pending_best = None
            self.writer.submit(files, _describe(epoch, step))
            self.writing = _describe(epoch, step)
            if now:
                self.writer.wait()
        timing["save_snapshot_s"] = time.perf_counter() - t0
        return timing

    def wait(self) -> None:
        """Until the save in flight, if any, is written."""
        self.writer.wait()

    def finish(self) -> None:
        """Wait for the last save; remove the spare files (rank 0)."""
        self.writer.wait()
        if self.info.is_main:
            remove_spares(self.run_dir)

    def abandon(self) -> tuple:
        """A second Ctrl-C: (what was and was not saved, in words; whether a write was cut
        short). A write in flight cannot be stopped, and Python must not finalize while
        torch.save runs in its thread (the C++ runtime aborts): its temporary and spare
        files are removed now, and the caller ends the process at once."""
        if not self.info.is_main:
            return "", False
        path, holds = self.run_dir / checkpoint_files.LAST, self.writer.landed
        if self.writer.busy:
            remove_stale_temps(self.run_dir)
            return ((f"{path} still holds {holds}" if holds else f"no {path} was written")
                    + f"; the save of {self.writing} was cut short and not kept", True)
        return (f"{path} holds {holds}; nothing after it was saved" if holds
                else "nothing was saved"), False


def _describe(epoch: int, step: int) -> str:
    return f"epoch {epoch}" + (f" and {step} steps of the next" if step else "")


class Saver:
    """A run's saves, as the script makes them (a ``with``): :meth:`save` after each epoch
    (last.pth as ``--save_every`` says, best.pth at a new best), :meth:`save_stop` at a stop;
    after a second Ctrl-C, what was saved, in one line. ``training_state()`` is the script's:
    what a checkpoint holds of its objects. ``args``: the run's flags, recorded in each
    checkpoint."""

    def __init__(self, run_dir: Path, info: DistInfo, resumed: Resumed, *, save_every: str,
                 epochs: int, num_classes: int, args) -> None:
        self.info, self.resumed, self.num_classes, self.args = info, resumed, num_classes, args
        self.epochs = epochs
        self.policy = SavePolicy(run_dir, save_every, epochs, info, resumed)
        self.best_acc, self.best_epoch = resumed.best_acc, resumed.best_epoch
        self.val_acc: Optional[float] = None  # the last epoch's
        self.timing: dict = {}  # the last save's, for its epoch's row
        self.stopped_at: Optional[tuple] = None  # (epochs done, step) where a stop saved

    def __enter__(self) -> "Saver":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is KeyboardInterrupt:  # a second Ctrl-C: say what was saved; go
            raise Interrupted(*self.policy.abandon()) from None

    def save(self, training_state: Callable[[], dict], epochs_done: int, val_acc: float) -> None:
        """After ``epochs_done`` epochs: last.pth as ``--save_every`` says (its time: on any
        rank's clock), best.pth at a new best."""
        self.val_acc = val_acc
        if val_acc > self.best_acc:
            self.best_acc, self.best_epoch = val_acc, epochs_done
        time_up = any_rank(self.policy.time_up_here(), self.info)  # --save_every 30m, say
        self.timing = self.policy.save(
            partial(self._state, training_state, epochs_done, 0, val_acc, None), epochs_done,
            time_up=time_up, is_best=self.best_epoch == epochs_done)

    def save_stop(self, training_state: Callable[[], dict], epoch: int, stats) -> None:
        """A stop's last.pth, written before the run goes on to its end, at the point the
        epoch ``epoch`` stopped (``stats.stopped_at``, its steps: saved with its figures so
        far; 0, before it began: after ``epoch`` epochs), unless last.pth holds it already."""
        step = stats.stopped_at
        self.stopped_at, self.timing = (epoch, step), {}
        if self.policy.last_saved == (epoch, step):
            self.policy.wait()  # the save just made is the stop's
            return
        val_acc, so_far = (None, stats) if step else (self.val_acc, None)
        self.policy.save(partial(self._state, training_state, epoch, step, val_acc, so_far),
                         epoch, is_best=False, now=True, step=step)

    def finish(self) -> None:
        """After the last epoch: the last save written (rank 0: the spares removed)."""
        self.policy.finish()

    def _state(self, training_state: Callable[[], dict], epoch: int, step: int,
               val_acc: Optional[float], so_far, resume: bool) -> dict:
        counters = {"epoch": epoch, "step": step, "best_acc": self.best_acc,
                    "best_epoch": self.best_epoch, "val_acc": val_acc}
        if so_far is not None:
            counters["epoch_so_far"] = dataclasses.asdict(so_far)
        saved = training_state()  # every rank (FSDP2 gathers), then every rank's streams:
        streams = rank_random_states(self.info) if resume else None  # both collectives
        return checkpoint_state(saved, self.args, self.info, counters, self.num_classes,
                                streams)
