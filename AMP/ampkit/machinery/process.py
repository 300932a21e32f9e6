"""This process: how it ends on a user's mistake or a fault (one line on stderr and a
non-zero exit, never a traceback: :func:`report_user_errors`), the device it trains on
(``--cuda`` / ``--no-cuda`` / neither: one device for a script that runs in one process,
``cuda:LOCAL_RANK`` or the CPU for a process of a group), its place in its process group as
a record (:class:`DistInfo`), the device's sync before a clock is read, and seeds derived
per rank, epoch or device (``seed_streams``: each rank's own).

Nothing here talks to the group: the collectives are the scripts' and ``ampkit.distributed``'s
(which makes the record, ``this_process``), so the code under ``machinery/`` runs the same
in every process and a reader sees where every rank must make the same call.
"""
from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

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


def want_cuda(flag: Optional[bool]) -> bool:
    """``--cuda`` (True), ``--no-cuda`` (False) or neither (None: CUDA when available)."""
    if flag is None:
        return torch.cuda.is_available()
    if flag and not torch.cuda.is_available():
        raise UserError("--cuda was given but CUDA is not available on this machine "
                        "(use --no-cuda to run on the CPU)")
    return flag


def single_process_device(cuda_flag: Optional[bool]) -> torch.device:
    """The device of a script that runs in one process (one device, or DataParallel)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun started N copies of a single-process script: each would train the same
        # model on the same data and write the same files.
        raise UserError(f"this script runs in one process (one device or DataParallel), but "
                        f"torchrun started {os.environ['WORLD_SIZE']} (WORLD_SIZE): run it with "
                        "python, or use a DDP or FSDP script (train_DDP*, train_FSDP*, "
                        "eval_DDP) under torchrun")
    return torch.device("cuda" if want_cuda(cuda_flag) else "cpu")


def process_device(cuda_flag: Optional[bool], local_rank: int) -> torch.device:
    """The device this process of a group owns: ``cuda:LOCAL_RANK``, or the CPU."""
    if not want_cuda(cuda_flag):
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} "
                        "GPU(s) are visible: start at most one process per GPU")
    return torch.device("cuda", local_rank)


@dataclass
class DistInfo:
    """This process: its device, and its rank among ``world_size`` (0 of 1 without a group)."""
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    distributed: bool = False  # a process group is initialised

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that prints, logs and writes."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that prepares data."""
        return self.local_rank == 0


def derived_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed mixing ``seed`` with ``parts`` (a rank, an epoch, a device): distinct,
    reproducible streams for each."""
    state = np.random.SeedSequence([seed % 2**64, *parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_streams(seed: int, rank: int, cuda: bool) -> None:
    """After the model is built from ``seed`` (the same weights on every rank, for any world
    size): this rank's own random streams, for dropout and the classic path's flips. With
    ``cuda``, each visible GPU gets a stream of its own too: ``torch.manual_seed`` gives
    every GPU the same one, so DataParallel's replicas would draw the same dropout masks on
    their chunks of the batch."""
    torch.manual_seed(derived_seed(seed, 1, rank))
    if cuda:
        torch.cuda.init()  # the generators exist once CUDA is initialised (no context yet)
        for index in range(torch.cuda.device_count()):
            torch.cuda.default_generators[index].manual_seed(derived_seed(seed, 2, rank, index))
