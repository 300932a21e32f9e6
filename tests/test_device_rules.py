"""Each device's rules, kept by the code that runs here on the CPU (tests/helpers/device_rules.py
watches every op and every copy): a run's training steps, its epoch's figures and its
evaluation take nothing MPS or CUDA would refuse or pay for -- no float64 tensor, no
non-blocking copy from pageable memory, no host sync in a step, every copy to the device
from pinned memory. What stays untested without the hardware: docs/devices.md."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from conftest import quick_flags, run_main
from helpers.device_rules import HOST_READ, as_on_cuda, device_rules, one_line
from helpers.machines import pretend_machine


# ------------------------------------------------------------------ the rules see a breach
def _float64():
    torch.ones(2).double()


def _pageable_non_blocking():
    torch.ones(2).to("cpu", non_blocking=True)


def _item_in_a_step():
    torch.ones(2, device=torch.device("cpu")).sum().item()


def _tolist_in_a_step():
    torch.ones(2, device=torch.device("cpu")).tolist()


def _pageable_copy_to_the_device():
    torch.ones(2).to(torch.device("cpu"))


@pytest.mark.parametrize("kind, code, says", [
    ("mps", _float64, "float64 tensor in aten::_to_copy"),
    ("mps", _pageable_non_blocking, "non_blocking copy (Tensor.to) from pageable memory"),
    ("cuda", _pageable_non_blocking, "non_blocking copy (Tensor.to) from pageable memory"),
    ("cuda", _item_in_a_step, "host sync (aten::_local_scalar_dense) in a step"),
    ("cuda", _tolist_in_a_step, "host sync (Tensor.tolist()) in a step"),
    ("cuda", _pageable_copy_to_the_device, "copy between host and device (Tensor.to) from "
                                            "pageable memory"),
])
def test_the_rules_see_a_breach(kind, code, says):
    with device_rules(kind) as rules, rules.window():
        code()
    assert len(rules.breaches) == 1 and says in rules.breaches[0], rules.breaches
    assert rules.breaches[0].endswith(f"test_device_rules.py:{code.__code__.co_firstlineno + 1}")


def test_the_rules_take_what_the_device_takes():
    """A host read in the engine's span; copies between host and device from pinned memory;
    host tensors read on the host; float32 and a blocking copy on MPS."""
    cpu = torch.device("cpu")
    with device_rules("cuda") as rules, rules.window():
        on_device = torch.ones(2, device=cpu)
        with torch.profiler.record_function(HOST_READ):
            on_device.sum().item()
        torch.ones(2).pin_memory().to(cpu, non_blocking=True)
        buf = torch.empty(2, pin_memory=True)
        buf.copy_(on_device, non_blocking=buf.is_pinned())
        torch.ones(2).tolist(), torch.ones(2).sum().item()  # host tensors: no device to wait for
        on_device.to(cpu, non_blocking=True)  # on the device already
    with device_rules("mps") as mps:
        torch.ones(2).to(cpu, non_blocking=False).float()
    assert rules.breaches == [] and mps.breaches == [] and mps.float64 == 0


# ------------------------------------------------------------------ MPS: a whole run
@pytest.mark.parametrize("script, dataset", [("train_autocast", "CIFAR10"),
                                             ("train_without", "ImageFolder"),
                                             pytest.param("train_DDP_GradScaler", "CIFAR10",
                                                          marks=pytest.mark.slow)])
def test_a_run_takes_nothing_mps_refuses(script, dataset, imagefolder_root, cifar_root,
                                         tmp_path):
    """A whole run -- set-up, its epoch, its figures, validation, the checkpoint and the
    evaluation of it -- creates no float64 tensor and makes no non-blocking copy from
    pageable memory, on the fast input path and the classic one. (MPS itself refuses a
    GradScaler and a process group; the float64 rule is some Intel GPUs' too.)"""
    importlib.import_module(script)
    # The smallest runs that take every path at 32 px: CIFAR-10's small files on the fast
    # path (one training batch, 11 test images), the ImageFolder on the classic one.
    root, subset = (cifar_root, 10) if dataset == "CIFAR10" else (imagefolder_root, None)
    with device_rules("mps") as rules:
        res = run_main(script, *quick_flags(root, tmp_path, dataset=dataset, img_size=32,
                                            batch_size=16, epochs=1, log_every=2,
                                            train_subset=subset))
        evaluated = run_main("eval_without", "--checkpoint",
                             tmp_path / script / "last.pth", "--device", "cpu")
    assert res.returncode == 0 and evaluated.returncode == 0, res.describe()
    assert rules.float64 == 0, one_line(rules.breaches)
    assert rules.breaches == [], one_line(rules.breaches)


# ------------------------------------------------------------------ CUDA: an epoch's steps
def _technique(script: str):
    from tools.variants import build_variant

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(4, 10))
    return build_variant(script, net, amp_dtype=torch.bfloat16)


@pytest.mark.parametrize("script, dataset, group", [
    ("train_GradScaler", "FakeData", False),
    ("train_DDP_autocast", "ImageFolder", True),
])
def test_an_epoch_and_its_evaluation_keep_cudas_rules(script, dataset, group, imagefolder_root,
                                                      monkeypatch):
    """The engine's epoch (the script's step, the figures, the stop vote of a group) and its
    evaluation on the fast path and the classic one, pinned where CUDA pins: no host sync
    but the engine's host reads, every copy to the device from pinned memory."""
    import torch.distributed as dist

    from ampkit.data import build_loaders
    from ampkit.data.order import one_process_sampler
    from ampkit.distributed import StopChannel, this_process
    from ampkit.stop import stopping
    from ampkit.engine import count_correct, train_one_epoch
    from helpers.meters import meters_of

    if group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        info = this_process(torch.device("cpu"))
        technique = _technique(script)
        with as_on_cuda(monkeypatch), device_rules("cuda") as rules:
            rules.on_device(technique.model)
            data = build_loaders(dataset, imagefolder_root, 32, 16, info)
            loader = data.train_loader(one_process_sampler(data.train_size, seed=0))
            with stopping(StopChannel(info), print, exiting=False) as vote:
                with rules.window():
                    stats = train_one_epoch(technique.train_step, loader, info, log_every=2,
                                            meters=meters_of(technique, info), stop=vote)
                    counts = count_correct(technique.model, data.val, info, technique.autocast)
    finally:
        if group:
            dist.destroy_process_group()
    assert stats.steps == -(-data.train_size // 16) and counts[1] == data.val_size
    assert rules.breaches == [], one_line(rules.breaches)


def test_pinned_memory_is_what_cuda_would_pin(monkeypatch):
    """The emulation itself: as on CUDA, the fast path pins its epoch's order and a
    DataLoader with pin_memory=True pins its batches."""
    from ampkit.distributed import DistInfo
    from ampkit.data.on_device import DeviceLoader

    pretend_machine(monkeypatch, None)
    loader = DeviceLoader(torch.zeros(8, 3, 4, 4, dtype=torch.uint8),
                          torch.zeros(8, dtype=torch.long), batch_size=4, img_size=4, device=torch.device("cpu"), train=True,
                          info=DistInfo(torch.device("cpu")))
    with as_on_cuda(monkeypatch), device_rules("cuda") as rules, rules.window():
        order, flips = loader._epoch_indices()
        assert rules.on(order) and rules.on(flips)  # sent to the device
    assert rules.breaches == [] and len(rules._pinned) == 2
