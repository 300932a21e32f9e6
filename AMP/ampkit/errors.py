"""How this process ends on a user's mistake or a fault: one line on stderr and a non-zero
exit, never a traceback (:func:`report_user_errors` around a script's ``main``).

:class:`UserError` is bad input (flags, paths, data), the same on every rank, said by rank 0;
:class:`RankError` a fault one process found by itself, said by that process;
:class:`Interrupted` a second Ctrl-C, with what was saved; a peer lost under torchrun is
one line and exit status 1, so that torchrun can restart or stop the job.
"""
from __future__ import annotations

import functools
import os
import re
import sys
from typing import Callable, Optional


EXIT_USER_ERROR = 2
EXIT_LOST_PEER = 1


class UserError(Exception):
    """Bad input from the user (flags, paths, data): reported in one line. Every rank meets
    the same ones (the same flags, the same files), so global rank 0 alone prints it."""

    every_rank = False


class RankError(UserError):
    """A fault one process found by itself (an unreadable image in its share of the data):
    that process prints it, with its rank when there are several."""

    every_rank = True


class Interrupted(KeyboardInterrupt):
    """Ctrl-C twice: what was and was not saved; ``now``: a checkpoint write was cut short,
    and the process ends at once (Python must not finalize under a running torch.save)."""

    def __init__(self, saved: str = "", now: bool = False) -> None:
        super().__init__(saved)
        self.now = now


# How a collective fails when another process of the group has died (gloo's and NCCL's words).
_LOST_PEER = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Connection refused|"
                        r"NCCL communicator was aborted|remote process exited|"
                        r"(?:gloo|NCCL).*?[Tt]imed out", re.S)


def first_line(e: BaseException) -> str:
    """An exception's first line (its type's name if it has none), at most 200 characters."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def lost_peer(error: BaseException) -> Optional[str]:
    """Why a collective failed, when it failed because a peer process died; else None."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    match = _LOST_PEER.search(text)
    if match is None:
        return None
    where = re.search(r"\[[\d.:a-f]+\]:\d+", text)
    return match.group(0).split("\n")[0] + (f" {where.group(0)}" if where else "")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _several() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def report_user_errors(main: Callable) -> Callable:
    """A script's ``main``: a :class:`UserError`, Ctrl-C before training starts, or a peer
    process lost under torchrun end in one line and a non-zero exit status. The script has
    left its process group by then, in its own ``finally``."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        prog = os.path.basename(sys.argv[0]) or "ampkit"
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if _rank() == 0 or e.every_rank:
                who = f"rank {_rank()}: " if e.every_rank and _several() else ""
                print(f"{prog}: error: {who}{e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt as e:  # a terminal's Ctrl-C reaches every rank: rank 0 says it
            if _rank() == 0:
                print(f"{prog}: interrupted" + (f"; {e}" if str(e) else ""), file=sys.stderr,
                      flush=True)
            if getattr(e, "now", False):
                os._exit(130)
            sys.exit(130)
        except RuntimeError as e:
            reason = lost_peer(e) if _several() else None
            if reason is None:
                raise
            print(f"{prog}: error: rank {_rank()}: lost a peer process ({reason}); exiting so "
                  "torchrun can restart or stop", file=sys.stderr, flush=True)
            sys.exit(EXIT_LOST_PEER)

    return wrapper
