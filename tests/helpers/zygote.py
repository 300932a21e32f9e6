"""A warm Python for the tests' subprocesses: torch imported once, a fork per run.

Every script the tests start is a process of its own, as a user runs it; on the test
machine most of such a run is ``import torch, torchvision`` (~4-5 s of CPU each, ~90
processes in the full suite). This server imports them once, then forks a child per
request from ``python_via_zygote.py`` (the client, which conftest puts where the tests'
``python`` is). The child becomes the process the client asked for: the client's
stdin/stdout/stderr (passed over the socket), environment, working directory, argv,
``sys.path[0]`` and warning options, then ``runpy`` runs the script or module as
``__main__`` and the interpreter ends as ``python script.py`` would (atexit, thread
joins, exit status, death by a signal). The client forwards the signals it gets to the
child and ends with the child's status; a child whose client dies is killed (SIGKILL).

Not a fresh process in what was decided at start-up and import: the environment torch
saw when it was imported here (conftest starts this server without torchrun's variables
or PYTHONWARNINGS), ``sys.path`` beyond its first entry (this server's PYTHONPATH), and
``OMP_NUM_THREADS``, which the child applies with ``torch.set_num_threads``. The server runs no torch operation, so no thread pool is
forked. ``AMP_TESTS_ZYGOTE=0`` makes conftest use the plain interpreter instead.

Usage (conftest does this): ``python zygote.py SOCKET_PATH CLIENT_WRAPPER RUNS_FOLDER``.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import warnings

_BEFORE = list(warnings.filters)  # the interpreter's own defaults
import numpy  # noqa: E402,F401  (what the scripts import, imported once for every child)
import PIL.Image  # noqa: E402,F401
import torch  # noqa: E402
import torch.distributed.fsdp  # noqa: E402,F401
import torch.distributed.launcher.api  # noqa: E402,F401  (torchrun, but not its __main__)
import torch.utils.tensorboard  # noqa: E402,F401
import torchvision  # noqa: E402,F401
import tqdm  # noqa: E402,F401
from matplotlib.figure import Figure  # noqa: E402,F401

# Filters that importing the libraries added (in front of the defaults, as in a fresh
# process, where the -W/PYTHONWARNINGS options sit between the two).
_ADDED = list(warnings.filters[:len(warnings.filters) - len(_BEFORE)])


def _serve(path: str, runs: str) -> tuple:
    """Fork a child per request; return (request, conn, fds) in the child, never in the
    server. ``runs/<child pid>`` holds the pid of the client it runs for, while it runs."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict = {}  # pid -> the client's connection

    def stop(signum, frame):  # the session ends (or is killed): so does every child's tree
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=0.02):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                    request = json.loads(conn.makefile("rb").readline())
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    return request, conn, fds
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                with open(os.path.join(runs, str(pid)), "w") as f:  # for conftest.kill_job
                    f.write(str(request["client"]))
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            try:
                os.remove(os.path.join(runs, str(pid)))
            except OSError:
                pass
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass  # the client is gone
                conn.close()


def _std_streams(unbuffered: bool) -> None:
    def text(fd, mode, **kw):
        raw = io.FileIO(fd, mode, closefd=False)
        if unbuffered and mode == "wb":
            return io.TextIOWrapper(raw, write_through=True, **kw)
        buffered = io.BufferedReader(raw) if mode == "rb" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, **kw)

    sys.stdin = sys.__stdin__ = text(0, "rb", encoding="utf-8")
    sys.stdout = sys.__stdout__ = text(1, "wb", encoding="utf-8",
                                       line_buffering=os.isatty(1))
    sys.stderr = sys.__stderr__ = text(2, "wb", encoding="utf-8", errors="backslashreplace",
                                       line_buffering=True)


def _become(request: dict, conn: socket.socket, fds: list, wrapper: str) -> None:
    """Turn this fork into the process the client asked for."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _std_streams(request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    options = [o for o in os.environ.get("PYTHONWARNINGS", "").split(",") if o]
    options += request["warnoptions"]
    sys.warnoptions[:] = options
    warnings.filters[:] = _BEFORE
    warnings._processoptions(options)  # in front of the defaults, as at start-up
    warnings.filters[:0] = _ADDED
    warnings._filters_mutated()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.executable = wrapper  # what the child starts in turn (torchrun's workers) comes here too
    mode, target = request["mode"], request["target"]
    sys.argv[:] = [target if mode == "script" else "-m", *request["args"]]
    sys.path[0] = (os.path.dirname(os.path.realpath(target)) if mode == "script"
                   else os.getcwd())

    def watch():  # the client died (SIGKILL): so does its process
        while conn.recv(1024):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-client-watch", daemon=True).start()


def _run(request: dict) -> None:
    """Run the script or module as __main__, then end as the interpreter would: the exit
    status of SystemExit or 1 after a traceback, non-daemon threads joined, atexit
    handlers, the streams flushed, and death by SIGINT after an uncaught
    KeyboardInterrupt. What is left out is the teardown of every module (~1.5 s with torch
    loaded), in which only objects' ``__del__`` could still act."""
    code, by_sigint = 0, False
    try:
        if request["mode"] == "script":
            runpy.run_path(request["target"], run_name="__main__")
        else:
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        by_sigint, code = isinstance(sys.exc_info()[1], KeyboardInterrupt), 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if by_sigint:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    _request, _conn, _fds = _serve(sys.argv[1], sys.argv[3])
    _become(_request, _conn, _fds, sys.argv[2])
    del _fds
    _run(_request)
