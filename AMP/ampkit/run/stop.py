"""Stop signals: SIGTERM, SIGUSR1 and Ctrl-C end a run at its next safe point, saved.

The rule, wherever a signal lands within the script's ``stop_vote`` (from before the
restore to the run's last line: in a step, in an epoch's last and short step, in
validation, in a save, in the last epoch):

1. Only a run's main process decides. Its handlers just set its :class:`StopFlag`; the
   DataLoader workers ignore all three signals from anyone else
   (:func:`ignore_stop_signals`), so a signal to the whole process group -- a terminal's
   Ctrl-C, SLURM, ``kill -- -PGID`` -- ends the run like one to the main process, never
   with a dead worker's traceback.
2. The ranks agree on a stop by a vote (``ampkit.distributed.StopVote``) after every
   optimizer step, read one step later (in one process: at once); before every epoch but
   the run's first, for a signal during the previous epoch's validation, save or log; and
   at the run's end. They stop at the first vote that finds a signal, all at the same step.
   A signal during the set-up stops the run after its first step.
3. ``last.pth`` is then saved for exactly that point (mid-epoch, or after the epoch; an
   epoch's whole last step included) unless it already holds it; the run says where it
   stopped and every rank exits 128 + the voted signal (SIGTERM 143, SIGUSR1 138, SIGINT
   130): several signals at once vote for the highest number. A stop in the last epoch
   exits so too ("The run is complete"; its ``--resume`` has nothing to do).

A second Ctrl-C to a process that already got a signal stops it at once
(:class:`KeyboardInterrupt`). Before the ``with`` (set-up) and after it (teardown) the
previous handlers apply; a rank of several ignores the signals as it exits.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Callable, Dict, Iterator

# What a scheduler sends to stop a job: SIGTERM (preemption, time limit, torchrun), SIGUSR1
# (SLURM's warning, #SBATCH --signal=USR1@90), SIGINT (Ctrl-C).
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def exit_status(signal_name: str) -> int:
    """The shell's status for a process stopped by ``signal_name`` (SIGTERM -> 143)."""
    return 128 + int(getattr(signal, signal_name))


def stopped_line(stop: "StopFlag", epoch: int, step: int, saved: Path, epochs: int) -> str:
    """The last line of a run that stopped ``step`` steps into epoch ``epoch`` + 1 (0: after
    ``epoch`` epochs) of ``epochs``."""
    where = f"at epoch {epoch + 1}, step {step}" if step else f"after epoch {epoch}"
    by = stop.agreed + ("" if stop.own else " (sent to another rank)")
    then = ("The run is complete" if epoch >= epochs and not step
            else "Continue with --resume")
    return f"stopped by {by} {where}; saved {saved}. {then}"


class StopFlag:
    """This process's signal (set by a handler: plain attributes, as the handler runs
    between two bytecodes of the main thread) and the stop the ranks agreed on."""

    def __init__(self) -> None:
        self.requested = False  # a stop signal came to this process
        self.signal_name = ""   # which (the last one)
        self.agreed = ""        # the signal every rank stops with, once voted ("": none yet)
        self.own = True         # the agreed signal came to this process

    @property
    def signum(self) -> int:
        """This process's signal's number, 0 for none: what it puts into the vote."""
        return int(getattr(signal, self.signal_name)) if self.requested else 0

    def request(self, name: str) -> None:
        self.requested, self.signal_name = True, name

    def agree(self, name: str) -> None:
        """The ranks' vote found ``name``: the stop every rank makes. The first agreement
        stands (every rank reads the same votes, in the same order)."""
        if not self.agreed:
            self.agreed, self.own = name, self.signal_name == name


class StopSignals:
    """The run's handlers for :data:`SIGNALS`, within its ``with``. ``exiting`` (one of
    several processes): at the end the signals are ignored instead of restored, as the
    process is on its way to exit (stopped, finished or failed) before the ranks' last
    barrier, so that torchrun's SIGTERM to the workers still tearing down, once the first
    has exited, cannot turn their exit status (128 + signal, or a lost peer's one line) into
    a kill."""

    def __init__(self, stop: StopFlag, say: Callable[[str], None], exiting: bool) -> None:
        self.stop, self.say, self.exiting = stop, say, exiting
        self._previous: Dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.stop.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.stop.request(name)
        self.say(f"\n{name} received: stopping after this optimizer step (several processes: "
                 "all of them, after the next)")

    def __enter__(self) -> "StopSignals":
        for sig in SIGNALS:
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.exiting else handler)
        self._previous.clear()


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader's ``worker_init_fn``: the worker ignores the stop signals from anyone but
    its main process (torch's worker dies of a SIGTERM, and its death would raise in the main
    process mid-step or mid-save). A SIGTERM from the main process still ends it: that is
    how ``multiprocessing`` stops daemonic workers as their process exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # SIGTERM stays held back in every thread (held_stop_signals; threads started later
    # inherit it), and one thread takes each one, with its sender.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_sigterm_from, args=(os.getppid(),), daemon=True,
                     name="stop-signal-filter").start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGUSR1})


def _exit_on_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # as torch's own worker handler does for its parent's SIGTERM


@contextlib.contextmanager
def held_stop_signals() -> Iterator[None]:
    """The stop signals held back in this thread while it starts DataLoader workers: a
    forked worker inherits the mask, so none can die of one before
    :func:`ignore_stop_signals` runs in it; this process gets its own afterwards."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
