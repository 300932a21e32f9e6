"""The stop: SIGTERM, SIGUSR1 and Ctrl-C end a run at its next safe point, saved -- the signal
(:class:`StopSignals`, :class:`StopRequest`), the ranks' agreement (:class:`Stop`), and where
the run says it stopped and how it exits (:func:`stopped_line`, :func:`exit_status`); the save
is the checkpoint manager's (``save_stop``).

The rule, wherever a signal lands within the script's ``run.stop`` (from before the resume to
the run's last line: in a step, in an epoch's last and short step, in validation, in a save,
in the last epoch):

1. Only a run's main process decides. Its handlers just set its :class:`StopRequest`; the
   DataLoader workers ignore all three signals from anyone else
   (``data.classic.ignore_stop_signals``), so a signal to the whole process group -- a
   terminal's Ctrl-C, SLURM, ``kill -- -PGID`` -- ends the run like one to the main
   process, never with a dead worker's traceback.
2. The ranks agree on a stop (:class:`Stop`) after every optimizer step, known one step
   later (in one process: at once); before every epoch but the run's first, for a signal
   during the previous epoch's validation, save or log; and at the run's end. They stop at
   the first round that finds a signal, all at the same step. A signal during the set-up
   stops the run after its first step (in a group: its second, where the first step's round
   is received).
3. ``last.pth`` is then saved for exactly that point (mid-epoch, or after the epoch; an
   epoch's whole last step included) unless it already holds it; the run says where it
   stopped and every rank exits 128 + the agreed signal (SIGTERM 143, SIGUSR1 138, SIGINT
   130): of several signals at once, the highest number. A stop in the last epoch
   exits so too ("The run is complete"; its ``--resume`` has nothing to do).

A second Ctrl-C to a process that already got a signal stops it at once
(:class:`KeyboardInterrupt`). Before the ``with`` (set-up) and after it (teardown) the
previous handlers apply; a rank of several ignores the signals as it exits."""
from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Callable, Dict, Iterator


# What a scheduler sends to stop a job: SIGTERM (preemption, time limit, torchrun), SIGUSR1
# (SLURM's warning, #SBATCH --signal=USR1@90), SIGINT (Ctrl-C).
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def exit_status(signal_name: str) -> int:
    """The shell's status for a process stopped by ``signal_name`` (SIGTERM -> 143)."""
    return 128 + int(getattr(signal, signal_name))


def stopped_line(request: "StopRequest", epoch: int, step: int, saved: Path, epochs: int) -> str:
    """The last line of a run that stopped ``step`` steps into epoch ``epoch`` + 1 (0: after
    ``epoch`` epochs) of ``epochs``."""
    where = f"at epoch {epoch + 1}, step {step}" if step else f"after epoch {epoch}"
    by = request.agreed + ("" if request.own else " (sent to another rank)")
    then = ("The run is complete" if epoch >= epochs and not step
            else "Continue with --resume")
    return f"stopped by {by} {where}; saved {saved}. {then}"


class StopRequest:
    """This process's signal (set by a handler: plain attributes, as the handler runs
    between two bytecodes of the main thread) and the stop the ranks agreed on."""

    def __init__(self) -> None:
        # A stop signal came to this process; signal_name is the last one's.
        self.requested = False
        self.signal_name = ""
        # The signal every rank stops with, once agreed ("": none yet), and whether it came to
        # this process.
        self.agreed = ""
        self.own = True

    @property
    def signum(self) -> int:
        """This process's signal's number, 0 for none: what it sends the other ranks."""
        return int(getattr(signal, self.signal_name)) if self.requested else 0

    def ask(self, name: str) -> None:
        self.requested, self.signal_name = True, name

    def agree(self, name: str) -> None:
        """The ranks found ``name``: the stop every rank makes. The first agreement stands
        (every rank receives the same rounds, in the same order)."""
        if not self.agreed:
            self.agreed, self.own = name, self.signal_name == name


class StopSignals:
    """The run's handlers for :data:`SIGNALS`, within its ``with``. ``exiting`` (one of
    several processes): at the end the signals are ignored instead of restored, as the
    process is on its way to exit (stopped, finished or failed) before the ranks' last
    barrier, so that torchrun's SIGTERM to the workers still tearing down, once the first
    has exited, cannot turn their exit status (128 + signal, or a lost peer's one line) into
    a kill."""

    def __init__(self, request: StopRequest, say: Callable[[str], None], exiting: bool) -> None:
        self.request, self.say, self.exiting = request, say, exiting
        self._previous: Dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.request.requested and signum == signal.SIGINT:
            # A second Ctrl-C: the user will not wait for the step to end.
            raise KeyboardInterrupt
        self.request.ask(name)
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


@contextlib.contextmanager
def stopping(channel, say: Callable[[str], None], exiting: bool) -> Iterator["Stop"]:
    """Within it SIGTERM, SIGINT and SIGUSR1 ask for a stop, which the ranks agree on over
    ``channel`` (``distributed.StopChannel``) at the same step on every rank (the rule: this
    module's docstring); the handlers go with it (``exiting``: see :class:`StopSignals`)."""
    request = StopRequest()
    with StopSignals(request, say, exiting=exiting):
        yield Stop(request, channel)


class Stop:
    """Whether to stop: the same answer on every rank, at the same step, and no wait for
    the device.

    A signal reaches each process at its own moment, or only some of them (one node's
    scheduler, Ctrl-C in one terminal); a rank that stopped alone would leave its peers
    waiting in their next collective. So after every optimizer step each rank sends its
    :class:`StopRequest`'s signal (0: none) through the channel, in the background, and
    receives the previous step's largest, which has long arrived: a stop asked for during
    step k ends step k + 1 on every rank. The first that finds a signal decides the stop (the
    highest signal number, if ranks got different ones), the same on every rank, and so the
    exit status (``request.agreed``). In one process: the request itself, after the current
    step."""

    def __init__(self, request: StopRequest, channel) -> None:
        self.request, self.channel = request, channel
        self._epochs_begun = 0

    def _receive(self) -> bool:
        """The pending round (False if none); a stop another rank asked for becomes this
        rank's too."""
        signum = self.channel.receive()
        if signum:
            self.request.agree(signal.Signals(signum).name)
        return bool(signum)

    def _alone(self) -> bool:
        if self.request.requested:
            self.request.agree(self.request.signal_name)
        return self.request.requested

    def after_step(self) -> bool:
        """After each optimizer step, with no wait: True when every rank stops now (on what
        was sent after the step before)."""
        if self.channel.group is None:
            return self._alone()
        stop = self._receive()
        self.channel.send(self.request.signum)
        return stop

    def before_epoch(self) -> bool:
        """Before an epoch (blocking): whether any rank asked to stop since the previous
        epoch's last step, during its validation, save or log. The run's first epoch asks
        nothing (a signal during the set-up is seen after the first step)."""
        first, self._epochs_begun = not self._epochs_begun, self._epochs_begun + 1
        return False if first else self.any_rank_asked()

    def any_rank_asked(self) -> bool:
        """At an epoch's end and at the run's (blocking): whether any rank asked to stop by
        now; also receives the round in flight, so none is left pending."""
        if self.channel.group is None:
            return self._alone()
        stop = self._receive()
        self.channel.send(self.request.signum)
        return self._receive() or stop
