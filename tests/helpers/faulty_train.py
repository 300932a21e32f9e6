"""Run a training script with an injected fault, for the resilience tests.

    python tests/helpers/faulty_train.py VARIANT [train flags...]     # e.g. train_GradScaler

Environment:
  FAULT_EXIT_AT_STEP=N   this process dies (os._exit(1), no cleanup) at optimizer step N ...
  FAULT_RANK=R           ... only on global rank R (default 0) ...
  FAULT_MARKER=PATH      ... and only once: the marker file records that it happened.
  FAULT_KILL_IN_SAVE=N   SIGKILL this process half-way through writing its N-th checkpoint file
                         (saying on stderr which thread was writing it).
  FAULT_KILL_BEFORE_LINK=N  SIGKILL this process just before its N-th best.pth is made a second
                         name for last.pth (last.pth written, best.pth not yet).
  FAULT_SLOW_SAVE=N      the N-th checkpoint file is written slowly (a slow disk): half of it,
                         then FAULT_MARKER is created, and the write goes on 60 s later.
  FAULT_SIGTERM_AT_LOSS=N  this process sends itself SIGTERM (FAULT_SIGNAL=SIGINT: Ctrl-C,
                         or SIGUSR1) as it computes its N-th training loss (one per
                         micro-batch): a stop in the middle of a step; with FAULT_RANK, on that
                         rank only; with FAULT_TO_GROUP=1, to its whole process group, as a
                         scheduler signals a job (its DataLoader workers too).
  FAULT_EXIT_FILE=PATH   each process writes the status it exits with (main's, or its SystemExit's) to
                         PATH.<RANK>: where torchrun, stopped by a signal itself, reports none.
  FAULT_SLOW_EXIT=S      every rank but FAULT_RANK sleeps S seconds as its interpreter exits:
                         FAULT_RANK exits first, and torchrun's SIGTERM to the others (which
                         it sends once a worker has failed) reaches them while they tear down.
"""
import atexit
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "AMP"))

import torch  # noqa: E402

exit_at = int(os.environ.get("FAULT_EXIT_AT_STEP", "0"))
kill_in_save = int(os.environ.get("FAULT_KILL_IN_SAVE", "0"))
slow_save = int(os.environ.get("FAULT_SLOW_SAVE", "0"))
sigterm_at_loss = int(os.environ.get("FAULT_SIGTERM_AT_LOSS", "0"))
losses = 0
marker = Path(os.environ.get("FAULT_MARKER", "/nonexistent/marker"))
steps = saves = 0

if exit_at and int(os.environ.get("RANK", "0")) == int(os.environ.get("FAULT_RANK", "0")):
    original_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        global steps
        steps += 1
        if steps == exit_at and not marker.exists():
            marker.touch()
            os._exit(1)
        return original_step(self, *args, **kwargs)

    torch.optim.AdamW.step = step

if sigterm_at_loss and os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK",
                                                                   os.environ.get("RANK", "0")):
    stop_signal = getattr(signal, os.environ.get("FAULT_SIGNAL", "SIGTERM"))
    original_loss = torch.nn.CrossEntropyLoss.forward

    def loss_forward(self, *args, **kwargs):
        global losses
        losses += 1
        if losses == sigterm_at_loss and os.environ.get("FAULT_TO_GROUP") == "1":
            # From another process, as a scheduler's: `kill -- -PGID` (it is in the group).
            subprocess.run(["kill", f"-{stop_signal.name[3:]}", "--", f"-{os.getpgid(0)}"])
        elif losses == sigterm_at_loss:
            os.kill(os.getpid(), stop_signal)
        return original_loss(self, *args, **kwargs)

    torch.nn.CrossEntropyLoss.forward = loss_forward

if float(os.environ.get("FAULT_SLOW_EXIT", "0")) and \
        os.environ.get("RANK", "0") != os.environ.get("FAULT_RANK", "0"):
    atexit.register(time.sleep, float(os.environ["FAULT_SLOW_EXIT"]))

if kill_in_save or slow_save:
    original_save = torch.save

    def save(obj, f, *args, **kwargs):
        global saves
        saves += 1
        if saves in (kill_in_save, slow_save):
            f.write(b"PK\x03\x04 half a checkpoint")
            f.flush()
        if saves == kill_in_save:
            print(f"killed in save {saves} on thread {threading.current_thread().name}",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if saves == slow_save:
            marker.touch()
            time.sleep(60)
        return original_save(obj, f, *args, **kwargs)

    torch.save = save  # looked up by ampkit.checkpoint.writer.atomic_save at call time

kill_before_link = int(os.environ.get("FAULT_KILL_BEFORE_LINK", "0"))
if kill_before_link:
    import ampkit.checkpoint.writer as writer

    original_link, links = writer.link_or_write, []

    def link_or_write(link):
        links.append(link)
        if len(links) == kill_before_link:
            print(f"killed before link {len(links)}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original_link(link)

    writer.link_or_write = link_or_write  # looked up by the background writer at call time

if __name__ == "__main__":
    exit_file = os.environ.get("FAULT_EXIT_FILE")
    try:
        status = importlib.import_module(sys.argv[1]).main(sys.argv[2:]) or 0
    except SystemExit as e:
        if exit_file:
            Path(f"{exit_file}.{os.environ.get('RANK', '0')}").write_text(str(e.code))
        raise
    if exit_file:
        Path(f"{exit_file}.{os.environ.get('RANK', '0')}").write_text(str(status))
    sys.exit(status)
