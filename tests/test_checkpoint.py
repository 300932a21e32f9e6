"""Checkpoint writing off the training loop's path: snapshots into kept buffers, a background
writer, the --save_every policy, atomic writes through a new file, one space check."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from conftest import quick_flags

from ampkit.checkpoint import writer as checkpoint_writer


def test_a_reader_keeps_the_bytes_it_opened_as_saves_go_on(tmp_path):
    """Each save is a new file renamed over last.pth: a reader that opened the previous one
    (an evaluation while training goes on, a copy) reads it whole, unchanged, through any
    number of later saves; no file is left beside last.pth."""
    path = tmp_path / "last.pth"
    checkpoint_writer.atomic_save({"epoch": 1, "w": torch.full((1000,), 1.0)}, path)
    with open(path, "rb") as reader:
        for epoch in (2, 3, 4):
            checkpoint_writer.atomic_save({"epoch": epoch, "w": torch.full((10,), 2.0)}, path)
        assert torch.load(reader, weights_only=True)["epoch"] == 1
    assert torch.load(path, weights_only=True)["epoch"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["last.pth"]


def test_a_save_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path,
                                                                          monkeypatch):
    """In a folder others may write to, a symbolic link planted at the name a save's
    temporary file takes would have the save write into the link's target, and last.pth
    become that link: the temporary file is created anew (O_EXCL, O_NOFOLLOW), at another
    name when one is taken, and the link and its target are left as they were."""
    import os

    names = iter(["planted", "fresh", "planted", "fresh2"])
    monkeypatch.setattr(checkpoint_writer.secrets, "token_hex", lambda n: next(names))
    target = tmp_path / "elsewhere"
    target.write_bytes(b"someone else's file")
    path = tmp_path / "last.pth"
    planted = tmp_path / f".last.pth.{os.getpid()}.planted.tmp"
    planted.symlink_to(target)
    checkpoint_writer.atomic_save({"epoch": 1}, path)
    assert target.read_bytes() == b"someone else's file"
    assert not path.is_symlink() and torch.load(path, weights_only=True) == {"epoch": 1}
    assert planted.is_symlink() and os.readlink(planted) == str(target)
    # The hard link best.pth takes is made at such a name too: a taken one is passed over.
    checkpoint_writer.link_or_write(checkpoint_writer.Link(path, tmp_path / "best.pth", {}))
    assert (tmp_path / "best.pth").stat().st_ino == path.stat().st_ino
    assert target.read_bytes() == b"someone else's file"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_checkpoints_follow_the_umask(umask, mode, tmp_path):
    """A checkpoint's mode is what ``open()`` would give it under the umask (a teammate's
    group can read a shared folder's last.pth)."""
    import os
    import stat

    before = os.umask(umask)
    try:
        path = tmp_path / "last.pth"
        for step in range(2):  # a new file, then one replacing it
            checkpoint_writer.atomic_save({"step": torch.tensor(step)}, path)
            assert stat.S_IMODE(path.stat().st_mode) == mode, (step, oct(path.stat().st_mode))
    finally:
        os.umask(before)


def test_snapshot_reuses_its_buffers_and_is_independent_of_the_source():
    live = {"model": {"w": torch.ones(4)}, "optimizer": {"state": {0: {"m": torch.zeros(3)}},
                                                         "param_groups": [{"lr": 0.1}]}}
    snap = checkpoint_writer.Snapshot()
    first = snap.take(live)
    live["model"]["w"].add_(1)  # training goes on
    assert torch.equal(first["model"]["w"], torch.ones(4))
    assert first["optimizer"]["param_groups"] == [{"lr": 0.1}]
    second = snap.take(live)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # same buffer
    assert torch.equal(second["model"]["w"], torch.full((4,), 2.0))


def test_background_writer_reports_an_error_at_the_next_wait(tmp_path):
    writer = checkpoint_writer.BackgroundWriter()
    writer.submit([({"x": torch.zeros(1)}, tmp_path / "missing" / "last.pth")])
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()  # reported once


def test_a_save_that_does_not_fit_fails_at_submit(tmp_path, monkeypatch):
    """One space check, in the caller's thread before any write."""
    path, state = tmp_path / "last.pth", {"w": torch.zeros(2**18)}  # 1 MB of tensors, + 1 MB
    usage = checkpoint_writer.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint_writer.shutil, "disk_usage",
                        lambda p: usage._replace(free=2**20))  # 1 MB free
    writer = checkpoint_writer.BackgroundWriter()
    with pytest.raises(checkpoint_writer.DiskFull, match="needs 2 MB .* has 1 MB free"):
        writer.submit([(state, path)])
    assert not writer.busy and list(tmp_path.iterdir()) == [], "nothing started, nothing written"
    monkeypatch.setattr(checkpoint_writer.shutil, "disk_usage",
                        lambda p: usage._replace(free=2**21))
    writer.submit([(state, path)])
    writer.wait()
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])


@pytest.mark.parametrize("save_every,expected", [
    ("2", [("last.pth", 2), ("best.pth", 1), ("last.pth", 3)]),
    ("1", [("last.pth", 1), ("last.pth", 2), ("last.pth", 3)]),
    ("0", [("last.pth", 3)]),
])
def test_save_every_policy_and_background_thread(save_every, expected, imagefolder_root,
                                                 tmp_path, monkeypatch):
    """In-process, 3 epochs of one step. Validation accuracy is forced to 0.5, 0.4, 0.6:
    epochs 1 and 3 are the best. A best epoch that last.pth is written for gets best.pth as
    a second name of that file (nothing more written); one between saves is written, its
    weights, by the next save."""
    import train_without

    writes = []
    original = checkpoint_writer.atomic_save

    def recording(obj, path):
        writes.append((path.name, obj["progress"]["epoch"], threading.current_thread().name))
        original(obj, path)

    accuracies = iter([0.5, 0.4, 0.6])
    real_count = train_without.count_correct

    def forced(*args, **kwargs):
        counts = real_count(*args, **kwargs)
        counts[0] = int(next(accuracies) * 1000)
        counts[1] = 1000
        return counts

    monkeypatch.setattr(checkpoint_writer, "atomic_save", recording)
    monkeypatch.setattr(train_without, "count_correct", forced)
    train_without.main(quick_flags(imagefolder_root, tmp_path, batch_size=48, epochs=3,
                                   save_every=save_every))
    assert [(name, epoch) for name, epoch, _ in writes] == expected
    assert {thread for *_, thread in writes} == {"checkpoint"}, "written in the background"
    run_dir = tmp_path / "train_without"
    best = torch.load(run_dir / "best.pth", weights_only=True)["progress"]
    assert best["val_acc"] == pytest.approx(0.6)
    assert (run_dir / "best.pth").stat().st_ino == (run_dir / "last.pth").stat().st_ino
    assert [p.name for p in run_dir.glob(".*")] == [".lock"], "no temporary file left"


def test_best_is_a_second_name_that_the_next_saves_leave_alone(tmp_path):
    """best.pth names epoch 1's last.pth; the saves of epochs 2 and 3 leave it whole."""
    last, best = tmp_path / "last.pth", tmp_path / "best.pth"
    writer = checkpoint_writer.BackgroundWriter()
    for epoch in (1, 2, 3):
        state = {"epoch": epoch, "w": torch.full((1000,), float(epoch))}
        files = [(state, last)] + ([checkpoint_writer.Link(last, best, fallback=state)] if epoch == 1
                                   else [])
        writer.submit(files)
        writer.wait()
    assert torch.load(last, weights_only=True)["epoch"] == 3
    kept = torch.load(best, weights_only=True)
    assert kept["epoch"] == 1 and torch.equal(kept["w"], torch.ones(1000))


def test_an_entry_added_to_the_state_is_saved_and_resumed_by_its_name(tmp_path, capsys):
    """The script's state (name -> object) is the checkpoint: an entry a user adds to it (an
    EMA of the weights, say) is one line, saved beside the run's record and loaded back into
    the object of the same name by a resume, where the run stands among them; an entry no
    object takes is said in the resume's lines, not dropped in silence, and one missing from
    the checkpoint starts anew."""
    from torch import nn

    from ampkit.checkpoint import LAST, CheckpointManager, Progress
    from ampkit.distributed import DistInfo
    from ampkit.errors import UserError
    from ampkit.flags import parse_train_args

    info, run_dir = DistInfo(torch.device("cpu")), tmp_path / "train_without"
    run_dir.mkdir()
    flags = ["--dataset", "FakeData", "--checkpoint", str(tmp_path), "--epochs", "2"]

    def objects(seed: int, **extra):
        torch.manual_seed(seed)
        network = nn.Linear(4, 3)
        return {"model": network, "optimizer": torch.optim.AdamW(network.parameters(), lr=1e-3),
                "progress": Progress(), **extra}

    def manager(state, argv):
        return CheckpointManager(run_dir, state, info, save_every="1", epochs=2, num_classes=3,
                                 args=parse_train_args("train_without", argv))

    state = objects(0, ema=nn.Linear(4, 3))  # the EMA: a second set of weights
    with manager(state, flags) as checkpoint:
        checkpoint.load(None, init_from=None, say=print)
        checkpoint.save(1, val_acc=0.5)
        checkpoint.writer.wait()
    saved = torch.load(run_dir / LAST, weights_only=True)
    assert torch.equal(saved["ema"]["weight"], state["ema"].weight)
    assert saved["progress"] | {"so_far": None} == {"epoch": 1, "step": 0, "best_acc": 0.5,
                                                   "best_epoch": 1, "val_acc": 0.5,
                                                   "so_far": None}

    for given in (True, False):
        state2 = objects(1, **({"ema": nn.Linear(4, 3)} if given else {}))
        manager(state2, flags + ["--resume"]).load("auto", init_from=None, say=print)
        assert torch.equal(state2["model"].weight, state["model"].weight)
        assert state2["progress"].epoch == 1 and state2["progress"].best_acc == 0.5
        if given:
            assert torch.equal(state2["ema"].weight, state["ema"].weight)
        said = capsys.readouterr().out
        assert ("the checkpoint's 'ema' is not restored" in said) != given, said

    # An object the checkpoint holds nothing for starts anew, and says so (no KeyError, an
    # optimizer missing too); a saved state that does not fit its object is one line.
    state3 = objects(2, swa=nn.Linear(4, 3))
    del state3["optimizer"]
    manager(state3, flags + ["--resume"]).load("auto", init_from=None, say=print)
    said = capsys.readouterr().out
    assert "swa starts anew: the checkpoint holds none" in said
    assert "the checkpoint's 'optimizer' is not restored" in said
    state4 = objects(3, ema=nn.Linear(4, 5))
    with pytest.raises(UserError, match=r"its 'ema' does not fit this run's ema \(.*size"):
        manager(state4, flags + ["--resume"]).load("auto", init_from=None, say=print)


class _Unsafe:
    """A state whose state_dict() holds a Python object weights_only loading refuses."""

    def state_dict(self):
        return {"when": Path("/tmp")}

    def load_state_dict(self, saved):
        pass


@pytest.mark.parametrize("entry,why", [
    (_Unsafe(), r"'bad' \(_Unsafe\) cannot be saved and loaded back with "
                r"torch.load\(weights_only=True\): its state_dict\(\) holds pathlib.PosixPath"),
    (object(), r"'bad' \(object\) has no state_dict\(\) and load_state_dict\(\)"),
])
def test_an_entry_that_cannot_be_loaded_safely_is_refused_as_the_run_starts(
        tmp_path, entry, why, monkeypatch):
    """An entry whose state a weights_only load would refuse (or that has no state dict) is
    one line as the checkpoint manager is made -- before any epoch is spent, not at the
    first save -- and on every rank alike: a rank whose own entry passes stops too, naming
    the rank that refused."""
    from torch import nn

    from ampkit.checkpoint import CheckpointManager, Progress, files, manager as manager_module
    from ampkit.distributed import DistInfo
    from ampkit.errors import UserError
    from ampkit.flags import parse_train_args

    args = parse_train_args("train_without", ["--dataset", "FakeData"])
    network, progress = nn.Linear(4, 3), Progress()

    def make(state, info):
        return CheckpointManager(tmp_path, state | {"progress": progress}, info, save_every="1",
                                 epochs=1, num_classes=3, args=args)

    make({"model": network, "scheduler": None}, DistInfo(torch.device("cpu")))  # None: skipped
    with pytest.raises(UserError, match=why):
        make({"model": network, "bad": entry}, DistInfo(torch.device("cpu")))
    with pytest.raises(UserError, match="must name the weights 'model'.*: it names epoch"):
        make({"model": network, "epoch": network}, DistInfo(torch.device("cpu")))
    # Rank 0 of two, whose own state is fine, hears rank 1's refusal through the gather.
    rank1 = files.unsaveable({"model": network, "bad": entry})
    monkeypatch.setattr(manager_module, "gather_from_ranks", lambda items, info: items + [rank1])
    with pytest.raises(UserError, match="rank 1: .*" + why):
        make({"model": network}, DistInfo(torch.device("cpu"), rank=0, world_size=2))


def test_without_hard_links_best_is_written(tmp_path, monkeypatch):
    """A file system without hard links (some network and FAT mounts): best.pth is written
    from its fallback, leaving no temporary file behind."""
    import errno
    import os

    def no_links(*_):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    last, best = tmp_path / "last.pth", tmp_path / "best.pth"
    writer = checkpoint_writer.BackgroundWriter()
    for epoch in (1, 2, 3):
        state = {"epoch": epoch, "w": torch.full((10,), float(epoch))}
        writer.submit([(state, last), checkpoint_writer.Link(last, best, fallback=state)])
        writer.wait()
        assert torch.load(last, weights_only=True)["epoch"] == epoch
        assert torch.load(best, weights_only=True)["epoch"] == epoch
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pth", "last.pth"]
