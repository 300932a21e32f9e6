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

Running a script: ``run_main`` (in this process, tests/helpers/in_process.py) and
``run_script`` (a real interpreter; tests/helpers/processes.py has the rest), re-exported
here with ``ScriptResult``.
``parse_accuracy(stdout)`` -> ``(correct, total)`` from the eval scripts' ``correct/total = acc``.
``assert_no_traceback_of_ours(stdout, stderr)``: no traceback through the project's code in
    either stream (torchrun's own report of its workers' exit is allowed).
``assert_clean_stderr(stderr)``: no traceback, no ``*Warning`` (DeprecationWarning,
    FutureWarning, UserWarning, ...), no ``warning:`` line other than ampkit's own
    "warning: this CPU has no native bfloat16" notice.
``quick_flags(dataset_root, checkpoint, *extra, **flags)``: the flags of a quick run, the
    one builder of them (each test file names its own preset of it);
    ``tiny_args(tmp, dataset_root, ...)``: a script's own quick AlexNet run, under ``tmp``.
``event_files(folder)``: TensorBoard event files under a folder (recursively).
"""
from __future__ import annotations

import pickle
import re
import signal
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest

from helpers.in_process import run_main  # noqa: F401  (re-exported for the test files)
from helpers.processes import (AMP_DIR, REPO_ROOT, ScriptResult, clean_output,  # noqa: F401
                               kill_live_jobs_then_die, run_script)

if str(AMP_DIR) not in sys.path:
    sys.path.insert(0, str(AMP_DIR))


def pytest_configure(config):
    signal.signal(signal.SIGTERM, kill_live_jobs_then_die)


def pytest_sessionfinish(session, exitstatus):
    """``FUZZ_TALLY=PATH``: what the fuzz tests' examples did, written there (checks/fuzz.sh)."""
    import os

    if os.environ.get("FUZZ_TALLY") and "helpers.fuzz" in sys.modules:
        sys.modules["helpers.fuzz"].write_tally(Path(os.environ["FUZZ_TALLY"]))

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


def quick_flags(dataset_root: Path, checkpoint: Path, *extra, dataset: str = "ImageFolder",
                img_size: int = 64, arch: Optional[str] = FAST_ARCH, cuda: Optional[bool] = False,
                tensorboard: bool = False, **flags) -> List[str]:
    """The flags of a quick run, the one builder of them: ``dataset_root``'s data at
    ``img_size`` px, ``checkpoint`` as --checkpoint, TensorBoard off unless ``tensorboard``,
    ``arch`` (None: the script's AlexNet), --device cpu (``cuda=True``: --device cuda; None:
    neither, the script's choice); then each of ``flags`` as ``--name value`` (None: left out), then
    ``extra`` as given."""
    args = ["--dataset", dataset, "--dataset_root", dataset_root, "--img_size", img_size,
            "--checkpoint", checkpoint, "--tensorboard" if tensorboard else "--no-tensorboard"]
    if arch is not None:
        args += ["--arch", arch]
    if cuda is not None:
        args += ["--device", "cuda" if cuda else "cpu"]
    for name, value in flags.items():
        if value is not None:
            args += [f"--{name}", value]
    return [str(a) for a in [*args, *extra]]


def tiny_args(tmp: Path, dataset_root: Path, *, dataset: str = "ImageFolder",
              epochs: int = 1, batch_size: int = 16, lr: Optional[float] = None,
              tensorboard: bool = False, cuda: bool = False) -> List[str]:
    """A script's own quick run (AlexNet's), its outputs under ``tmp``: checkpoint/ and
    tensorboard/."""
    return quick_flags(dataset_root, tmp / "checkpoint", dataset=dataset, arch=None, cuda=cuda,
                       tensorboard=tensorboard, epochs=epochs, batch_size=batch_size, lr=lr,
                       tensorboard_log=tmp / "tensorboard")


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
