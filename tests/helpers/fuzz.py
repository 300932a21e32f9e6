"""Bad input by the thousand: the property-based tests' profiles, and their tally.

Every fuzz test hands the project generated input (hypothesis) and asserts the contract: the
input works as it should, or it is refused by a ``UserError`` of one line; never another
exception (a traceback), never a result that differs from what the input holds. Each
example is tallied by :func:`outcome` under its kind: "ran" or "refused".

Profiles (``HYPOTHESIS_PROFILE``): ``quick`` (the default: a few dozen examples a test, a
fixed seed, the quick tier's) and ``thorough`` (thousands, the same fixed seed:
``checks/fuzz.sh`` runs it and prints the tally that docs/robustness.md holds). Examples
are derived from the test's name, not drawn at random, and no example database is kept: a
run is the same every time.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Callable, Optional, TypeVar

from hypothesis import HealthCheck, Phase, settings

from ampkit.errors import UserError

# No "explain" phase: it imports libcst, whose import warns of deprecations.
_COMMON = dict(derandomize=True, database=None, deadline=None, print_blob=True,
               phases=[Phase.explicit, Phase.generate, Phase.shrink],
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])
settings.register_profile("quick", max_examples=25, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "quick")
settings.load_profile(PROFILE)


def examples(quick: int, thorough: int) -> settings:
    """A test's own number of examples, by profile: for one whose example runs a script."""
    return settings(max_examples=quick if PROFILE == "quick" else thorough)

# (kind, "ran" | "refused") -> examples, over this test session.
TALLY: Counter = Counter()

T = TypeVar("T")


def outcome(kind: str, attempt: Callable[[], T]) -> Optional[T]:
    """Run ``attempt``: its result ("ran"), or None where it raised a one-line UserError
    ("refused"); any other exception propagates, and fails the test."""
    try:
        result = attempt()
    except UserError as e:
        text = str(e)
        assert text and "\n" not in text and "Traceback" not in text, repr(text)
        TALLY[kind, "refused"] += 1
        return None
    TALLY[kind, "ran"] += 1
    return result


def write_tally(path: Path) -> None:
    """The session's tally, as JSON: {kind: {"ran": n, "refused": n}}."""
    table: dict = {}
    for (kind, what), n in sorted(TALLY.items()):
        table.setdefault(kind, {"ran": 0, "refused": 0})[what] = n
    Path(path).write_text(json.dumps(table, indent=1) + "\n")
