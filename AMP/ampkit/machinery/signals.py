"""SIGTERM and Ctrl-C during training: finish the current step, save, exit 128 + signal.

While a run trains, both signals only set its :class:`StopFlag`; the ranks agree to stop
after the next optimizer step (``ampkit.distributed.StopVote``), or at the epoch's end
when the signal came during validation or a save, and the run saves ``last.pth`` before it
exits (SIGTERM: 143, Ctrl-C: 130). A second Ctrl-C stops at once
(:class:`KeyboardInterrupt`). Outside the run the previous handlers are back, so a script
called in-process leaves none behind; a stopped rank of several ignores both as it exits.
"""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Callable, Dict

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signal_name: str) -> int:
    """The shell's status for a process stopped by ``signal_name`` (SIGTERM -> 143)."""
    return 128 + int(getattr(signal, signal_name or "SIGTERM"))


def stopped_line(stop: "StopFlag", epoch: int, step: int, saved: Path) -> str:
    """The last line of a stopped run, which stopped ``step`` steps into epoch ``epoch`` (0:
    after ``epoch`` epochs)."""
    where = f"at epoch {epoch + 1}, step {step}" if step else f"after epoch {epoch}"
    by = stop.signal_name + ("" if stop.own else " (sent to another rank)")
    return f"stopped by {by} {where}; saved {saved}. Continue with --resume"


class StopFlag:
    """This process's wish to stop, set by a signal handler (plain attributes: the handler
    runs between two bytecodes of the main thread), or by the ranks' vote."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self.own = True  # the signal came to this process

    @property
    def signum(self) -> int:
        """The signal's number, 0 for none: what this rank puts into the vote."""
        return int(getattr(signal, self.signal_name)) if self.requested else 0

    def request(self, name: str, own: bool = True) -> None:
        self.requested, self.signal_name, self.own = True, name, own


class StopSignals:
    """The run's handlers for SIGTERM and SIGINT, from :meth:`install` to :meth:`restore`."""

    def __init__(self, stop: StopFlag, say: Callable[[str], None]) -> None:
        self.stop, self.say = stop, say
        self._previous: Dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.stop.requested and self.stop.own and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.stop.request(name)
        self.say(f"\n{name} received: stopping after this optimizer step (several processes: "
                 "all of them, after the next)")

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handler)

    def restore(self, exiting: bool = False) -> None:
        """The previous handlers back. ``exiting`` (one of several processes, stopped and on
        its way to exit 128 + signal): the signals ignored instead, before the ranks' last
        barrier, so that torchrun's SIGTERM to the workers still tearing down, once the first
        has exited, cannot turn their exit status into a kill."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if exiting else handler)
        self._previous.clear()
