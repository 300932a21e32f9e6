"""Right at any world size: the ranks stop together within a step, uneven shards never
leave a rank waiting, every rank starts from the seed's weights, and rank 0 decides what
is resumed. Under torchrun at 3 and 4 gloo processes, on sizes that do not divide."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import (FAST_ARCH, FSDP_ARCH, REPO_ROOT, assert_no_traceback_of_ours, quick_flags,
                      parse_accuracy)
from helpers.processes import ScriptResult, run, torchrun

HELPER = REPO_ROOT / "tests" / "helpers" / "faulty_train.py"


def _torchrun(nproc: int, script: Path, *args: str, env: dict | None = None,
              timeout: float = 240) -> ScriptResult:
    """torchrun with ``nproc`` workers; past ``timeout`` (a rank waiting on a collective
    that its peers skipped) the whole job is killed and the test fails."""
    return run(torchrun("--standalone", f"--nproc_per_node={nproc}", script, *args), env, timeout)


def _exit_codes(stderr: str) -> dict:
    """Each failed rank's exit status, from torchrun's failure report."""
    return {int(rank): int(code) for rank, code in
            re.findall(r"rank\s+: (\d+) \(local_rank.*\n\s+exitcode\s+: (-?\d+)", stderr)}


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _parameters(state: dict, names) -> dict:
    return {k: v for k, v in state.items() if k in names}


def _seeds_model(arch: str, num_classes: int, seed: int = 0) -> dict:
    """The parameters a one-process run of ``seed`` starts from."""
    from ampkit.models import build_model

    torch.manual_seed(seed)
    model = build_model(arch, num_classes)
    return {name: p.detach() for name, p in model.named_parameters()}


# ------------------------------------------------------------------ stopping together
@pytest.mark.slow
@pytest.mark.parametrize("nproc,rank,signal_name,stop", [
    # 48 images / (3 ranks x 2) = 8 micro-batches, --accum_steps 2: 4 steps an epoch, fewer
    # than --log_every's 20. Rank 2's 11th loss is epoch 2's 3rd micro-batch, in step 2: the
    # vote cast after step 2 is read after step 3, where every rank stops.
    (3, 2, "SIGTERM", "at epoch 2, step 3"),
    # 4 ranks: 3 steps an epoch; rank 1's signal comes in step 3, the epoch's last: every
    # rank stops there, before validation.
    (4, 1, "SIGINT", "at epoch 2, step 3"),
])
def test_a_signal_to_one_rank_stops_every_rank_a_step_later(nproc, rank, signal_name, stop,
                                                             imagefolder_root, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = quick_flags(imagefolder_root, ckpt, "--batch_size", "2", "--accum_steps", "2",
                   "--epochs", "4")
    res = _torchrun(nproc, HELPER, "train_DDP", *flags,
                    env={"FAULT_SIGTERM_AT_LOSS": "11", "FAULT_RANK": str(rank),
                         "FAULT_SIGNAL": signal_name, "FAULT_SLOW_EXIT": "2"})
    out = res.stdout
    assert f"stopped by {signal_name} (sent to another rank) {stop}" in out, \
        out[-2000:] + res.stderr[-3000:]
    # Every rank's status is the signal's, also those that torchrun's SIGTERM reached while
    # they tore down (FAULT_SLOW_EXIT: the signalled rank exits 2 s before its peers).
    status = 128 + {"SIGTERM": 15, "SIGINT": 2}[signal_name]
    assert _exit_codes(res.stderr) == {r: status for r in range(nproc)}, res.stderr[-3000:]
    state = _load(ckpt / "train_DDP" / "last.pth")
    assert (state["progress"]["epoch"], state["progress"]["step"]) == (1, 3)
    assert_no_traceback_of_ours(out, res.stderr)
    # The resume from such a step, to the end and bit for bit: below at 3 ranks,
    # test_scheduler_stops.py (a torchrun job at 2 ranks) and test_stop_rule.py (from an
    # epoch's last step).


@pytest.mark.slow
def test_ddp_at_3_ranks_stopped_and_resumed_ends_bit_for_bit(imagefolder_root, tmp_path):
    """Over 3 ranks a ring all-reduce adds an element's terms in an order set by its place
    in DDP's bucket: the resumed run's first step must sum in the buckets of the run that
    never stopped (distributed.settle_buckets), or its weights end within rounding only."""
    flags = ["--batch_size", "2", "--epochs", "2", "--lr", "1e-3"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    script = REPO_ROOT / "AMP" / "train_DDP.py"
    res = _torchrun(3, script, *quick_flags(imagefolder_root, whole, *flags))
    assert res.returncode == 0, res.stderr[-3000:]
    # 48 images / (3 ranks x 2): 8 steps an epoch; rank 1's 11th loss is epoch 2's step 3.
    res = _torchrun(3, HELPER, "train_DDP", *quick_flags(imagefolder_root, stopped, *flags),
                    env={"FAULT_SIGTERM_AT_LOSS": "11", "FAULT_RANK": "1"})
    assert "stopped by SIGTERM (sent to another rank) at epoch 2" in res.stdout, \
        res.stdout[-2000:] + res.stderr[-3000:]
    res = _torchrun(3, script, *quick_flags(imagefolder_root, stopped, *flags), "--resume")
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stderr[-3000:]
    want, got = (_load(folder / "train_DDP" / "last.pth") for folder in (whole, stopped))
    differ = [name for name, tensor in want["model"].items()
              if not torch.equal(got["model"][name], tensor)]
    assert not differ, differ


# ------------------------------------------------------------------ uneven shards, same start
def _with_one_more_val_image(root: Path, dst: Path) -> Path:
    shutil.copytree(root, dst)
    first = sorted((dst / "val" / "red").iterdir())[0]
    shutil.copy(first, first.with_name("extra.png"))
    return dst


@pytest.mark.slow
def test_fsdp_at_3_processes_validates_uneven_shards_and_starts_from_the_seeds_weights(
        mini_imagefolder_root, tmp_path, capsys):
    """4 validation images over 3 ranks at batch 1: 2, 1 and 1 forwards, each one a
    collective (FSDP2 gathers every block). --lr 0: the weights stay the initial ones,
    which must be the seed's, as a one-process run makes them."""
    root = _with_one_more_val_image(mini_imagefolder_root, tmp_path / "data")
    ckpt = tmp_path / "ckpt"
    flags = quick_flags(root, ckpt, "--batch_size", "1", "--epochs", "1", "--lr", "0",
                   arch=FSDP_ARCH)
    res = _torchrun(3, REPO_ROOT / "AMP" / "train_FSDP.py", *flags, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    shown = re.search(r"val_acc \S+ \((\d+)/(\d+)\)", res.stdout)
    assert shown and shown.group(2) == "4", res.stdout
    last = ckpt / "train_FSDP" / "last.pth"
    want = _seeds_model(FSDP_ARCH, 3)
    got = _parameters(_load(last)["model"], want)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "ranks started from other weights"
    import eval_without  # the count is exact: one process counts the same

    eval_without.main(["--checkpoint", str(last), "--no-cuda"])
    assert parse_accuracy(capsys.readouterr().out) == (int(shown.group(1)), 4)


@pytest.mark.slow
def test_ddp_at_4_processes_with_an_empty_shard_and_an_unreadable_image(mini_imagefolder_root,
                                                                        tmp_path):
    """3 validation images over 4 ranks: rank 3 has none, and still runs the forward its
    peers' collectives wait for. One training image cannot be read: with batches of 1, the
    rank whose batch it fills would run a step fewer; the next readable image takes its
    place. --lr 0: the weights stay the seed's."""
    root = tmp_path / "data"
    shutil.copytree(mini_imagefolder_root, root)
    bad = root / "train" / "green" / "000.png"
    bad.write_bytes(b"not an image")
    ckpt = tmp_path / "ckpt"
    flags = quick_flags(root, ckpt, "--batch_size", "1", "--epochs", "1", "--lr", "0",
                   "--skip_bad_images")
    res = _torchrun(4, REPO_ROOT / "AMP" / "train_DDP.py", *flags, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"val_acc \S+ \(\d+/3\)", res.stdout), res.stdout
    assert "skipped" in res.stdout and str(bad) in res.stdout, res.stdout
    want = _seeds_model(FAST_ARCH, 3)
    got = _parameters(_load(ckpt / "train_DDP" / "last.pth")["model"], want)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------ in-process, the rules
def _identity(path: Path):
    from ampkit.checkpoint.files import identity

    with open(path, "rb") as f:
        return identity(f)


def test_every_rank_must_load_what_rank_0_loads(tmp_path):
    """One gather of what each rank loaded: every rank must have read rank 0's bytes (a copy
    on another node is the same file), or like rank 0 none; else every rank stops with one
    line naming the first rank that differs, its host and path."""
    from ampkit.checkpoint.manager import agree
    from ampkit.errors import UserError

    last = tmp_path / "last.pth"
    last.write_bytes(b"a checkpoint")
    mine = ("node0", str(last), True, None, _identity(last))
    copy = tmp_path / "node1" / "last.pth"
    copy.parent.mkdir()
    copy.write_bytes(last.read_bytes())
    os.utime(copy, (1, 1))
    other_save = tmp_path / "other.pth"
    other_save.write_bytes(b"a checkpoinT")
    assert _identity(other_save) != _identity(last)
    agree([mine, ("node1", str(copy), True, None, _identity(copy))])
    agree([("node0", str(last), False, None, None)] * 3)
    for other, words in [
            (("node1", "/elsewhere/last.pth", False, None, None), "finds none at /elsewhere"),
            (("node1", "/elsewhere/last.pth", True, None, _identity(other_save)),
             "finds another file at /elsewhere"),
            (("node1", "/elsewhere/last.pth", False, "--resume: no checkpoint to resume at "
              "/elsewhere/last.pth", None), "finds none at /elsewhere")]:
        with pytest.raises(UserError) as e:
            agree([mine, mine, other])
        assert str(e.value).startswith(f"rank 0 on node0 resumes {last}, but rank 2 on node1 "
                                       f"{words}"), e.value
        assert str(e.value).endswith("must be shared by every node (--checkpoint on a shared "
                                     "file system), or the same file copied to each")
    # A rank that finds the file but cannot read it: one line, on every rank (not an
    # OSError's traceback on that rank while its peers wait).
    unreadable = ("node1", str(copy), True, f"cannot read {copy} (Permission denied)", None)
    with pytest.raises(UserError, match=r"^rank 1 on node1: cannot read .*Permission denied"):
        agree([mine, unreadable])
    # Rank 0's node has no last.pth and another node has one: the nodes see different
    # folders, and that is the line (not rank 0's "no checkpoint to resume").
    for error in ("--resume: no checkpoint to resume at /nB/last.pth", None):
        with pytest.raises(UserError, match=r"^rank 0 on node0 finds no checkpoint at "
                                            r"/nB/last.pth, but rank 1 on node1 finds one at "):
            agree([("node0", "/nB/last.pth", False, error, None),
                   ("node1", str(last), True, None, _identity(last))])
    # Alone, or where every rank agrees, rank 0's own error is the line.
    with pytest.raises(UserError, match="^--resume: no checkpoint to resume at /nB"):
        agree([("node0", "/nB/last.pth", False, "--resume: no checkpoint to resume at /nB",
                None)] * 2)


def test_the_identity_covers_every_byte_loaded_and_a_damaged_one_is_refused(tmp_path):
    """torch.load checks no CRC: a byte flipped in a record (a bad copy, a bad disk) would
    load as other weights. Every record's bytes are checked against its CRC-32 first (past
    ~1,100 records too, where the zip's directory outgrows a fixed tail of the file), and
    the identity the ranks compare is of those checked CRCs. A file written without CRCs
    (``set_crc32_options(False)``: each 0) is hashed whole: two saves of the same shapes
    differ, and it still loads."""
    import struct
    import zipfile

    from ampkit.checkpoint.files import Damaged, load
    from ampkit.errors import UserError

    path = tmp_path / "a.pth"
    torch.save({"model": {f"w{i}": torch.full((4,), float(i)) for i in range(1500)}}, path)
    data = path.read_bytes()
    end = data.rfind(b"PK\x05\x06")
    directory_at = struct.unpack_from("<L", data, end + 16)[0]
    assert len(data) - directory_at > 2**16 and data[directory_at:directory_at + 4] == b"PK\x01\x02"
    copy = tmp_path / "copy.pth"
    copy.write_bytes(data)
    assert _identity(copy) == _identity(path)
    record = next(r for r in zipfile.ZipFile(path).infolist() if r.filename.endswith("/data/7"))
    name_length, extra_length = struct.unpack_from("<HH", data, record.header_offset + 26)
    weight_at = record.header_offset + 30 + name_length + extra_length
    for at in (weight_at, directory_at + 16):  # a weight's byte; the first record's CRC-32
        changed = bytearray(data)
        changed[at] ^= 0x01
        copy.write_bytes(bytes(changed))
        with pytest.raises(Damaged):
            _identity(copy)
        with pytest.raises(UserError, match=f"^{copy}: corrupt: .*CRC-32"):
            load(copy)

    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        for value in (1.0, 2.0):
            torch.save({"model": {"w": torch.full((4,), value)}}, tmp_path / f"{value}.pth")
    finally:
        torch.serialization.set_crc32_options(before)
    assert _identity(tmp_path / "1.0.pth") != _identity(tmp_path / "2.0.pth")
    assert torch.equal(load(tmp_path / "2.0.pth")["model"]["w"], torch.full((4,), 2.0))


@pytest.mark.parametrize("group", [False, True])
def test_the_stop_lands_after_the_step_or_with_peers_the_next(group, request):
    """A signal during step 3 of 10 (--log_every 20): one process stops after step 3; in a
    process group, where what is sent after step 3 is received after step 4, after step 4.
    Either way the epoch ends there, at any --log_every."""
    from ampkit.distributed import StopChannel, this_process
    from ampkit.engine import train_one_epoch
    from ampkit.stop import Stop, StopRequest
    from helpers.meters import meters_of
    from tools.variants import build_variant

    if group:
        request.getfixturevalue("gloo_of_one")
    info = this_process(torch.device("cpu"))
    assert info.distributed == group
    request, steps = StopRequest(), []

    def step(micro_batches):
        steps.append(1)
        if len(steps) == 3:
            request.ask("SIGTERM")
        return [torch.tensor(1.0)], torch.tensor(1.0)

    batches = [(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long))] * 10
    meters = meters_of(build_variant("train_without", torch.nn.Linear(1, 1)), info)
    stats = train_one_epoch(step, batches, info, meters=meters,
                            stop=Stop(request, StopChannel(info)), log_every=20)
    assert stats.stopped_at == len(steps) == (4 if group else 3)


def test_each_rank_and_each_gpu_draws_from_a_stream_of_its_own():
    """After the model: rank r's CPU stream (dropout, the classic path's flips) is its own,
    the same for the same seed; with CUDA every visible GPU's is its own too, or
    DataParallel's replicas would drop the same units of their chunks."""
    from ampkit.randomness import seed_streams

    draws = {}
    for rank in (0, 1, 0):
        seed_streams(7, rank, cuda=False)
        draws.setdefault(rank, []).append(torch.rand(4))
    assert torch.equal(draws[0][0], draws[0][1]) and not torch.equal(draws[0][0], draws[1][0])
    if torch.cuda.device_count() > 1:
        seed_streams(7, 0, cuda=True)
        seeds = {torch.cuda.default_generators[i].initial_seed()
                 for i in range(torch.cuda.device_count())}
        assert len(seeds) == torch.cuda.device_count()


def test_the_set_up_builds_one_model_and_gives_each_rank_a_stream_of_its_own():
    """Through the scripts' own set-up (``models.make_network``, from --seed): every rank
    builds the same weights, then draws its own dropout masks -- the same ones again for the
    same rank and seed."""
    import torch.nn.functional as F

    from types import SimpleNamespace

    from ampkit.distributed import DistInfo
    from ampkit.models import make_network

    weights, masks = [], []
    data = SimpleNamespace(num_classes=3, train_size=0)
    for rank in (0, 1, 0):
        info = DistInfo(torch.device("cpu"), rank=rank, world_size=2, distributed=True)
        network = make_network(FSDP_ARCH, data, info, seed=3)
        weights.append(network.state_dict())
        masks.append(F.dropout(torch.ones(256), p=0.5, training=True))
    assert all(torch.equal(w[k], weights[0][k]) for w in weights[1:] for k in weights[0])
    assert torch.equal(masks[0], masks[2]) and not torch.equal(masks[0], masks[1])
