"""The project's exceptions: a user's mistake, a fault one process found, a second Ctrl-C.
How a process ends on them -- one line, a non-zero exit status -- is ``ampkit.run.report_user_errors``'s."""
from __future__ import annotations


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


def first_line(e: BaseException) -> str:
    """An exception's first line (its type's name if it has none), at most 200 characters."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
