"""What happens when things go wrong: bad data, full disks, concurrent runs, mismatched
resumes, lost peers, foreign checkpoints. Each ends in one clear line and a non-zero exit
(or, where the user asked for it, a listed skip), never a traceback or a silent wrong result,
and never a lost or half-written checkpoint."""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import signal
import tarfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import FAST_ARCH, IF_TRAIN_SIZE, REPO_ROOT, quick_flags, run_main
from helpers.processes import PYTHON, finish, kill_job, run, start, torchrun, wait_for

# A quick in-process run on conftest.FAST_ARCH (what fails here is not the network).
_args = partial(quick_flags, batch_size=48, epochs=1)


def _main(script: str, argv: list, capsys=None) -> tuple:
    """conftest.run_main's run, its stderr as lines: (exit status, stdout, stderr lines)."""
    code, out, err = run_main(script, *argv)
    return code, out, [ln for ln in err.splitlines() if ln.strip()]


def _one_line(code, err) -> str:
    assert code not in (0, None), err
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def _copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------ 1, 2: bad images
@pytest.mark.parametrize("damage", ["random bytes", "truncated"])
def test_unreadable_image_is_one_line_naming_it(damage, imagefolder_root, tmp_path, capsys):
    root = _copy_tree(imagefolder_root, tmp_path / "data")
    bad = root / "train" / "green" / "003.png"
    if damage == "random bytes":
        bad.write_bytes(np.random.default_rng(0).bytes(bad.stat().st_size))
    else:
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt"), capsys)
    line = _one_line(code, err)
    assert str(bad) in line and "--skip_bad_images" in line, line
    assert not (tmp_path / "ckpt" / "train_without" / "last.pth").exists()


def test_skip_bad_images_trains_and_lists_them(imagefolder_root, tmp_path, capsys):
    root = _copy_tree(imagefolder_root, tmp_path / "data")
    bad = [root / "train" / "red" / "000.png", root / "val" / "blue" / "001.png"]
    for path in bad:
        path.write_bytes(b"not an image")
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt", "--skip_bad_images"),
                           capsys)
    assert code == 0, err
    assert "skipped 2 unreadable image(s) this epoch" in out, out
    assert all(str(path) in out for path in bad), out
    row = json.loads((tmp_path / "ckpt" / "train_without" / "log.jsonl").read_text())
    assert row["skipped_images"] == 2 and row["val_acc"] is not None
    assert f"({IF_TRAIN_SIZE - 1} train" not in out  # the data set's size is what it is


def test_unreadable_image_by_permission_is_one_line(imagefolder_root, tmp_path, capsys,
                                                    monkeypatch):
    """As root, chmod does not stop a read: the denial is simulated where the file is opened."""
    import builtins

    root = _copy_tree(imagefolder_root, tmp_path / "data")
    denied = str(root / "val" / "red" / "002.png")
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if str(file) == denied:
            raise PermissionError(errno.EACCES, "Permission denied", denied)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    code, out, err = _main("eval_without", ["--checkpoint", str(_weights(tmp_path)),
                                            "--dataset", "ImageFolder", "--dataset_root",
                                            str(root), "--no-cuda"], capsys)
    line = _one_line(code, [e for e in err if not e.startswith("warning:")])
    assert denied in line and "Permission denied" in line, line


def test_unreadable_class_folder_is_one_line(imagefolder_root, tmp_path, capsys, monkeypatch):
    root = _copy_tree(imagefolder_root, tmp_path / "data")
    real_scandir = os.scandir

    def guarded(path="."):
        if str(path).endswith(os.path.join("train", "blue")):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", guarded)
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt"), capsys)
    line = _one_line(code, err)
    assert str(root / "train" / "blue") in line and "Permission denied" in line, line


def test_one_class_cannot_train_a_classifier(imagefolder_root, tmp_path, capsys):
    root = tmp_path / "data"
    for split in ("train", "val"):
        shutil.copytree(imagefolder_root / split / "red", root / split / "red")
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt"), capsys)
    assert "at least 2 classes" in _one_line(code, err)


def _weights(tmp_path: Path) -> Path:
    """A 3-class AlexNet checkpoint (weights only) for the eval tests."""
    from alexnet import alexnet

    path = tmp_path / "weights.pth"
    if not path.exists():
        torch.manual_seed(0)
        torch.save({"model": alexnet(num_classes=3).state_dict()}, path)
    return path


# ------------------------------------------------------------------ 3: broken CIFAR-10 files
ARCHIVE = "cifar-10-python.tar.gz"
# No download can start: what a run does with the archive it was given is all there is to see.
NO_NETWORK = {name: "http://127.0.0.1:9" for name in ("http_proxy", "https_proxy",
                                                       "HTTP_PROXY", "HTTPS_PROXY")}


def _cifar(root: Path, archive: bool, *extra: tarfile.TarInfo, broken: bool = True) -> Path:
    """A tiny CIFAR-10 in ``root``; with ``archive``, a cifar-10-python.tar.gz of it beside it
    (``extra`` members last, so an extractor that checks as it goes has written the rest);
    ``broken``: data_batch_1 is cut short."""
    from tools.cifar_files import write_cifar10

    write_cifar10(root, 60, 11, seed=1, learnable=True)
    if archive:
        with tarfile.open(root / ARCHIVE, "w:gz") as tar:
            tar.add(root / "cifar-10-batches-py", arcname="cifar-10-batches-py")
            for member in extra:
                tar.addfile(member, io.BytesIO(b"x" * member.size) if member.isfile() else None)
    batch = root / "cifar-10-batches-py" / "data_batch_1"
    if broken:
        batch.write_bytes(batch.read_bytes()[:1000])
    return root


def _trust_the_archive(root: Path, monkeypatch) -> None:
    """Take the test archive's md5 for CIFAR-10's published one (the real archive is 163 MB)."""
    from ampkit.data import datasets as cifar

    monkeypatch.setattr(cifar, "ARCHIVE_MD5", hashlib.md5((root / ARCHIVE).read_bytes()).hexdigest())


def _files(tmp_path: Path) -> dict:
    """Every path under ``tmp_path`` but the run's checkpoint folder (links not followed), with
    the bytes of the regular files."""
    found = {}
    for folder, dirs, files in os.walk(tmp_path):
        dirs[:] = [d for d in dirs if Path(folder, d) != tmp_path / "ckpt"]
        for name in dirs + files:
            path = Path(folder, name)
            found[path] = path.is_symlink() or (path.is_file() and path.read_bytes())
    return found


def test_broken_cifar_file_is_named(tmp_path, capsys):
    root = _cifar(tmp_path / "cifar", archive=False)
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt", dataset="CIFAR10"),
                           capsys)
    line = _one_line(code, err)
    assert str(root / "cifar-10-batches-py" / "data_batch_1") in line, line
    assert "cifar-10-python.tar.gz" in line and "Delete" in line, line


def test_broken_cifar_file_is_extracted_again_from_the_archive(tmp_path, capsys, monkeypatch):
    root = _cifar(tmp_path / "cifar", archive=True)
    _trust_the_archive(root, monkeypatch)
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt", dataset="CIFAR10"),
                           capsys)
    assert code == 0, err
    assert "data_batch_1 was broken" in out and "extracted it again" in out, out
    assert "(60 train / 11 val images" in out, out


def test_cifar_archive_in_the_root_is_checked_then_extracted(tmp_path, capsys, monkeypatch):
    root = _cifar(tmp_path / "cifar", archive=True, broken=False)
    shutil.rmtree(root / "cifar-10-batches-py")
    _trust_the_archive(root, monkeypatch)
    for name, value in NO_NETWORK.items():
        monkeypatch.setenv(name, value)
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt", dataset="CIFAR10"),
                           capsys)
    assert code == 0, err
    assert "(60 train / 11 val images" in out, out


@pytest.mark.parametrize("files", ["broken", "missing"])
def test_cifar_archive_with_another_md5_is_not_extracted(files, tmp_path, capsys, monkeypatch):
    root = _cifar(tmp_path / "cifar", archive=True)
    if files == "missing":
        shutil.rmtree(root / "cifar-10-batches-py")
    for name, value in NO_NETWORK.items():
        monkeypatch.setenv(name, value)
    before = _files(tmp_path)
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt", dataset="CIFAR10"),
                           capsys)
    line = _one_line(code, err)
    assert str(root / ARCHIVE) in line and "md5" in line, line
    assert _files(tmp_path) == before


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type, member.linkname = kind, link
    member.size = 5 if kind == tarfile.REGTYPE else 0
    return member


UNSAFE = {  # a member, and what the error line says of it
    "..": (lambda tmp: _member("../../escaped_by_tar"), "'..'"),
    "absolute path": (lambda tmp: _member(str(tmp / "escaped_by_tar")), "absolute path"),
    "symlink to /etc": (lambda tmp: _member("cifar-10-batches-py/etc", tarfile.SYMTYPE, "/etc"),
                        "symbolic link"),
    "symlink to ../..": (lambda tmp: _member("cifar-10-batches-py/up", tarfile.SYMTYPE, "../.."),
                         "symbolic link"),
    "hard link outside": (lambda tmp: _member("cifar-10-batches-py/h", tarfile.LNKTYPE,
                                              str(tmp / "outside.txt")), "hard link"),
}


@pytest.mark.parametrize("unsafe", list(UNSAFE))
def test_cifar_archive_member_that_could_write_outside_the_root_is_refused(unsafe, tmp_path,
                                                                           capsys, monkeypatch):
    make, words = UNSAFE[unsafe]
    (tmp_path / "outside.txt").write_text("not CIFAR-10's")
    member = make(tmp_path)
    root = _cifar(tmp_path / "data" / "cifar", True, member)  # ../.. is tmp_path
    _trust_the_archive(root, monkeypatch)
    before = _files(tmp_path)
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt", dataset="CIFAR10"),
                           capsys)
    line = _one_line(code, err)
    assert str(root / ARCHIVE) in line and member.name in line and words in line, line
    assert _files(tmp_path) == before  # nothing extracted, inside the root or out of it


# ------------------------------------------------------------------ 3b: bad CIFAR-10 labels
@pytest.mark.parametrize("label, loader", [(12, "fast"), (12, "classic"), (-1, "fast"),
                                           (1.5, "fast"), ("cat", "classic")])
def test_cifar_label_that_is_not_a_class_is_one_line(label, loader, cifar_root, tmp_path, capsys):
    root = _copy_tree(cifar_root, tmp_path / "cifar")
    path = root / "cifar-10-batches-py" / "data_batch_2"
    with open(path, "rb") as f:
        batch = pickle.load(f)
    batch["labels"][3] = label
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt", "--loader", loader,
                                                  dataset="CIFAR10"), capsys)
    line = _one_line(code, err)
    assert str(path) in line and f"label {label!r}" in line, line


# ------------------------------------------------------------------ 4: a full disk
def _first_run(imagefolder_root, tmp_path, capsys, *extra) -> Path:
    code, out, err = _main("train_without", _args(imagefolder_root, tmp_path / "ckpt", *extra),
                           capsys)
    assert code == 0, err
    return tmp_path / "ckpt" / "train_without"


@pytest.mark.slow
def test_full_disk_is_found_before_writing(imagefolder_root, tmp_path, capsys, monkeypatch):
    run_dir = _first_run(imagefolder_root, tmp_path, capsys)
    before = torch.load(run_dir / "last.pth", weights_only=True, mmap=True)["progress"]["epoch"]
    from ampkit.checkpoint import writer as checkpoint_writer

    usage = shutil.disk_usage(run_dir)
    monkeypatch.setattr(checkpoint_writer.shutil, "disk_usage",
                        lambda p: usage._replace(free=50 * 2**20))  # 50 MB free
    code, out, err = _main("train_without", _args(imagefolder_root, tmp_path / "ckpt", "--resume",
                                                  "--epochs", "2"), capsys)
    line = _one_line(code, err)
    assert "cannot save" in line and "50 MB free" in line and str(run_dir) in line, line
    assert "is unchanged" in line, line
    assert torch.load(run_dir / "last.pth", weights_only=True,
                      mmap=True)["progress"]["epoch"] == before
    assert not list(run_dir.glob(".*.tmp"))


def test_disk_full_during_the_first_write_leaves_no_best_without_last(imagefolder_root,
                                                                      tmp_path, capsys,
                                                                      monkeypatch):
    from ampkit.checkpoint import writer as checkpoint_writer

    def no_space(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_writer.torch, "save", no_space)
    code, out, err = _main("train_without", _args(imagefolder_root, tmp_path / "ckpt"), capsys)
    line = _one_line(code, err)
    assert "cannot save" in line and "last.pth" in line and "MB free" in line, line
    run_dir = tmp_path / "ckpt" / "train_without"
    assert not (run_dir / "best.pth").exists() and not (run_dir / "last.pth").exists()
    assert not list(run_dir.glob(".*.tmp"))


# ------------------------------------------------------------------ 5: one run per folder
_HOLD = """
import sys, time
sys.path.insert(0, "AMP")
from ampkit.run import RunLock
lock = RunLock(sys.argv[1])
print("locked", flush=True)
time.sleep(300)
"""


@pytest.mark.slow  # the first run is a process of its own
def test_second_run_in_the_same_folder_is_refused_until_the_first_dies(imagefolder_root,
                                                                      tmp_path, capsys):
    run_dir = tmp_path / "ckpt" / "train_without"
    run_dir.mkdir(parents=True)
    holder = start([PYTHON, "-c", _HOLD, run_dir])
    try:
        assert holder.stdout.readline().strip() == "locked"
        stale = run_dir / ".last.pth.123.tmp"  # the holder's save in flight: not touched
        stale.write_bytes(b"in flight")
        code, out, err = _main("train_without", _args(imagefolder_root, tmp_path / "ckpt"),
                               capsys)
        line = _one_line(code, err)
        assert f"pid {holder.pid} on " in line and "started 20" in line, line
        assert stale.exists()
    finally:
        kill_job(holder.pid, signal.SIGKILL)  # the OS releases the lock
        finish(holder, 30)
    code, out, err = _main("train_without", _args(imagefolder_root, tmp_path / "ckpt"), capsys)
    assert code == 0, err
    assert not stale.exists(), "the new holder cleans up the dead run's temp files"


def test_log_survives_a_kill_mid_write(tmp_path):
    """A partial last line (the process killed while writing it) and rows of the epochs the
    resumed run trains again are dropped at its first row; the rest stays JSON lines."""
    from ampkit.run import RunLogger

    log = tmp_path / "log.jsonl"
    log.write_text('{"epoch": 1, "val_acc": 0.5}\n{"epoch": 2, "val_acc": 0.6}\n{"epoch": 3, "va')
    logger = RunLogger(True, None, log)
    logger.record({"epoch": 2, "val_acc": 0.7})
    logger.close()
    assert [json.loads(line) for line in log.read_text().splitlines()] == \
        [{"epoch": 1, "val_acc": 0.5}, {"epoch": 2, "val_acc": 0.7}]


# ------------------------------------------------------------------ 6, 7, 9: resume checks
@pytest.mark.slow
def test_resume_from_another_variant_is_refused_init_from_starts_anew(imagefolder_root,
                                                                       tmp_path, capsys):
    run_dir = _first_run(imagefolder_root, tmp_path, capsys)
    other = str(run_dir / "last.pth")
    code, out, err = _main("train_DP", _args(imagefolder_root, tmp_path / "ckpt",
                                             "--resume", other, "--epochs", "2"), capsys)
    line = _one_line(code, err)
    assert "train_without run, this is train_DP" in line and "--init_from" in line, line
    assert not (tmp_path / "ckpt" / "train_DP" / "last.pth").exists()
    code, out, err = _main("train_DP", _args(imagefolder_root, tmp_path / "ckpt",
                                             "--init_from", other), capsys)
    assert code == 0, err
    assert f"starting from the weights of {other}" in out and "epoch 1/1" in out, out


@pytest.mark.slow
def test_resume_with_other_data_or_size_says_what_differs(imagefolder_root, cifar_root, tmp_path,
                                                          capsys):
    run_dir = _first_run(imagefolder_root, tmp_path, capsys)
    argv = _args(cifar_root, tmp_path / "ckpt", "--resume", "--epochs", "2", dataset="CIFAR10")
    argv[argv.index("--img_size") + 1] = "80"
    code, out, err = _main("train_without", argv, capsys)
    line = _one_line(code, err)
    for words in ("--dataset ImageFolder (this run: CIFAR10)", "--img_size 64 (this run: 80)",
                  f"--dataset_root {imagefolder_root}"):
        assert words in line, line
    assert torch.load(run_dir / "last.pth", weights_only=True,
                      mmap=True)["progress"]["epoch"] == 1


@pytest.mark.slow
def test_resume_with_another_global_batch_is_refused(imagefolder_root, tmp_path, capsys):
    _first_run(imagefolder_root, tmp_path, capsys)
    argv = _args(imagefolder_root, tmp_path / "ckpt", "--resume", "--epochs", "2")
    argv[argv.index("--batch_size") + 1] = "16"
    code, out, err = _main("train_without", argv, capsys)
    line = _one_line(code, err)
    assert "a global batch of 48 x 1 micro-batches x 1 processes (this run: 16 x 1 x 1)" in line
    # The same global batch in 3 micro-batches of 16 per optimizer step: it may go on.
    code, out, err = _main("train_without", argv + ["--accum_steps", "3"], capsys)
    assert code == 0, err
    assert "global batch 48" in out and "--accum_steps 3 (was 1)" in out, out


def _log_lrs(run_dir: Path) -> list:
    return [json.loads(line)["lr"] for line in (run_dir / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_resume_says_which_flags_changed_and_which_learning_rate_wins(imagefolder_root,
                                                                      tmp_path, capsys):
    """--resume with other flags: each one that differs is named in one line, and this run's
    value is used. The learning rate: --lr on the command line sets the optimizer's; without
    it, the optimizer goes on at its saved one, and the line says that too."""
    run_dir = _first_run(imagefolder_root, tmp_path, capsys)  # lr 1e-4 (the default)
    code, out, err = _main("train_without", _args(imagefolder_root, tmp_path / "ckpt", "--resume",
                                                  "--epochs", "2", "--lr", "5e-3"), capsys)
    assert code == 0, err
    changed = [ln for ln in out.splitlines() if "differ from the checkpoint" in ln]
    assert len(changed) == 1 and "--epochs 2 (was 1)" in changed[0], out
    assert "--lr 0.005" in changed[0] and "0.0001" in changed[0], changed
    assert _log_lrs(run_dir) == [pytest.approx(1e-4), pytest.approx(5e-3)]
    # Without --lr, the saved 5e-3 goes on (not the default 1e-4), and the line says why.
    code, out, err = _main("train_without", _args(imagefolder_root, tmp_path / "ckpt", "--resume",
                                                  "--epochs", "3"), capsys)
    assert code == 0, err
    changed = [ln for ln in out.splitlines() if "differ from the checkpoint" in ln]
    assert len(changed) == 1 and "--lr not given" in changed[0] and "0.005" in changed[0], out
    assert "--epochs 3 (was 2)" in changed[0], changed
    assert _log_lrs(run_dir)[-1] == pytest.approx(5e-3)


def test_resume_of_a_missing_file_names_the_flag(imagefolder_root, tmp_path, capsys):
    code, out, err = _main("train_without", _args(imagefolder_root, tmp_path / "ckpt", "--resume",
                                                  "/nonexistent.pth"), capsys)
    line = _one_line(code, err)
    assert line.split("error: ", 1)[1].startswith("--resume /nonexistent.pth"), line


@pytest.mark.parametrize("script, flags, says", [
    ("train_without", ["--amp_dtype", "float16"], "train_without trains in fp32"),
    ("train_DP", ["--amp_dtype", "bfloat16"], "train_DP trains in fp32"),
    ("train_DDP", ["--amp_dtype", "bfloat16"], "train_DDP trains in fp32"),
    ("train_FSDP", ["--amp_dtype", "bfloat16"], "train_FSDP trains in fp32"),
    ("train_without", ["--dp_scope", "features"], "what DataParallel replicates"),
    ("train_DDP_autocast", ["--dp_scope", "model"], "what DataParallel replicates"),
    ("train_DP_autocast", ["--compile"], "not DataParallel"),
    ("eval_without", ["--amp_dtype", "bfloat16"], "give --autocast too"),
])
def test_a_flag_the_script_does_not_honour_is_refused_in_one_line(script, flags, says,
                                                                 imagefolder_root, tmp_path,
                                                                 capsys):
    """The same rule in every script: a technique's flag is refused by the scripts of
    another, before anything runs, instead of being accepted and ignored."""
    argv = (_args(imagefolder_root, tmp_path / "ckpt", *flags) if script.startswith("train")
            else ["--checkpoint", str(tmp_path), "--no-cuda", *flags])
    code, out, err = _main(script, argv, capsys)
    assert code == 2 and says in _one_line(code, err), err
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------ 10: eval on other data
def test_eval_says_what_the_checkpoint_was_trained_on(imagefolder_root, tmp_path, capsys):
    run_dir = _first_run(imagefolder_root, tmp_path, capsys)
    other = _copy_tree(imagefolder_root, tmp_path / "other")  # the same 3 classes, elsewhere
    code, out, err = _main("eval_without", ["--checkpoint", str(run_dir / "last.pth"),
                                            "--no-cuda"], capsys)
    assert code == 0 and not err, err
    assert f"({FAST_ARCH}, trained on ImageFolder in {imagefolder_root} at 64px)" in out, out
    code, out, err = _main("eval_without", ["--checkpoint", str(run_dir / "last.pth"),
                                            "--no-cuda", "--dataset_root", str(other)], capsys)
    assert code == 0 and len(err) == 1, err
    assert err[0].startswith("warning:") and str(other) in err[0], err
    assert "= " in out  # the figure is still given


# ------------------------------------------------------------------ 11: foreign checkpoints
# Byte patterns whose unpickling used to escape as IndexError / KeyError tracebacks.
ESCAPED = [b"h\x07.", b"\x80\x02(.", b"}(K\x01h\x02u.",
           b"Q\x05\xb6\xdd\xf6\xfd\x01d\x04\xe6\xd2Y,|E:\xf9S\x83I",
           b"rS\x8a\xb2\xf5\xb57\xc8}pH\x1c\xbc[\xce\xbc\xdbGsO|"]


@pytest.mark.filterwarnings("error")  # no warning noise either
def test_random_bytes_are_never_a_traceback(tmp_path):
    from ampkit.checkpoint import files as checkpoint_files
    from ampkit.errors import UserError

    rng = np.random.default_rng(2026)
    blobs = [rng.bytes(int(rng.integers(1, 4096))) for _ in range(400)] + ESCAPED
    blobs += [b"\x80" + bytes([p]) + rng.bytes(64) for p in range(2, 6)]  # pickle protocols
    for i, blob in enumerate(blobs):
        path = tmp_path / f"{i}.pth"
        path.write_bytes(blob)
        with pytest.raises(UserError) as e:
            checkpoint_files.load(path)
        assert "\n" not in str(e.value) and str(e.value).startswith(str(path)), e.value


@pytest.mark.parametrize("rank,said", [("0", ["prog.py: interrupted"]), ("1", [])])
def test_ctrl_c_before_training_is_said_once_by_rank_0(rank, said, capsys, monkeypatch):
    """A terminal's Ctrl-C reaches every rank of a torchrun job: one line, rank 0's; every
    rank exits 130."""
    from ampkit.run import report_user_errors

    monkeypatch.setattr("sys.argv", ["prog.py"])
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")

    @report_user_errors
    def main():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 130
    assert capsys.readouterr().err.splitlines() == said


# ------------------------------------------------------------------ 8: a lost DDP peer
@pytest.mark.slow
def test_a_killed_ddp_worker_leaves_one_line_per_survivor(imagefolder_root, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = _args(imagefolder_root, ckpt, "--epochs", "50")
    flags[flags.index("--batch_size") + 1] = "4"
    proc = start(torchrun("--standalone", "--nproc_per_node=2",
                          REPO_ROOT / "AMP" / "train_DDP.py", *flags))
    wait_for((ckpt / "train_DDP" / "log.jsonl").exists, 180, proc)  # epoch 1 is done
    worker = run(["pgrep", "-f", "-n", "train_DDP.py"], timeout=30).stdout.split()
    kill_job(int(worker[-1]), signal.SIGKILL)  # the newest worker process
    code, out, err = finish(proc, 120)
    assert code != 0
    ours = [ln for ln in err.splitlines() if "train_DDP.py: error" in ln]
    assert len(ours) == 1 and "lost a peer process" in ours[0], err[-3000:]
    # torchrun reports the dead worker with its own traceback; no worker prints one.
    for tb in err.split("Traceback (most recent call last):")[1:]:
        assert "AMP/" not in tb[:400] and "ampkit" not in tb[:400], tb[:400]
    assert "saving" not in out and "saved" not in out, out


@pytest.mark.parametrize("script", ["train_DDP", "train_FSDP_mixed", "eval_DDP"])
def test_an_error_after_the_group_is_made_leaves_it_in_the_scripts_own_teardown(
        script, tmp_path, monkeypatch):
    """A user's mistake found once the process group exists (here: a data folder without
    train/ and val/, a checkpoint that is not there) is one line and exit status 2, and the
    script's own ``finally`` has left the group: nothing else does it for the script."""
    import torch.distributed as dist

    made = []
    real_init = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group",
                        lambda *a, **kw: (made.append(kw.get("world_size")), real_init(*a, **kw)))
    (tmp_path / "no_split").mkdir()
    argv = (["--checkpoint", tmp_path / "none.pth", "--no-cuda"] if script.startswith("eval")
            else _args(tmp_path / "no_split", tmp_path / "ckpt"))
    try:
        code, out, err = run_main(script, *argv)
        assert made == [1], made  # the error came after the group was made
        assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
        assert not dist.is_initialized(), f"{script} left its process group behind"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------ 12: found by the fuzz tests
# (tests/test_fuzz_inputs.py): each was a traceback or a result the input did not hold.
def _loaders(root: Path, **kw):
    from ampkit.data import build_loaders
    from ampkit.distributed import DistInfo

    return build_loaders(kw.pop("name", "ImageFolder"), root, 8, 4,
                         DistInfo(device=torch.device("cpu"), local_rank=1), **kw)


@pytest.mark.parametrize("link", ["..", "."])
def test_a_link_back_up_an_image_folder_is_one_line(link, imagefolder_root, tmp_path):
    """torchvision's walk followed it again and again: each image a sample ~40 times over,
    most under another class, without a word."""
    from ampkit.errors import UserError

    root = _copy_tree(imagefolder_root, tmp_path / "data")
    (root / "train" / "red" / "loop").symlink_to(link, target_is_directory=True)
    with pytest.raises(UserError, match="read already .a link.") as error:
        _loaders(root)
    assert str(root / "train" / "red" / "loop") in str(error.value)


def test_an_image_outside_any_class_folder_is_one_line(imagefolder_root, tmp_path):
    """torchvision left it out without a word; a text file there stays allowed."""
    from ampkit.errors import UserError

    root = _copy_tree(imagefolder_root, tmp_path / "data")
    (root / "train" / "README.txt").write_text("the data set's notes")
    assert _loaders(root).train_size == IF_TRAIN_SIZE
    shutil.copy(root / "train" / "red" / "000.png", root / "train" / "loose.png")
    with pytest.raises(UserError, match="an image outside any class folder") as error:
        _loaders(root)
    assert str(root / "train" / "loose.png") in str(error.value)


def test_an_unreadable_image_with_a_line_break_in_its_name_is_named_in_one_line(
        imagefolder_root, tmp_path):
    root = _copy_tree(imagefolder_root, tmp_path / "data")
    (root / "val" / "red" / "new\nline.png").write_bytes(b"not an image")
    code, out, err = _main("train_without", _args(root, tmp_path / "ckpt"))
    line = _one_line(code, err)
    assert str(root / "val" / "red" / "new\\nline.png") in line, line


def _write_batch(root: Path, name: str, change) -> Path:
    path = root / "cifar-10-batches-py" / name
    with open(path, "rb") as f:
        entry = pickle.load(f, encoding="latin1")
    change(entry)
    path.write_bytes(pickle.dumps(entry))
    return path


@pytest.mark.parametrize("loader", ["fast", "classic"])
@pytest.mark.parametrize("damage, says", [
    # A traceback from both paths (PIL's fromarray, the fast path's uint8 check).
    ("data of int64", "'data' is not CIFAR-10's"),
    # Read on the classic path with every label after it one image late.
    ("a label more", "2 images but 3 labels"),
    # "CIFAR-10 is not in ... and could not be downloaded", no file named.
    ("data of 3 x 32 x 32", "'data' is not CIFAR-10's"),
    ("no label_names", "'label_names'"),
])
def test_a_cifar_file_of_another_format_is_named(damage, says, loader, tmp_path):
    from ampkit.errors import UserError
    from tools.cifar_files import write_cifar10

    root = write_cifar10(tmp_path / "cifar", 10, 3)
    path = _write_batch(root, "batches.meta" if "label_names" in damage else "data_batch_2", {
        "data of int64": lambda e: e.update(data=e["data"].astype(np.int64)),
        "a label more": lambda e: e["labels"].append(0),
        "data of 3 x 32 x 32": lambda e: e.update(data=e["data"].reshape(-1, 3, 32, 32)),
        "no label_names": lambda e: e.pop("label_names"),
    }[damage])
    with pytest.raises(UserError) as error:
        _loaders(root, name="CIFAR10", loader=loader)
    assert str(path) in str(error.value) and says in str(error.value), error.value


@pytest.mark.parametrize("clash", ["a file where a folder must be", "a folder linking out"])
def test_a_cifar_archive_that_cannot_be_extracted_in_its_root_is_one_line(clash, tmp_path,
                                                                          monkeypatch):
    """Its members safe, its md5 taken for CIFAR-10's (the real archive is 163 MB): tarfile's
    OSError, or its data filter's refusal of a path through a link out of the root, was a
    traceback."""
    from ampkit.data.datasets import extract_cifar_archive
    from ampkit.errors import UserError

    root = tmp_path / "root"
    root.mkdir()
    if clash == "a folder linking out":
        (tmp_path / "elsewhere").mkdir()
        (root / "cifar-10-batches-py").symlink_to(tmp_path / "elsewhere")
        members = [_member("cifar-10-batches-py/data_batch_1")]
    else:
        members = [_member("cifar-10-batches-py"), _member("cifar-10-batches-py/data_batch_1")]
    with tarfile.open(root / ARCHIVE, "w:gz") as tar:
        for member in members:
            tar.addfile(member, io.BytesIO(b"x" * member.size))
    _trust_the_archive(root, monkeypatch)
    with pytest.raises(UserError, match="cannot be extracted into") as error:
        extract_cifar_archive(root / ARCHIVE, root)
    assert str(root / ARCHIVE) in str(error.value)
    if clash == "a folder linking out":
        assert not any((tmp_path / "elsewhere").iterdir())


@pytest.mark.parametrize("script, flags, says", [
    # torch.manual_seed's ValueError; 2**64 - 1 the sampler's at the second epoch.
    ("train_without", ["--seed", str(2**64)], "--seed must be a 64-bit integer"),
    ("train_without", ["--seed", str(2**64 - 1), "--epochs", "2"], "--seed must be"),
    # islice's ValueError, in the sampler or the engine's grouping of micro-batches.
    ("train_without", ["--batch_size", str(2**63)], "--batch_size must be a positive"),
    ("eval_without", ["--batch_size", str(2**63)], "--batch_size must be a positive"),
    ("train_without", ["--accum_steps", str(2**63)], "--accum_steps must be a positive"),
    # BatchNorm's ValueError in the first step: ShuffleNet's last maps are 1 x 1 at 32 px.
    ("train_without", ["--batch_size", "1"], "--batch_size 1 cannot train"),
    # The eval scripts took 0 for "the checkpoint's size", without a word.
    ("eval_without", ["--img_size", "0"], "--img_size must be a positive integer"),
])
def test_a_number_no_run_can_take_is_one_line(script, flags, says, imagefolder_root, tmp_path):
    argv = (quick_flags(imagefolder_root, tmp_path / "ckpt", *flags, img_size=32)
            if script.startswith("train") else ["--checkpoint", str(tmp_path), "--no-cuda", *flags])
    code, out, err = _main(script, argv)
    assert code == 2 and says in _one_line(code, err), err
