"""Resume, atomic and safe checkpoints, signals, elastic restarts, multi-node, clear errors."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT as REPO, quick_flags, run_main, run_script
from helpers.processes import PYTHON, finish, kill_job, run, start, torchrun, wait_for

HELPER = REPO / "tests" / "helpers" / "faulty_train.py"


# A quick run. These tests are about resuming, signals and restarts, not the network:
# conftest.FAST_ARCH (0.34M parameters, 2 MB checkpoints) runs them in a fraction of AlexNet's
# time (57M parameters, 684 MB); AlexNet's own runs are in test_scripts.py. The device: the
# script's choice (a GPU where there is one).
_tiny = partial(quick_flags, cuda=None, batch_size=8, lr="1e-3")


def _epochs_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run_dir / "log.jsonl").read_text().splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_faulty(*args: str, env: dict) -> tuple[int, str, str]:
    """Run tests/helpers/faulty_train.py (a train variant with an injected fault)."""
    return run([PYTHON, HELPER, *args], env, timeout=300)


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


# --- SIGKILL and resume -------------------------------------------------------------------

@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_completes(imagefolder_root, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_dir = ckpt / "train_without"
    cmd = [PYTHON, str(REPO / "AMP" / "train_without.py"),
           *_tiny(imagefolder_root, ckpt, "--epochs", "4")]
    proc = start(cmd)
    # Kill as soon as a checkpoint is on disk: after epoch 1, seconds before epoch 4 ends.
    wait_for(lambda: (run_dir / "last.pth").exists(), 120, proc)
    kill_job(proc.pid, signal.SIGKILL)
    assert finish(proc, 60).returncode == -signal.SIGKILL
    done = _load(run_dir / "last.pth")["progress"]["epoch"]
    assert 1 <= done < 4

    rc, out, err = run_main("train_without", *_tiny(imagefolder_root, ckpt, "--epochs", "4",
                                                       "--resume"))
    assert rc == 0, err
    assert f"resumed from {run_dir / 'last.pth'}: epoch {done + 1}" in out
    final = _load(run_dir / "last.pth")
    assert final["progress"]["epoch"] == 4 and final["progress"]["step"] == 0
    # Every epoch logged once: at most the epoch in progress was lost, nothing was repeated.
    assert _epochs_logged(run_dir) == list(range(1, 5))
    assert not list(run_dir.glob(".*.tmp"))


@pytest.mark.slow
def test_sigkill_during_save_keeps_previous_checkpoint(imagefolder_root, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_dir = ckpt / "train_GradScaler"
    # Writes: epoch 1 -> last.pth (1; best.pth names it); epoch 2 -> last.pth (2): killed.
    env = {"FAULT_KILL_IN_SAVE": "2"}
    rc, out, err = _run_faulty("train_GradScaler",
                               *_tiny(imagefolder_root, ckpt, "--epochs", "2"), env=env)
    assert rc == -signal.SIGKILL
    assert "killed in save 2 on thread checkpoint" in err, err  # the background writer
    assert list(run_dir.glob(".*.tmp")), "the killed save should have left its temp file"
    before = _load(run_dir / "last.pth")       # the previous checkpoint is intact
    assert before["progress"]["epoch"] == 1
    _load(run_dir / "best.pth")

    rc, out, err = run_main("train_GradScaler", *_tiny(imagefolder_root, ckpt, "--epochs", "2",
                                                          "--resume"))
    assert rc == 0, err
    after = _load(run_dir / "last.pth")
    assert after["progress"]["epoch"] == 2
    assert after["scaler"] is not None and after["scaler"]["scale"] > 0
    assert not list(run_dir.glob(".*.tmp")), "stale temp files are cleaned up"


def _best_matches_the_record(run_dir: Path) -> dict:
    last, best = _load(run_dir / "last.pth"), _load(run_dir / "best.pth")
    held, record = best["progress"], last["progress"]
    assert (held["epoch"], held["val_acc"]) == (record["best_epoch"], record["best_acc"])
    return best


@pytest.mark.slow
def test_a_kill_between_last_and_best_is_repaired_by_resume(imagefolder_root, tmp_path):
    """SIGKILL after last.pth (epoch 1, its record: best epoch 1) and before best.pth is
    made its second name: the resume, even one with nothing left to train, makes best.pth
    the epoch last.pth records, and says so."""
    ckpt = tmp_path / "ckpt"
    run_dir = ckpt / "train_without"
    rc, out, err = _run_faulty("train_without", *_tiny(imagefolder_root, ckpt, "--epochs", "1"),
                               env={"FAULT_KILL_BEFORE_LINK": "1"})
    assert rc == -signal.SIGKILL and "killed before link 1" in err, err
    assert (run_dir / "last.pth").is_file() and not (run_dir / "best.pth").exists()
    rc, out, err = run_main("train_without", *_tiny(imagefolder_root, ckpt, "--epochs", "1",
                                                       "--resume"))
    assert rc == 0 and "nothing to do" in out and "restored epoch 1" in out, out + err
    _best_matches_the_record(run_dir)


@pytest.mark.slow
def test_a_kill_in_best_after_save_every_0_is_repaired_by_resume(imagefolder_root, tmp_path):
    """--save_every 0 keeps the best epoch (1, with --lr 0 the only best) in memory; the run's
    last save writes last.pth (epoch 2, carrying epoch 1's weights) and then best.pth, killed
    half-way: the resume writes best.pth from last.pth, epoch 1's weights and record."""
    ckpt = tmp_path / "ckpt"
    run_dir = ckpt / "train_without"
    flags = [*_tiny(imagefolder_root, ckpt, "--epochs", "2", "--save_every", "0", arch=None),
             "--lr", "0"]
    rc, out, err = _run_faulty("train_without", *flags, env={"FAULT_KILL_IN_SAVE": "2"})
    assert rc == -signal.SIGKILL and "killed in save 2" in err, err
    last = _load(run_dir / "last.pth")
    assert (last["progress"]["epoch"], last["progress"]["best_epoch"]) == (2, 1)
    assert not (run_dir / "best.pth").exists()
    rc, out, err = run_main("train_without", *flags, "--resume")
    assert rc == 0 and "restored epoch 1" in out, out + err
    best = _best_matches_the_record(run_dir)
    assert "optimizer" not in best and all(torch.equal(best["model"][k], last["best_model"][k])
                                           for k in last["best_model"])


@pytest.mark.slow
def test_second_ctrl_c_during_a_save_ends_cleanly(imagefolder_root, tmp_path):
    """Ctrl-C stops after the step and saves; a second Ctrl-C while that save waits for a
    write still in flight (a slow disk) ends the process at once: status 130, no C++ abort,
    the previous last.pth intact, no temporary file left, one line saying what was saved."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "saving"
    run_dir = ckpt / "train_without"
    # Writes: epoch 1 -> last.pth (1; best.pth names it); epoch 2 -> last.pth (2), slowly.
    cmd = [PYTHON, str(HELPER), "train_without",
           *_tiny(imagefolder_root, ckpt, "--epochs", "6")]
    proc = start(cmd, {"FAULT_SLOW_SAVE": "2", "FAULT_MARKER": str(marker)})
    wait_for(marker.exists, 120, proc)
    kill_job(proc.pid, signal.SIGINT)  # Ctrl-C: to the terminal's whole foreground group
    time.sleep(1.0)
    kill_job(proc.pid, signal.SIGINT)
    rc, out, err = finish(proc, 60)
    assert rc == 130, err[-2000:]
    assert "terminate called" not in err and "Traceback" not in err, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert "interrupted" in line and "holds epoch 1" in line and "epoch 2" in line, line
    assert _load(run_dir / "last.pth")["progress"]["epoch"] == 1
    assert not list(run_dir.glob(".*.tmp")), "a temporary file was left behind"


@pytest.mark.slow
def test_resume_carries_scheduler_scaler_and_epoch_count(imagefolder_root, tmp_path, capsys):
    import train_GradScaler

    ckpt = tmp_path / "ckpt"
    run_dir = ckpt / "train_GradScaler"
    train_GradScaler.main(_tiny(imagefolder_root, ckpt, "--epochs", "1"))  # in-process: quicker
    state = _load(run_dir / "last.pth")
    # Tamper with the saved states so carrying them over is observable.
    state["optimizer"]["param_groups"][0]["lr"] = 3e-4
    state["scheduler"]["num_bad_epochs"] = 2
    state["scaler"]["scale"] = 1024.0
    # As a non-fused optimizer (another device, an older run) writes it: resuming must keep
    # the fused AdamW the run builds, which the GradScaler relies on.
    assert state["optimizer"]["param_groups"][0]["fused"] is True
    state["optimizer"]["param_groups"][0]["fused"] = None
    torch.save(state, run_dir / "last.pth")
    # Without --lr: the optimizer goes on at its saved learning rate.
    argv = _tiny(imagefolder_root, ckpt, "--epochs", "2", "--resume")
    del argv[argv.index("--lr"):argv.index("--lr") + 2]
    rc, out, err = run_main("train_GradScaler", *argv)
    assert rc == 0, err
    assert "lr 3.00e-04" in out
    assert "scale 1024" in out or "scale 2048" in out
    resumed = _load(run_dir / "last.pth")
    assert resumed["progress"]["epoch"] == 2
    assert resumed["optimizer"]["param_groups"][0]["fused"] is True
    assert _epochs_logged(run_dir) == [1, 2]

    # Resuming a finished run (in-process, fast): says so, trains nothing, rewrites nothing.
    mtime = (run_dir / "last.pth").stat().st_mtime_ns
    train_GradScaler.main(_tiny(imagefolder_root, ckpt, "--epochs", "2", "--resume"))
    out = capsys.readouterr().out
    assert "already trained 2 of --epochs 2; nothing to do" in out, out
    assert "epoch 3" not in out and (run_dir / "last.pth").stat().st_mtime_ns == mtime
    assert _epochs_logged(run_dir) == [1, 2]


def test_loading_a_non_fused_state_keeps_the_fused_optimizer():
    """optimizer.load_state_dict restores the saved group's fused=None; a GradScaler, which
    chose at construction to let the fused optimizer handle inf/NaN, then hits the foreach
    path's assertion. ampkit.distributed.load_optimizer_state keeps what was built."""
    from ampkit.distributed import load_optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    old = torch.optim.AdamW(model.parameters(), lr=1e-3)  # foreach, as on another device
    model(torch.randn(3, 4)).sum().backward()
    old.step()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    load_optimizer_state(opt, old.state_dict())
    assert opt.param_groups[0]["fused"] is True and opt.state_dict()["state"]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.step(opt)  # the foreach path would raise here
    scaler.update()


# --- signals --------------------------------------------------------------------------------

# --- elastic and multi-node -------------------------------------------------------------------

@pytest.mark.slow
def test_torchrun_max_restarts_resumes_and_finishes(imagefolder_root, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_dir = ckpt / "train_DDP_GradScaler"
    marker = tmp_path / "crashed"
    env = {"FAULT_EXIT_AT_STEP": "5", "FAULT_RANK": "1", "FAULT_MARKER": str(marker)}
    # 48 images / (2 ranks x 8) = 3 steps per epoch: step 5 is inside epoch 2.
    cmd = torchrun("--nproc_per_node=2", "--max-restarts=1", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{_free_port()}", str(HELPER), "train_DDP_GradScaler",
                    *_tiny(imagefolder_root, ckpt, "--epochs", "3"))
    res = run(cmd, env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert marker.exists(), "the fault was not injected"
    assert f"resumed from {run_dir / 'last.pth'}: epoch 2" in res.stdout
    assert _load(run_dir / "last.pth")["progress"]["epoch"] == 3
    assert _epochs_logged(run_dir)[-1] == 3


@pytest.mark.slow
def test_two_nodes_on_localhost_train_to_the_end(imagefolder_root, tmp_path):
    ckpt = tmp_path / "ckpt"
    tb = tmp_path / "tb"
    port = _free_port()
    flags = _tiny(imagefolder_root, ckpt, "--epochs", "1")
    flags[flags.index("--no-tensorboard")] = "--tensorboard"
    flags += ["--tensorboard_log", str(tb)]
    node = torchrun("--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twonodes",
                     str(REPO / "AMP" / "train_DDP.py"), *flags)
    ends = [finish(p, 300) for p in [start(node) for _ in range(2)]]
    for rc, _, err in ends:
        assert rc == 0, err[-3000:]
    printed = "\n".join(end.stdout for end in ends)
    assert printed.count("epoch 1/1  train_loss") == 1, "only global rank 0 prints"
    assert "x2 processes" in printed
    assert sorted(p.name for p in (ckpt / "train_DDP").iterdir()) == [".lock", "best.pth",
                                                                      "last.pth", "log.jsonl"]
    assert len(list((tb / "train_DDP").iterdir())) == 1, "one TensorBoard run, from rank 0"

    # Resumed where node 1's --checkpoint is a folder of its own, without the file: one line
    # from rank 0 names rank 1, its host and path; no rank starts afresh or waits.
    other = tmp_path / "node1_ckpt"
    port = _free_port()
    procs = [start(
        torchrun("--nnodes=2", "--nproc_per_node=1", f"--node_rank={node_rank}",
                  "--master_addr=127.0.0.1", f"--master_port={port}",
                  str(REPO / "AMP" / "train_DDP.py"),
                  *_tiny(imagefolder_root, folder, "--epochs", "2", "--resume")))
        for node_rank, folder in ((0, ckpt), (1, other))]
    ends = [finish(p, 120) for p in procs]
    assert [end.returncode for end in ends] == [1, 1], ends
    lines = [ln for ln in ends[0].stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, ends[0].stderr[-3000:]
    assert f"rank 1 on {socket.gethostname()}" in lines[0], lines
    assert str(other / "train_DDP" / "last.pth") in lines[0] and "must be shared" in lines[0]
    assert _load(ckpt / "train_DDP" / "last.pth")["progress"]["epoch"] == 1  # nothing trained on


# --- safe loading -----------------------------------------------------------------------------

class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_pickled_payload_is_refused_and_never_runs(tmp_path, imagefolder_root, capsys):
    import importlib

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    torch.save({"model": {"w": torch.zeros(1)}, "extra": _Payload(marker)}, evil)
    runs = {"eval_without": ["--checkpoint", str(evil), "--dataset", "ImageFolder",
                             "--dataset_root", str(imagefolder_root), "--no-cuda"],
            "train_without": _tiny(imagefolder_root, tmp_path / "c", "--resume", str(evil))}
    for script, args in runs.items():  # in-process: the payload would run in this process
        with pytest.raises(SystemExit) as exit_info:
            importlib.import_module(script).main(args)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1, err
        assert f"{evil}: refused" in err
        assert not marker.exists()


@pytest.fixture(scope="module")
def ckpt_3class(tmp_path_factory) -> Path:
    """A good checkpoint (3-class AlexNet weights), written in-process as training writes it."""
    from alexnet import alexnet
    from ampkit.checkpoint.writer import atomic_save

    path = tmp_path_factory.mktemp("ckpt3") / "last.pth"
    torch.manual_seed(0)
    atomic_save({"model": alexnet(num_classes=3).state_dict(), "epoch": 1}, path)
    return path


CORRUPT = {"truncated": "truncated or corrupt",
           "random bytes": "not a PyTorch checkpoint|truncated or corrupt",
           "a text file": r"not a PyTorch checkpoint \(Unsupported operand 123\)",  # '{'
           "not a checkpoint": "not a checkpoint \\(expected a dict"}


def _corrupt_file(name: str, good: Path, tmp: Path) -> Path:
    path = tmp / f"{name.replace(' ', '_')}.pth"
    if name == "truncated":
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif name == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif name == "a text file":  # e.g. --checkpoint pointing at log.jsonl
        path.write_text('{"epoch": 1, "train_loss": 2.3}\n')
    else:
        torch.save([1, 2, 3], path)
    return path


@pytest.mark.parametrize("name", list(CORRUPT))
def test_corrupt_or_foreign_checkpoint_is_one_line(name, ckpt_3class, tmp_path):
    """In-process (fast): checkpoint_files.load names the file and the cause in one line."""
    import re

    from ampkit.checkpoint import files as checkpoint_files
    from ampkit.errors import UserError

    path = _corrupt_file(name, ckpt_3class, tmp_path)
    with pytest.raises(UserError) as e:
        checkpoint_files.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and re.search(CORRUPT[name], msg), msg
    assert "In PyTorch 2.6" not in msg  # torch's weights_only advice is not the cause


def test_corrupt_checkpoint_as_a_user_sees_it(ckpt_3class, tmp_path, imagefolder_root, cifar_root,
                                              capsys):
    path = _corrupt_file("truncated", ckpt_3class, tmp_path)
    rc, out, err = run_main("eval_without", "--checkpoint", str(path), "--dataset",
                            "ImageFolder", "--dataset_root", str(imagefolder_root))
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(path) in lines[0] and "truncated or corrupt" in lines[0], lines
    # A 3-class checkpoint on the 10-class CIFAR-10 test split (in-process).
    import eval_without
    with pytest.raises(SystemExit) as exit_info:
        eval_without.main(["--checkpoint", str(ckpt_3class), "--dataset", "CIFAR10",
                        "--dataset_root", str(cifar_root), "--img_size", "64", "--no-cuda"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "checkpoint is for 3 classes, but the data set has 10" in err and err.count("\n") == 1


@pytest.mark.slow
def test_eval_with_folder_without_checkpoint(tmp_path, capsys):
    import eval_DDP

    with pytest.raises(SystemExit) as exit_info:
        eval_DDP.main(["--checkpoint", str(tmp_path), "--no-cuda"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "no .pth checkpoint" in err


# --- non-finite loss ------------------------------------------------------------------------

def _nan_model_run(variant: str):
    """The variant's own step on a small network whose output is NaN, over 8 tiny batches."""
    from torch import nn

    from ampkit.distributed import DistInfo
    from helpers.meters import meters_of
    from tools.variants import build_variant

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 3))
    with torch.no_grad():
        model[-1].bias.fill_(float("nan"))
    v = build_variant(variant, model, lr=0.0)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 64, 64, generator=gen), torch.randint(0, 3, (2,), generator=gen))
               for _ in range(8)]
    return v.train_step, batches, DistInfo(device=cpu), meters_of(v)


def test_nonfinite_loss_without_scaler_stops_with_clear_error():
    from ampkit.engine import TrainingDiverged, train_one_epoch

    step, batches, info, meters = _nan_model_run("train_without")
    with pytest.raises(TrainingDiverged, match="inf/NaN for 5 consecutive steps"):
        train_one_epoch(step, batches, info, meters=meters, log_every=5, max_nonfinite=5)


def test_nonfinite_with_scaler_counts_skipped_steps():
    """Where the technique's scaler runs, inf/NaN steps are skipped, not a divergence: the
    check is off without the script saying so again."""
    from ampkit.engine import train_one_epoch

    step, batches, info, meters = _nan_model_run("train_GradScaler")
    stats = train_one_epoch(step, batches, info, log_every=4, meters=meters)
    assert stats.steps == 8 and stats.skipped == 8 and stats.nonfinite == 8


@pytest.mark.slow
def test_diverged_run_exits_without_overwriting_best(imagefolder_root, tmp_path, capsys):
    import train_without

    ckpt = tmp_path / "ckpt"
    run_dir = ckpt / "train_without"
    train_without.main(_tiny(imagefolder_root, ckpt, "--epochs", "1"))
    best = (run_dir / "best.pth").read_bytes()
    capsys.readouterr()
    # An absurd learning rate makes the fp32 loss overflow within a few steps.
    with pytest.raises(SystemExit) as exit_info:
        train_without.main(_tiny(imagefolder_root, ckpt, "--epochs", "2", "--lr", "1e30"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "inf/NaN" in err, err
    assert (run_dir / "best.pth").read_bytes() == best


# --- bad input --------------------------------------------------------------------------------

BAD_INPUTS = {
    "missing data root": (["--dataset_root", "{tmp}/missing"], "does not exist"),
    "empty data root": (["--dataset_root", "{tmp}/empty"], "is empty"),
    "ImageFolder without train/val": (["--dataset_root", "{tmp}/notrain"], "expects"),
    "batch_size 0": (["--batch_size", "0"], "--batch_size must be a positive integer"),
    "batch_size negative": (["--batch_size", "-4"], "--batch_size must be a positive integer"),
    "epochs 0": (["--epochs", "0"], "--epochs must be a positive integer"),
    "epochs negative": (["--epochs", "-1"], "--epochs must be a positive integer"),
    "lr negative": (["--lr", "-0.1"], "--lr must be"),
    "lr nan": (["--lr", "nan"], "--lr must be"),
    "img_size too small": (["--img_size", "32", "--arch", "alexnet"], "at least 63"),
    "unknown dataset": (["--dataset", "MNIST"], "invalid choice"),
    "cuda without CUDA": (["--cuda"], "no CUDA (or ROCm) GPU"),  # not a silent CPU run
    "mps without MPS": (["--device", "mps"], "no Apple MPS device"),
    "xpu without XPU": (["--device", "xpu"], "no Intel XPU"),
    "checkpoint is a file": (["--checkpoint", "{tmp}/afile"], "is a file, but a folder is expected"),
    "unwritable checkpoint": (["--checkpoint", "/proc/ampkit-test"], "cannot write"),
    "unwritable tensorboard": (["--tensorboard", "--tensorboard_log", "/proc/ampkit-test"],
                               "cannot write"),
    "resume with nothing to resume": (["--resume"], "no checkpoint to resume"),
}


def _bad_input_args(name: str, imagefolder_root: Path, tmp_path: Path) -> list[str]:
    (tmp_path / "empty").mkdir(exist_ok=True)
    (tmp_path / "notrain" / "x").mkdir(parents=True, exist_ok=True)
    (tmp_path / "afile").write_text("not a folder")
    args = [a.format(tmp=tmp_path) for a in BAD_INPUTS[name][0]]
    return _tiny(imagefolder_root, tmp_path / "ckpt", "--epochs", "1") + args


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_one_line_error(name, imagefolder_root, tmp_path, capsys):
    """In-process (fast): main() exits 2 with exactly one line on stderr, writes nothing."""
    from ampkit.device import accelerator

    if name.endswith("without " + name.split()[0].upper()) and accelerator() == name.split()[0]:
        pytest.skip(f"this machine has {name.split()[0]}")
    import train_autocast

    with pytest.raises(SystemExit) as exit_info:
        train_autocast.main(_bad_input_args(name, imagefolder_root, tmp_path))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and BAD_INPUTS[name][1] in lines[0], lines
    assert not list((tmp_path / "ckpt").rglob("*.pth"))


@pytest.mark.slow  # a process of its own, as a user runs it
@pytest.mark.parametrize("name", ["ImageFolder without train/val"])
def test_bad_input_as_a_user_sees_it(name, imagefolder_root, tmp_path):
    """The same through a real process: exit 2, one line, no traceback."""
    rc, out, err = run_script("train_autocast", *_bad_input_args(name, imagefolder_root, tmp_path))
    assert rc == 2
    assert "Traceback" not in err
    assert err.count("\n") == 0 and BAD_INPUTS[name][1] in err, err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_gpu_without_bf16_is_an_error(imagefolder_root, tmp_path):
    if torch.cuda.is_bf16_supported():
        pytest.skip("this GPU supports bfloat16")
    rc, out, err = run_script("train_autocast", *_tiny(imagefolder_root, tmp_path, "--epochs", "1",
                                                          "--amp_dtype", "bfloat16"))
    assert rc == 2 and "does not support bfloat16" in err


@pytest.mark.parametrize("script", ["train_without", "train_DP_GradScaler", "eval_DP"])
def test_single_process_script_under_torchrun_is_an_error(script, imagefolder_root, tmp_path,
                                                          capsys, monkeypatch):
    """`torchrun --nproc_per_node=2 AMP/train_without.py`: two copies would train the same
    model and write the same files. Rank 0 says so in one line; every rank exits 2."""
    import importlib

    main = importlib.import_module(script).main
    for rank, lines_expected in ((0, 1), (1, 0)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        with pytest.raises(SystemExit) as exit_info:
            if script.startswith("eval"):
                main(["--checkpoint", str(tmp_path / "ckpt"), "--no-cuda"])
            else:
                main(_tiny(imagefolder_root, tmp_path / "ckpt", "--epochs", "1"))
        assert exit_info.value.code == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == lines_expected, lines
        if lines:
            assert "WORLD_SIZE" in lines[0] and "_DDP" in lines[0], lines
    assert not (tmp_path / "ckpt").exists()
