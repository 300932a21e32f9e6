"""User mistakes end in one line on stderr and a non-zero exit, never a traceback."""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from the user (flags, paths, data): reported in one line."""


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def report_user_errors(main: Callable) -> Callable:
    """Turn :class:`UserError` (and Ctrl-C before training starts) into a one-line message."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        prog = os.path.basename(sys.argv[0]) or "ampkit"
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if _is_rank0():
                print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
            sys.exit(130)

    return wrapper
