"""The client of zygote.py: ``python [-u] [-W opt] (script | -m module) args...``, run as a
fork of the warm server instead of a new interpreter (see zygote.py). Standard library
only; conftest's ``python`` wrapper runs it as ``REAL_PYTHON -S python_via_zygote.py
SOCKET_PATH ARGS...``. What it does not understand (``-c``, other options) and a server
that does not answer go to the real interpreter, unchanged."""
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def parse(args):
    """{"mode", "target", "args", "unbuffered", "warnoptions"} or None."""
    unbuffered, warnoptions, i = False, [], 0
    while i < len(args):
        a = args[i]
        if a == "-u":
            unbuffered, i = True, i + 1
        elif a == "-W" and i + 1 < len(args):
            warnoptions.append(args[i + 1])
            i += 2
        elif a.startswith("-W") and len(a) > 2:
            warnoptions.append(a[2:])
            i += 1
        elif a == "-m" and i + 1 < len(args):
            return dict(mode="module", target=args[i + 1], args=args[i + 2:],
                        unbuffered=unbuffered, warnoptions=warnoptions)
        elif a.startswith("-"):
            return None
        else:
            return dict(mode="script", target=os.path.abspath(a), args=args[i + 1:],
                        unbuffered=unbuffered, warnoptions=warnoptions)
    return None


def main():
    path, args = sys.argv[1], sys.argv[2:]
    request = parse(args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if request is None:
            raise OSError("not for the zygote")
        conn.connect(path)
    except OSError:
        os.execv(sys.executable, [sys.executable, *args])
    request.update(env=dict(os.environ), cwd=os.getcwd(), client=os.getpid())
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:  # a closed standard stream: /dev/null, as the child would find
            fds.append(os.open(os.devnull, os.O_RDWR))
    socket.send_fds(conn, [b"F"], fds)
    conn.sendall(json.dumps(request).encode() + b"\n")
    replies = conn.makefile("rb")
    pid = json.loads(replies.readline())["pid"]

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    line = replies.readline()
    status = json.loads(line)["status"] if line else (128 + signal.SIGKILL) << 8
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)  # die of it too, so the caller sees the same status
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
