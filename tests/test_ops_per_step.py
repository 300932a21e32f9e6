"""A training step costs what its technique costs: the ops each train script dispatches between
two optimizer steps -- its own run, ``main()`` in this process, its step, loop, input path
and stop vote -- are within 1.05x of the floor of its technique (checks/ops_per_step.py: the same
loop with nothing but the technique), and a step syncs nothing with the host. The counts
are deterministic (a small network at 32 px, the CIFAR-10 files path, torch as pinned in
constraints.txt); checks/ops_per_step.py prints them for all 13 scripts, with host times."""
from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from conftest import REPO_ROOT, run_main

sys.path.insert(0, str(REPO_ROOT / "checks"))
import ops_per_step  # noqa: E402

# The quick tier's: the one-device GradScaler loop. The slow one adds autocast alone, DDP's
# (its own all-reduce: a Python hook would cost ops) and FSDP2's loops, with a scaler and
# with the mixed policy; the DataParallel scripts' steps on the CPU are the one-device ones
# (no DataParallel is built there), and checks/ops_per_step.py counts all 13.
QUICK = ("train_GradScaler",)
SLOW = ("train_autocast", "train_DDP", "train_FSDP_GradScaler", "train_FSDP_mixed")


def network(script: str) -> tuple:
    """The smallest step that shows every op of a loop: 2 images of a small network (bf16 is
    emulated on a CPU without AVX512-BF16: AlexNet's step there takes 1.5 s, this 0.1 s);
    AlexNet under FSDP2, which warns of ShuffleNet's blocks returning views, and whose mixed
    policy refuses BatchNorm."""
    return ("alexnet", 64) if script.startswith("train_FSDP") else ("shufflenet_v2_x0_5", 32)


@pytest.mark.parametrize("script", [*QUICK, *(pytest.param(s, marks=pytest.mark.slow)
                                              for s in SLOW)])
def test_a_step_costs_what_its_technique_costs(script, cifar_root, tmp_path):
    # The run's checkpoint (AlexNet's: 0.7 GB) in memory where the machine has a tmpfs.
    shm = Path("/dev/shm")
    folder = tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else tmp_path)
    arch, size = network(script)
    flags = ["--dataset", "CIFAR10", "--dataset_root", cifar_root, "--arch", arch,
             "--img_size", size, "--batch_size", 2, "--train_subset", 10, "--epochs", 1,
             "--device", "cpu",
             "--no-tensorboard", "--checkpoint", folder.name]

    def run():
        res = run_main(script, *flags)
        assert res.returncode == 0, res.describe()

    with folder:
        mine = ops_per_step.measure(run, count=True)
    floor = ops_per_step.measure(ops_per_step.run_floor(script, arch, size, 2, max_steps=5),
                                 count=True)
    extra = Counter(mine["typical"]) - Counter(floor["typical"])
    assert mine["median"] <= ops_per_step.BOUND * floor["median"], (
        f"{script}: {mine['median']} ops a step, its floor {floor['median']}; more: "
        f"{dict(extra.most_common())}")
    # .item() or a truth value of a device tensor: the host would wait for the GPU each step.
    assert "aten::_local_scalar_dense" not in mine["typical"], dict(extra)
