"""The --help of ``compare.py`` and ``benchmark.py``: each option's default said once.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)`` to every help, also
where the help already says its default in words (``Default: the article's nine``), and
where X is None or the False of a switch, which tell a reader nothing.
"""
from __future__ import annotations

import argparse


class DefaultsOnce(argparse.HelpFormatter):
    """Appends ``(default: X)`` where the help does not say "default" itself and X is a
    value: not None, not an empty list, not the default of a switch that takes no value
    (``--busy``); a ``--x/--no-x`` pair's default is a value."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if ("default" in text.lower() or default is None or default is argparse.SUPPRESS
                or default == [] or switch or not action.option_strings):
            return text
        return text + " (default: %(default)s)"
