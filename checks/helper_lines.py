"""How much of the shared code a reader of a train script has to follow: the helper modules
it imports from, the lines of ampkit/ a 1-epoch run executes, and those under its epoch loop.

    python checks/helper_lines.py train_DDP_GradScaler          # as a group of one process
    python checks/helper_lines.py train_autocast --lines         # and every line, by file

Under ``sys.settrace``, in this process's main thread (the checkpoint writer's is not
followed): the script's import (the helpers' module-level lines: their definitions), then its
``main()``, one epoch of FakeData on the CPU (AlexNet at 64 px, batch 100: 10 steps, the fast
input path). A line counts once however often it runs. "Under the epoch loop": executed while
``train()`` (the run) stands on a line of its ``for epoch`` loop, in whatever it calls: the
lines executed, and the functions entered, whole (what a reader follows from the loop: the
call tree).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AMP = REPO / "AMP"
HELPERS = AMP / "ampkit"
sys.path.insert(0, str(AMP))


def imported_helpers(script: str) -> list:
    """The ampkit modules a script imports from, as its import statements name them."""
    tree = ast.parse((AMP / f"{script}.py").read_text())
    return sorted({node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and (node.module or "").startswith("ampkit")})


def epoch_loop_lines(script: str) -> range:
    """The lines of the ``for`` loop in the script's ``train()``, its run."""
    tree = ast.parse((AMP / f"{script}.py").read_text())
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    loop = next(n for n in ast.walk(run) if isinstance(n, ast.For))
    return range(loop.lineno, loop.end_lineno + 1)


def trace(script: str, argv: list) -> tuple:
    """(every helper line executed, its imports' included; those under the epoch loop):
    sets of (file, line)."""
    script_file, loop = str(AMP / f"{script}.py"), epoch_loop_lines(script)
    helpers, under_loop, in_loop, entered = set(), set(), [False], set()

    def local(frame, event, arg):
        if event == "line":
            file = frame.f_code.co_filename
            if file == script_file and frame.f_code.co_name == "train":
                in_loop[0] = frame.f_lineno in loop
            elif file.startswith(str(HELPERS)):
                helpers.add((file, frame.f_lineno))
                if in_loop[0]:
                    under_loop.add((file, frame.f_lineno))
        return local

    def calls(frame, event, arg):
        file = frame.f_code.co_filename
        if in_loop[0] and file.startswith(str(HELPERS)):
            entered.add(frame.f_code)
        return local if file.startswith(str(HELPERS)) or file == script_file else None

    sys.settrace(calls)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            status = importlib.import_module(script).main(argv)
    finally:
        sys.settrace(None)
    if status:
        raise SystemExit(f"{script} exited {status}")
    return helpers, under_loop, {(code.co_filename, line) for code in entered
                                 for line in _span(code)}


def _span(code) -> range:
    """The source lines of a function, from its ``def`` to its last line."""
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return range(code.co_firstlineno, max(lines, default=code.co_firstlineno) + 1)


def by_file(lines: set) -> dict:
    counts = defaultdict(int)
    for file, _ in lines:
        counts[str(Path(file).relative_to(AMP))] += 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("script", help="a train script, e.g. train_DDP_GradScaler")
    p.add_argument("--lines", action="store_true", help="the line counts by file too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="helper_lines.") as folder:
        helpers, under_loop, read = trace(args.script, [
            "--dataset", "FakeData", "--img_size", "64", "--batch_size", "100", "--epochs", "1",
            "--device", "cpu", "--no-tensorboard", "--checkpoint", folder])
    modules = imported_helpers(args.script)
    print(f"{args.script}: imports from {len(modules)} helper modules ({', '.join(modules)})")
    for name, lines in (("a 1-epoch run executes", helpers),
                        ("under the epoch loop, executed", under_loop),
                        ("under the epoch loop, the functions it enters, whole", read)):
        files = by_file(lines)
        print(f"  {name}: {len(lines)} helper lines in {len(files)} files")
        if args.lines:
            print("".join(f"    {n:5d} {f}\n" for f, n in files.items()), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
