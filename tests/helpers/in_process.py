"""The one way the tests run a script in this process: its ``main(argv)``, where a process of
its own adds nothing (no signal, exit status of a real interpreter, torchrun or teardown is
the point: those tests start one, tests/helpers/processes.py). The result is a
:class:`ScriptResult`, as for a process: the exit status, what it printed, and the warnings it
raised after its stderr, as an interpreter shows them; the environment, ``sys.argv`` and the
working folder are the caller's again afterwards."""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import warnings
from typing import Dict, Optional

from helpers.processes import AMP_DIR, TORCHRUN_VARS, ScriptResult


def run_main(name: str, *args, env: Optional[Dict[str, str]] = None) -> ScriptResult:
    """``AMP/<name>.py``'s ``main(argv)``; torchrun's variables are out of the environment for
    the call (a DDP script then makes a group of one, as under plain ``python``)."""
    module = importlib.import_module(name.removesuffix(".py"))
    argv = [str(a) for a in args]
    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    for key in TORCHRUN_VARS:
        os.environ.pop(key, None)
    os.environ.update(env or {})
    sys.argv = [str(AMP_DIR / f"{module.__name__}.py"), *argv]
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            warnings.simplefilter("default")  # each one once, as a fresh interpreter shows it
            try:
                code = module.main(argv) or 0  # a train script's status: 128 + a stop's signal
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                    for w in caught)
    return ScriptResult(code, out.getvalue(), err.getvalue() + shown, [name, *argv])
