"""Shared test helpers for the AMP scripts (imported by every test file).

``AMP/`` is put on ``sys.path`` so tests can ``import ampkit`` and ``import alexnet``
in-process.

Fixtures (session-scoped, generated once per test session, never touching the repo):

``imagefolder_root`` -> Path
    A tiny *learnable* ImageFolder data set: ``<root>/train/<class>/*.png`` and
    ``<root>/val/<class>/*.png``, 3 classes (``red``, ``green``, ``blue``: the class is
    the dominant colour of a noisy 32x32 image). 16 train and 7 val images per class,
    i.e. 48 train / 21 val: the val size is odd, so no world size > 1 divides it.
    See ``IF_CLASSES``, ``IF_TRAIN_PER_CLASS``, ``IF_VAL_PER_CLASS``, ``IF_VAL_SIZE``.

``mini_imagefolder_root`` -> Path
    The same, with ``MINI_TRAIN_PER_CLASS`` train and ``MINI_VAL_PER_CLASS`` val images
    per class (6 / 3): for a run whose network is slow on this CPU.

``cifar_root`` -> Path
    A tiny CIFAR-10 in torchvision's on-disk format (what ``cifar-10-python.tar.gz``
    extracts to): ``<root>/cifar-10-batches-py/data_batch_1..5``, ``test_batch`` and
    ``batches.meta`` (latin1-compatible pickles; ``data`` is uint8 N x 3072,
    ``labels`` a list; the meta dict has ``label_names``). ``CIFAR_TRAIN_PER_BATCH``
    images per train batch (``CIFAR_TRAIN_SIZE`` in all) and ``CIFAR_TEST_SIZE`` (odd)
    test images; the class is again a colour, so it is learnable.

Functions:

``PYTHON``: the interpreter the tests start scripts with (``sys.executable``: a real, fresh
    one each time, whose exit status, streams, signals and teardown are a user's).

``kill_job(pid, sig)``: ``sig`` to every process of a job started in a session of its own
    (``start_new_session=True``), as a batch scheduler signals one; to ``pid`` alone if it
    leads no group of its own.

``run_main(name, *args)``: a script's ``main(argv)`` in this process, where a process of
    its own adds nothing: a :class:`ScriptResult` with what it printed, the warnings it
    raised (on stderr, as an interpreter shows them) and its exit status; the environment
    and the working folder are the caller's again afterwards.

``run_script(name, *args, torchrun_nproc=None, env=None, timeout=DEFAULT_TIMEOUT)``
    Run ``python AMP/<name>.py *args`` from the repository root, or, with
    ``torchrun_nproc=N``, ``python -m torch.distributed.run --standalone
    --nproc_per_node=N AMP/<name>.py *args`` (``--standalone`` picks a free
    rendezvous port, so parallel runs never collide), with ``PYTHON``. ``name`` may be
    given with or without ``.py``. ``env`` is merged over a copy of ``os.environ`` from which
    torchrun's variables (RANK, WORLD_SIZE, MASTER_PORT, ...) are removed; unless
    PYTHONWARNINGS is set, DeprecationWarnings raised for ``AMP/`` code are made
    visible (Python hides them by default outside ``__main__``), so
    ``assert_clean_stderr`` sees them.
    Returns a :class:`ScriptResult`, which unpacks as ``(returncode, stdout, stderr)``
    with tqdm's carriage-return redraws removed (``clean_output``); the untouched text
    is in ``.raw_stdout`` / ``.raw_stderr``. On timeout the whole process group is
    killed and the test fails with the output so far.

``clean_output(text)``: keep what a terminal would finally show on each line (the part
    after the last ``\\r``); drop blank lines and tqdm progress-bar lines.
``parse_accuracy(stdout)`` -> ``(correct, total)`` from the eval scripts' ``correct/total = acc``.
``assert_no_traceback_of_ours(stdout, stderr)``: no traceback through the project's code in
    either stream (torchrun's own report of its workers' exit is allowed).
``assert_clean_stderr(stderr)``: no traceback, no ``*Warning`` (DeprecationWarning,
    FutureWarning, UserWarning, ...), no ``warning:`` line other than ampkit's own
    "warning: this CPU has no native bfloat16" notice.
``tiny_args(tmp, dataset_root, dataset=, epochs=1, batch_size=16, lr=None,
    tensorboard=False, cuda=False)``: the flags of a quick training run (64 px,
    ``--no-cuda`` unless ``cuda``, ``--no-tensorboard`` unless ``tensorboard``;
    ``--checkpoint tmp/checkpoint`` and ``--tensorboard_log tmp/tensorboard``).
``event_files(folder)``: TensorBoard event files under a folder (recursively).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
AMP_DIR = REPO_ROOT / "AMP"
if str(AMP_DIR) not in sys.path:
    sys.path.insert(0, str(AMP_DIR))

DEFAULT_TIMEOUT = 600  # seconds; generous: the test machine's 2 cores are shared

# The network of the tests that are about the machinery (resuming, signals, restarts, DDP,
# compare), not about AlexNet: small (0.34M parameters, with BatchNorm), and quick in
# bfloat16 even on a CPU without native bfloat16, where AlexNet's autocast steps are ~40x
# slower than its fp32 ones. Measured on this project's 2-core test machine, one step of 8
# images at 64 px, fp32 / bf16 autocast: 49 / 163 ms, mobilenet_v3_small 72 / 359 ms.
# FSDP2's runs take FSDP_ARCH: it warns about a sharded block whose output is a view, which
# ShuffleNet's blocks return (channel shuffle). AlexNet's own runs: test_scripts.py.
FAST_ARCH = "shufflenet_v2_x0_5"
FSDP_ARCH = "mobilenet_v3_small"

# ---------------------------------------------------------------- data: ImageFolder
IF_CLASSES = ("blue", "green", "red")  # ImageFolder sorts class folders by name
IF_COLOURS = {"red": (210, 40, 40), "green": (40, 190, 40), "blue": (40, 40, 210)}
IF_TRAIN_PER_CLASS = 16
IF_VAL_PER_CLASS = 7
IF_TRAIN_SIZE = IF_TRAIN_PER_CLASS * len(IF_CLASSES)  # 48
IF_VAL_SIZE = IF_VAL_PER_CLASS * len(IF_CLASSES)      # 21 (odd)
MINI_TRAIN_PER_CLASS, MINI_VAL_PER_CLASS = 2, 1  # mini_imagefolder_root: 6 train / 3 val
IMG_PX = 32

# ---------------------------------------------------------------- data: CIFAR-10
CIFAR_LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer",
                     "dog", "frog", "horse", "ship", "truck"]
CIFAR_TRAIN_PER_BATCH = 6
CIFAR_TRAIN_SIZE = 5 * CIFAR_TRAIN_PER_BATCH  # 30
CIFAR_TEST_SIZE = 11                          # odd


def _noisy_image(rng: np.random.Generator, colour: Sequence[int]) -> np.ndarray:
    """HWC uint8: a flat colour plus noise (the class is recoverable from the mean colour)."""
    base = np.asarray(colour, dtype=np.int16)[None, None, :]
    noise = rng.integers(-35, 36, size=(IMG_PX, IMG_PX, 3), dtype=np.int16)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def _write_imagefolder(root: Path, train_per_class: int, val_per_class: int) -> Path:
    from PIL import Image

    rng = np.random.default_rng(1234)
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for name in IF_CLASSES:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(_noisy_image(rng, IF_COLOURS[name])).save(folder / f"{i:03d}.png")
    return root


@pytest.fixture(scope="session")
def imagefolder_root(tmp_path_factory) -> Path:
    return _write_imagefolder(tmp_path_factory.mktemp("imagefolder"), IF_TRAIN_PER_CLASS,
                              IF_VAL_PER_CLASS)


@pytest.fixture(scope="session")
def mini_imagefolder_root(tmp_path_factory) -> Path:
    """The same classes, 2 train and 1 val image each: a run whose network is slow here."""
    return _write_imagefolder(tmp_path_factory.mktemp("mini_imagefolder"), MINI_TRAIN_PER_CLASS,
                              MINI_VAL_PER_CLASS)


def _cifar_colour(label: int) -> Tuple[int, int, int]:
    # 10 well-separated colours: corners and edges of the RGB cube.
    palette = [(230, 30, 30), (30, 230, 30), (30, 30, 230), (230, 230, 30), (230, 30, 230),
               (30, 230, 230), (240, 240, 240), (20, 20, 20), (128, 128, 30), (30, 128, 128)]
    return palette[label]


def _cifar_batch(rng: np.random.Generator, labels: List[int], name: str) -> Dict:
    # CIFAR's row layout: 1024 red, 1024 green, 1024 blue values per image (CHW flattened).
    data = np.stack([_noisy_image(rng, _cifar_colour(y)).transpose(2, 0, 1).reshape(-1)
                     for y in labels])
    assert data.shape == (len(labels), 3072) and data.dtype == np.uint8
    return {"batch_label": name, "labels": list(labels), "data": data,
            "filenames": [f"img_{i}.png" for i in range(len(labels))]}


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(99)
    label = 0
    for b in range(1, 6):
        labels = [(label + i) % 10 for i in range(CIFAR_TRAIN_PER_BATCH)]
        label += CIFAR_TRAIN_PER_BATCH
        with open(folder / f"data_batch_{b}", "wb") as f:
            pickle.dump(_cifar_batch(rng, labels, f"training batch {b} of 5"), f, protocol=2)
    test_labels = [i % 10 for i in range(CIFAR_TEST_SIZE)]
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(_cifar_batch(rng, test_labels, "testing batch 1 of 1"), f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": CIFAR_LABEL_NAMES, "num_cases_per_batch": 10000,
                     "num_vis": 3072}, f, protocol=2)
    return root


# ---------------------------------------------------------------- running scripts
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                  "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def _show_our_deprecations() -> str:
    """A PYTHONWARNINGS value that shows (Pending)DeprecationWarnings raised on behalf of
    the project's own modules, which Python's default filters hide outside __main__
    (FutureWarning and UserWarning are shown by default anyway)."""
    modules = ["__main__", "alexnet"] + sorted(
        ".".join(p.relative_to(AMP_DIR).with_suffix("").parts).removesuffix(".__init__")
        for p in (AMP_DIR / "ampkit").rglob("*.py"))
    return ",".join(f"default::{cat}:{m}" for m in modules
                    for cat in ("DeprecationWarning", "PendingDeprecationWarning"))


class ScriptResult(tuple):
    """``(returncode, stdout, stderr)`` (cleaned of tqdm redraws), plus the raw text."""

    def __new__(cls, returncode: int, raw_stdout: str, raw_stderr: str, cmd: List[str]):
        self = super().__new__(cls, (returncode, clean_output(raw_stdout),
                                     clean_output(raw_stderr)))
        self.raw_stdout, self.raw_stderr, self.cmd = raw_stdout, raw_stderr, cmd
        return self

    returncode = property(lambda self: self[0])
    stdout = property(lambda self: self[1])
    stderr = property(lambda self: self[2])

    def describe(self) -> str:
        """For assertion messages: the command, its exit status and its output."""
        return (f"$ {' '.join(self.cmd)}\nexit {self.returncode}\n--- stdout\n{self.stdout}"
                f"\n--- stderr\n{self.stderr}")


_TQDM_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+")


def clean_output(text: str) -> str:
    lines = []
    for line in text.split("\n"):
        shown = line.split("\r")[-1].rstrip()
        if shown.strip() and not _TQDM_BAR.search(shown):
            lines.append(shown)
    return "\n".join(lines)


# Process groups of the scripts running now: a SIGTERM to pytest (a CI or `timeout` limit)
# kills them too. Each runs in its own session (so a timeout can kill its whole tree), which
# also takes it out of the group that `timeout` signals.
_LIVE_GROUPS: set = set()


def _kill_scripts_then_die(signum, frame):
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def pytest_configure(config):
    signal.signal(signal.SIGTERM, _kill_scripts_then_die)


PYTHON = sys.executable


def kill_job(pid: int, sig: int) -> None:
    """``sig`` to the job started as ``pid`` in a session of its own: its whole process
    group (torchrun and its workers, say); to ``pid`` alone if it leads no group."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def run_script(name: str, *args, torchrun_nproc: Optional[int] = None,
               env: Optional[Dict[str, str]] = None,
               timeout: float = DEFAULT_TIMEOUT) -> ScriptResult:
    script = f"AMP/{name if name.endswith('.py') else name + '.py'}"
    assert (REPO_ROOT / script).is_file(), f"no such script: {script}"
    argv = [str(a) for a in args]
    if torchrun_nproc is None:
        cmd = [PYTHON, script, *argv]
    else:
        cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={torchrun_nproc}", script, *argv]
    full_env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    full_env.setdefault("PYTHONWARNINGS", _show_our_deprecations())
    if torchrun_nproc is not None:
        # What torchrun would set anyway (and warn about): one thread per process.
        full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _LIVE_GROUPS.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n"
                    f"{clean_output(out)}\n--- stderr\n{clean_output(err)}")
    finally:
        _LIVE_GROUPS.discard(proc.pid)
    return ScriptResult(proc.returncode, out, err, cmd)


def run_main(name: str, *args, env: Optional[Dict[str, str]] = None) -> ScriptResult:
    """``AMP/<name>.py``'s ``main(argv)`` in this process (see the module docstring): its exit
    status, stdout, and stderr followed by the warnings it raised, as an interpreter prints
    them. torchrun's variables are taken out of the environment for the call (a DDP script
    then makes a group of one, as under plain ``python``) and everything is put back."""
    import importlib
    import io
    import warnings

    module = importlib.import_module(name.removesuffix(".py"))
    argv = [str(a) for a in args]
    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    for key in _TORCHRUN_VARS:
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


_ACC_RE = re.compile(r"(\d+)/(\d+) = (\d+(?:\.\d+)?)\s*$", re.M)


def parse_accuracy(stdout: str) -> Tuple[int, int]:
    """``(correct, total)`` from the one ``correct/total = acc`` line of an eval script."""
    found = _ACC_RE.findall(clean_output(stdout))
    assert len(found) == 1, f"expected one 'correct/total = acc' line, got {found!r} in:\n{stdout}"
    correct, total, acc = found[0]
    correct, total = int(correct), int(total)
    assert abs(float(acc) - correct / total) < 1e-3, f"{correct}/{total} != {acc}"
    return correct, total


OWN_WARNING = "warning: this CPU has no native bfloat16"


def assert_clean_stderr(stderr: str) -> None:
    text = clean_output(stderr)
    assert "Traceback" not in text, text
    for line in text.splitlines():
        assert "Warning" not in line, f"a warning was printed: {line!r}\n{text}"
        if line.lower().startswith("warning:"):
            assert line.startswith(OWN_WARNING), f"unexpected warning: {line!r}"


def assert_no_traceback_of_ours(stdout: str, stderr: str) -> None:
    """Neither stream of a run holds a traceback through the project's code (torchrun's
    own report of a worker's exit status, its ChildFailedError, is torchrun's)."""
    assert "Traceback" not in stdout, stdout[-3000:]
    for tb in stderr.split("Traceback (most recent call last):")[1:]:
        frames = re.findall(r'File "([^"]+)", line \d+', tb)  # "[rank1]:   File ..." too
        assert not [f for f in frames if f.startswith(str(REPO_ROOT))], tb[:3000]


@pytest.fixture
def gloo_of_one():
    """A one-process gloo group in this process: a DDP or FSDP2 script's build() in-process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_args(tmp: Path, dataset_root: Path, *, dataset: str = "ImageFolder",
              epochs: int = 1, batch_size: int = 16, lr: Optional[float] = None,
              tensorboard: bool = False, cuda: bool = False) -> List[str]:
    args = ["--dataset", dataset, "--dataset_root", dataset_root, "--img_size", "64",
            "--epochs", str(epochs), "--batch_size", str(batch_size),
            "--cuda" if cuda else "--no-cuda",
            "--checkpoint", tmp / "checkpoint", "--tensorboard_log", tmp / "tensorboard",
            "--tensorboard" if tensorboard else "--no-tensorboard"]
    if lr is not None:
        args += ["--lr", str(lr)]
    return [str(a) for a in args]


def event_files(folder: Path) -> List[Path]:
    folder = Path(folder)
    return sorted(folder.rglob("events.out.tfevents*")) if folder.exists() else []


def as_a_dataparallel_replica(replica, images, run_dtype, device_type="cpu"):
    """Call ``replica(images)`` as ``nn.DataParallel`` does (torch.nn.parallel.parallel_apply's
    worker): in a thread of its own, which re-enters autocast with the caller's *enabled*
    flag but its own default dtype, while the caller runs under ``run_dtype``. Returns
    (the thread's default autocast dtype -- the control --, the replica's output). Without
    CUDA, DataParallel has no threads and parallel_apply cannot run: this is how a test on
    the CPU sees it (the CUDA test calls parallel_apply itself)."""
    import threading

    import torch
    from torch import nn

    found = {}

    def worker():
        with torch.no_grad(), torch.amp.autocast(device_type, enabled=True):
            found["default"] = nn.Conv2d(3, 2, 3).to(images.device)(images).dtype
            found["out"] = replica(images)

    with torch.autocast(device_type, dtype=run_dtype):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    return found["default"], found["out"]
