"""SIGTERM and Ctrl-C during training: finish the current step, save, exit 128 + signal.

While a run trains, both signals only set its :class:`ampkit.engine.StopFlag`; the loop
stops at its next check and the trainer saves ``last.pth`` before it exits (SIGTERM: 143,
Ctrl-C: 130). A second Ctrl-C stops at once (:class:`KeyboardInterrupt`). Outside the
run the previous handlers are back, so a script called in-process leaves none behind.
"""
from __future__ import annotations

import signal
from typing import Callable, Dict

from ..engine import StopFlag

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signal_name: str) -> int:
    """The shell's status for a process stopped by ``signal_name`` (SIGTERM -> 143)."""
    return 128 + int(getattr(signal, signal_name or "SIGTERM"))


class StopSignals:
    """The run's handlers for SIGTERM and SIGINT, from :meth:`install` to :meth:`restore`."""

    def __init__(self, stop: StopFlag, say: Callable[[str], None]) -> None:
        self.stop, self.say = stop, say
        self._previous: Dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.stop.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.stop.request(name)
        self.say(f"\n{name} received: stopping after the current step")

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
