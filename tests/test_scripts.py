"""End to end: the 16 AMP scripts (13 train, 3 eval) as a user runs them, on tiny data.

Each training variant runs once (lazily, cached for the module) and its outputs are
shared by the tests below: the smoke test of each script, learning, TensorBoard on or
off, checkpoint contents, and the eval scripts, which evaluate those checkpoints.
A one-process script runs in this process, through its ``main(argv)``; train_DDP_GradScaler
runs under ``torchrun --nproc_per_node=2`` (gloo on the CPU), the other DDP and FSDP2
scripts as a group of one, as ``python AMP/train_DDP.py`` starts it, in this process too
(test_world_size.py and test_arch_fsdp.py run them at 2, 3 and 4 processes).

Plan of the training runs (48 train / 21 val ImageFolder images, 64 px, CPU; AlexNet in
fp32, the autocast variants on conftest.FAST_ARCH, FSDP2's on conftest.FSDP_ARCH):
- train_without: 3 epochs (also the learning test);
- train_GradScaler: on the generated CIFAR-10 files (the CIFAR-10 code path);
- train_FSDP_mixed: AlexNet in bf16 on 6 train / 3 val images (conftest.mini_imagefolder_root);
- train_DDP_GradScaler: with --tensorboard (rank 0 only must write);
- all others: 1 epoch, --no-tensorboard.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from conftest import (CIFAR_TEST_SIZE, CIFAR_TRAIN_SIZE, FAST_ARCH, FSDP_ARCH, IF_TRAIN_SIZE,
                      IF_VAL_SIZE, MINI_TRAIN_PER_CLASS, MINI_VAL_PER_CLASS, ScriptResult,
                      assert_clean_stderr, event_files, parse_accuracy, run_main, run_script,
                      tiny_args)

pytestmark = pytest.mark.slow

TRAIN_SCRIPTS = ["train_without", "train_autocast", "train_GradScaler",
                 "train_DP", "train_DP_autocast", "train_DP_GradScaler",
                 "train_DDP", "train_DDP_autocast", "train_DDP_GradScaler",
                 "train_FSDP", "train_FSDP_autocast", "train_FSDP_GradScaler", "train_FSDP_mixed"]

# Per variant: epochs, batch size, data set, processes, TensorBoard.
# AlexNet in fp32; the autocast variants on FAST_ARCH (conftest.py: AlexNet's bf16 steps are
# ~40x slower than its fp32 ones on a CPU without native bfloat16); FSDP2_mixed on AlexNet
# (no BatchNorm, which bf16 parameters refuse, and no block returning a view, which FSDP2
# warns about), over the least data that trains a step on each rank.
PLAN: Dict[str, dict] = {
    "train_without": dict(epochs=3, batch_size=16),       # 3 steps an epoch
    "train_autocast": dict(batch_size=48, arch=FAST_ARCH),  # 1 step, 1 val batch
    "train_GradScaler": dict(batch_size=16, dataset="CIFAR10", arch=FAST_ARCH),
    "train_DP": dict(batch_size=48),
    "train_DP_autocast": dict(batch_size=48, arch=FAST_ARCH),
    "train_DP_GradScaler": dict(batch_size=48, arch=FAST_ARCH),
    "train_DDP": dict(batch_size=48),                     # a group of one
    "train_DDP_autocast": dict(batch_size=48, arch=FAST_ARCH),
    "train_DDP_GradScaler": dict(batch_size=12, nproc=2, tensorboard=True,  # 2 steps per rank
                                 arch=FAST_ARCH),
    "train_FSDP": dict(batch_size=48, arch=FSDP_ARCH),
    "train_FSDP_autocast": dict(batch_size=48, arch=FSDP_ARCH),
    "train_FSDP_GradScaler": dict(batch_size=48, arch=FSDP_ARCH),
    "train_FSDP_mixed": dict(batch_size=6, dataset="mini"),  # a group of one
}
TB_VARIANT = "train_DDP_GradScaler"

# The data sets of PLAN: the --dataset flag, train and val images, classes.
DATA = {"ImageFolder": ("ImageFolder", IF_TRAIN_SIZE, IF_VAL_SIZE, 3),
        "CIFAR10": ("CIFAR10", CIFAR_TRAIN_SIZE, CIFAR_TEST_SIZE, 10),
        "mini": ("ImageFolder", 3 * MINI_TRAIN_PER_CLASS, 3 * MINI_VAL_PER_CLASS, 3)}

HEADER = re.compile(r"^(?P<variant>train_\w+): (?P<dataset>\w+) \((?P<train>\d+) train / "
                    r"(?P<val>\d+) val images, (?P<classes>\d+) classes\) at (?P<px>\d+)px on "
                    r"(?P<device>\S+)(?P<rest>.*)$", re.M)
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)\s+train_loss (\S+)\s+val_acc (\S+) \((\d+)/(\d+)\)",
                        re.M)


@dataclass
class TrainRun:
    variant: str
    result: ScriptResult
    run_dir: Path        # <checkpoint>/<variant>
    tb_root: Path        # what --tensorboard_log pointed at
    epochs: int
    data: str            # a key of DATA
    nproc: Optional[int]
    arch: str = "alexnet"

    dataset = property(lambda self: DATA[self.data][0])    # the --dataset flag
    n_train = property(lambda self: DATA[self.data][1])
    n_val = property(lambda self: DATA[self.data][2])
    n_classes = property(lambda self: DATA[self.data][3])

    def ok(self) -> "TrainRun":
        assert self.result.returncode == 0, self.result.describe()
        return self

    def epoch_lines(self) -> List[tuple]:
        return EPOCH_LINE.findall(self.result.stdout)

    def log_rows(self) -> List[dict]:
        return [json.loads(line) for line in
                (self.run_dir / "log.jsonl").read_text().splitlines() if line.strip()]


class Runs:
    """Lazily runs each training variant once; every test asking for it shares the run."""

    def __init__(self, root: Path, data_roots: Dict[str, Path]) -> None:
        self.root, self.data_roots = root, data_roots
        self.imagefolder_root = data_roots["ImageFolder"]
        self._train: Dict[str, TrainRun] = {}
        self._eval: Dict[tuple, ScriptResult] = {}

    def train(self, variant: str) -> TrainRun:
        if variant not in self._train:
            plan = dict(PLAN[variant])
            nproc = plan.pop("nproc", None)
            data = plan.pop("dataset", "ImageFolder")
            arch = plan.pop("arch", "alexnet")
            epochs = plan.setdefault("epochs", 1)
            args = tiny_args(self.root, self.data_roots[data], dataset=DATA[data][0], lr=1e-4,
                             **plan)
            result = (run_main(variant, *args, "--arch", arch) if nproc is None else
                      run_script(variant, *args, "--arch", arch, torchrun_nproc=nproc))
            self._train[variant] = TrainRun(variant, result, self.root / "checkpoint" / variant,
                                            self.root / "tensorboard", epochs, data, nproc,
                                            arch)
        return self._train[variant]

    def eval(self, script: str, checkpoint: Path, *args: str,
             nproc: Optional[int] = None) -> ScriptResult:
        key = (script, str(checkpoint), args, nproc)
        if key not in self._eval:
            flags = ("--checkpoint", checkpoint, "--no-cuda", *args)
            self._eval[key] = (run_main(script, *flags) if nproc is None else
                               run_script(script, *flags, torchrun_nproc=nproc))
        return self._eval[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, imagefolder_root, cifar_root, mini_imagefolder_root):
    root = tmp_path_factory.mktemp("runs")
    yield Runs(root, {"ImageFolder": imagefolder_root, "CIFAR10": cifar_root,
                      "mini": mini_imagefolder_root})
    shutil.rmtree(root, ignore_errors=True)  # each run leaves ~1.4 GB of checkpoints


def _model_keys(arch: str, num_classes: int) -> set:
    from ampkit.models import build_model
    with torch.device("meta"):
        return set(build_model(arch, num_classes).state_dict().keys())


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


# ------------------------------------------------------------------ training scripts

@pytest.mark.parametrize("variant", TRAIN_SCRIPTS)
def test_train_script_runs_end_to_end(variant, runs):
    run = runs.train(variant).ok()
    out = run.result.stdout
    assert_clean_stderr(run.result.stderr)

    # Exactly one header and one summary: under torchrun only rank 0 prints.
    headers = [m.groupdict() for m in HEADER.finditer(out)]
    assert len(headers) == 1, out
    h = headers[0]
    assert h["variant"] == variant
    assert (h["dataset"], int(h["train"]), int(h["val"]), int(h["classes"]), h["px"]) == \
        (run.dataset, run.n_train, run.n_val, run.n_classes, "64"), out
    assert h["device"].rstrip(",") == "cpu", "--device cpu must run on the CPU"
    if run.nproc:  # torchrun --nproc_per_node=2 ... --device cpu: the CPU's backend
        assert f"x{run.nproc} processes over gloo" in h["rest"], out
    # The precision the run's objects compute in, bfloat16 by default on the CPU.
    precision = ("autocast (bfloat16) + GradScaler" if variant.endswith("GradScaler") else
                 "autocast (bfloat16)" if variant.endswith("autocast") else
                 "MixedPrecisionPolicy (bfloat16)" if variant.endswith("mixed") else "fp32")
    assert f"precision {precision}," in h["rest"], out
    assert len(re.findall(r"^done: ", out, re.M)) == 1, out

    # One summary line per epoch, with the whole (unpadded) val set counted.
    lines = run.epoch_lines()
    assert [(int(e), int(n)) for e, n, *_ in lines] == \
        [(e, run.epochs) for e in range(1, run.epochs + 1)], out
    assert all(int(total) == run.n_val for *_, total in lines), out

    # Checkpoint folder: last.pth, best.pth, log.jsonl and nothing half-written.
    names = sorted(p.name for p in run.run_dir.iterdir())
    assert names == [".lock", "best.pth", "last.pth", "log.jsonl"], names
    rows = run.log_rows()
    assert [r["epoch"] for r in rows] == list(range(1, run.epochs + 1))
    for row, (_, _, loss, acc, correct, total) in zip(rows, lines):
        assert row["train_loss"] == pytest.approx(float(loss), abs=1e-4)
        assert row["val_acc"] == pytest.approx(int(correct) / int(total))
        assert (row.get("grad_scale") is not None) == variant.endswith("GradScaler"), row


@pytest.mark.parametrize("variant", TRAIN_SCRIPTS)
def test_checkpoint_is_prefix_free_and_complete(variant, runs):
    run = runs.train(variant).ok()
    keys = _model_keys(run.arch, run.n_classes)
    for name in ("last.pth", "best.pth"):
        ckpt = _load(run.run_dir / name)
        assert set(ckpt["model"]) == keys, f"{name}: {sorted(ckpt['model'])[:3]}"
        assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])
        assert all(v.dtype == torch.float32 for v in ckpt["model"].values()
                   if v.is_floating_point())
        assert ckpt["variant"] == variant and ckpt["arch"] == run.arch
        assert ckpt["args"]["dataset"] == run.dataset
    last = _load(run.run_dir / "last.pth")
    # last.pth is the full training state; best.pth the checkpoint of the best epoch (with
    # --save_every 1, that epoch's last.pth itself: its full state too).
    assert (last.get("scaler") is not None) == variant.endswith("GradScaler")
    assert {"optimizer", "scheduler", "rng", "progress"} <= set(last)
    assert last["progress"]["epoch"] == run.epochs
    rows = run.log_rows()
    best_row = max(reversed(rows), key=lambda r: r["val_acc"])  # the first of equal bests
    best = _load(run.run_dir / "best.pth")
    assert best["progress"]["val_acc"] == pytest.approx(best_row["val_acc"])
    assert best["progress"]["epoch"] == best_row["epoch"]
    assert {"optimizer", "scheduler"} <= set(best)


def test_learning_happens(runs):
    """3 epochs of fp32 on the colour-coded set: well above chance (1/3)."""
    run = runs.train("train_without").ok()
    rows = run.log_rows()
    assert len(rows) == 3
    assert max(r["val_acc"] for r in rows) >= 0.75, rows
    assert rows[-1]["train_loss"] < rows[0]["train_loss"], rows


@pytest.mark.parametrize("variant", [v for v in TRAIN_SCRIPTS if v != TB_VARIANT])
def test_no_tensorboard_writes_no_events(variant, runs):
    run = runs.train(variant).ok()
    assert event_files(run.tb_root / variant) == []
    assert not (run.tb_root / variant).exists()


def test_tensorboard_on_rank0_only(runs):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    run = runs.train(TB_VARIANT).ok()
    assert run.nproc == 2
    run_dirs = list((run.tb_root / TB_VARIANT).iterdir())
    assert len(run_dirs) == 1, run_dirs  # one <time>/ folder, not one per rank
    files = event_files(run.tb_root / TB_VARIANT)
    assert len(files) == 1 and files[0].parent == run_dirs[0], files
    tags = {v.tag for ev in EventFileLoader(str(files[0])).Load() for v in ev.summary.value}
    assert {"train/loss", "train/lr", "val/accuracy", "time/epoch_seconds",
            "throughput/images_per_second", "amp/grad_scale"} <= tags, tags
    assert event_files(run.run_dir) == []


def test_train_ddp_under_plain_python(runs, imagefolder_root, tmp_path):
    """`python AMP/train_DDP.py`: a process group of one, no torchrun (a ResNet-18: the
    group is what is tested here)."""
    result = run_script("train_DDP", *tiny_args(tmp_path, imagefolder_root, batch_size=48),
                        "--arch", "resnet18")
    assert result.returncode == 0, result.describe()
    assert_clean_stderr(result.stderr)
    assert "on cpu x1 processes over gloo" in result.stdout, result.stdout
    assert (tmp_path / "checkpoint" / "train_DDP" / "last.pth").is_file()
    shutil.rmtree(tmp_path / "checkpoint")


# ------------------------------------------------------------------ eval scripts

def _eval_ok(result: ScriptResult, checkpoint: Path, n_val: int) -> tuple:
    assert result.returncode == 0, result.describe()
    assert_clean_stderr(result.stderr)
    assert f"checkpoint: {checkpoint}" in result.stdout, result.stdout
    correct, total = parse_accuracy(result.stdout)
    assert total == n_val, result.stdout
    return correct, total


def _dp_reference(runs) -> tuple:
    """eval_without on train_DP's last.pth (a DataParallel checkpoint)."""
    run = runs.train("train_DP").ok()
    ckpt = run.run_dir / "last.pth"
    return _eval_ok(runs.eval("eval_without", ckpt), ckpt, run.n_val)


def test_eval_without_loads_a_dp_checkpoint(runs):
    run = runs.train("train_DP").ok()
    correct, total = _dp_reference(runs)
    # Same weights, fp32, same data: the count train_DP printed for its (last) epoch.
    *_, train_correct, train_total = run.epoch_lines()[-1]
    assert (correct, total) == (int(train_correct), int(train_total))


def test_eval_dp_loads_a_single_device_checkpoint_cifar10(runs):
    """eval_DP on train_GradScaler's best.pth, which was trained on the CIFAR-10 files;
    data set, root and image size come from the checkpoint; --autocast evaluates in bf16."""
    run = runs.train("train_GradScaler").ok()
    ckpt = run.run_dir / "best.pth"
    result = runs.eval("eval_DP", ckpt, "--autocast")
    correct, total = _eval_ok(result, ckpt, CIFAR_TEST_SIZE)
    assert "CIFAR10" in result.stdout and "autocast bfloat16" in result.stdout, result.stdout
    # Training validated the same 11 images in one bf16 batch: the same count.
    *_, train_correct, _ = run.epoch_lines()[-1]
    assert correct == int(train_correct)


def test_eval_ddp_two_ranks_matches_eval_without(runs):
    """21 val images on 2 ranks: DistributedSampler-style padding must not be counted."""
    run = runs.train("train_DP").ok()
    ckpt = run.run_dir / "last.pth"
    reference = _dp_reference(runs)
    result = runs.eval("eval_DDP", ckpt, nproc=2)
    assert _eval_ok(result, ckpt, IF_VAL_SIZE) == reference
    assert "2 processes" in result.stdout, result.stdout


def test_eval_ddp_plain_python_picks_newest_checkpoint_in_folder(runs):
    """`python AMP/eval_DDP.py --checkpoint FOLDER`: one process; the newest .pth is used
    (last.pth: best.pth is written before it)."""
    run = runs.train("train_DP").ok()
    result = runs.eval("eval_DDP", run.run_dir)
    assert _eval_ok(result, run.run_dir / "last.pth", IF_VAL_SIZE) == _dp_reference(runs)


def test_old_checkpoint_with_module_prefix_still_evaluates(runs, tmp_path):
    """A file as the article saved it: torch.save(DataParallel(model).state_dict())."""
    run = runs.train("train_DP").ok()
    state = torch.load(run.run_dir / "last.pth", map_location="cpu", weights_only=True)["model"]
    old = tmp_path / "article_dp.pth"
    torch.save({f"module.{k}": v for k, v in state.items()}, old)
    del state
    result = run_main("eval_without", "--checkpoint", old, "--no-cuda", "--dataset",
                      "ImageFolder", "--dataset_root", runs.imagefolder_root, "--img_size", "64")
    assert _eval_ok(result, old, IF_VAL_SIZE) == _dp_reference(runs)


# ------------------------------------------------------------------ errors

def _single_line_error(result: ScriptResult) -> str:
    assert result.returncode != 0, result.describe()
    assert "Traceback" not in result.raw_stderr, result.raw_stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


_NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
               "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
               "no_proxy": "", "NO_PROXY": ""}


def test_cifar10_missing_without_network_is_one_line(tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    result = run_main("train_without", *tiny_args(tmp_path, empty, dataset="CIFAR10"),
                      env=_NO_NETWORK)
    line = _single_line_error(result)
    assert "cifar-10-python.tar.gz" in line and str(empty) in line, line
    assert not list((tmp_path / "checkpoint").rglob("*.pth"))


def test_failed_start_keeps_the_previous_runs_log(tmp_path, imagefolder_root, capsys):
    """A run that cannot start (here: a mistyped data root) must not wipe the log of the
    run already in that checkpoint folder, whose last.pth/best.pth it leaves alone."""
    import train_without

    run_dir = tmp_path / "checkpoint" / "train_without"
    run_dir.mkdir(parents=True)
    previous = '{"epoch": 1, "train_loss": 1.0, "val_acc": 0.5}\n'
    (run_dir / "log.jsonl").write_text(previous)
    with pytest.raises(SystemExit) as exit_info:
        train_without.main(tiny_args(tmp_path, imagefolder_root / "no_such_folder"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "no_such_folder" in err, err
    assert (run_dir / "log.jsonl").read_text() == previous
