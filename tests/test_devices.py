"""Runs on the accelerator the user has: ``--device`` (auto: this machine's accelerator,
by ``torch.accelerator``, else the CPU), what each device cannot run refused in one line,
and the precision and backend taken from the device. The suite runs on the CPU (and on
CUDA where ``bench/gpu_check.sh`` runs it): the generic code is the code the CPU runs here,
and no device is pretended to -- the rules are asked of device types, the lookups of this
build."""
from __future__ import annotations

import pytest
import torch

from conftest import FAST_ARCH, quick_flags, run_main
from ampkit.device import accelerator, device_type, refusal


def test_auto_is_this_machines_accelerator_else_the_cpu(imagefolder_root, tmp_path):
    found = torch.accelerator.current_accelerator(check_available=True)
    assert device_type("auto") == (found.type if found is not None else "cpu")
    res = run_main("train_autocast", *quick_flags(imagefolder_root, tmp_path, cuda=None,
                                                  batch_size=48, epochs=1),
                   "--device", "auto")
    assert res.returncode == 0, res.describe()
    assert f" on {accelerator() or 'cpu'}" in res.stdout, res.stdout


def test_cuda_and_no_cuda_spell_device_cuda_and_cpu():
    from ampkit.flags import parse_eval_args, parse_train_args

    assert parse_train_args("train_without", ["--no-cuda"]).device == "cpu"
    assert parse_train_args("train_without", ["--cuda"]).device == "cuda"
    assert parse_eval_args("eval_DDP", ["--device", "xpu"], process_group=True).device == "xpu"
    assert parse_train_args("train_without", []).device == "auto"


@pytest.mark.parametrize("kind, where, says", [
    ("xpu", dict(data_parallel=True), "nn.DataParallel is CUDA's"),
    ("mps", dict(data_parallel=True), "nn.DataParallel is CUDA's"),
    ("mps", dict(process_group=True), "cannot move MPS tensors"),
    ("mps", dict(loss_scaling=True), "#186360"),
])
def test_what_a_device_cannot_run_is_one_line(kind, where, says):
    assert says in refusal(kind, **where)


@pytest.mark.parametrize("kind, where", [
    ("cuda", dict(data_parallel=True, loss_scaling=True)),
    ("cpu", dict(data_parallel=True, loss_scaling=True)),  # DataParallel: a pass-through
    ("xpu", dict(process_group=True)),
    ("mps", dict()),
])
def test_what_a_device_can_run_is_not_refused(kind, where):
    assert refusal(kind, **where) is None


def test_a_gradscaler_needs_its_kernels_in_this_build():
    """Looked up in this build's dispatcher: the CPU has GradScaler's kernels (the CPU
    GradScaler scripts run here); a device whose kernels this build lacks is refused."""
    ops = ("aten::_amp_foreach_non_finite_check_and_unscale_", "aten::_amp_update_scale_")
    for kind in ("cpu", "cuda", "xpu"):
        has = all(torch._C._dispatch_has_kernel_for_dispatch_key(op, kind.upper()) for op in ops)
        assert (refusal(kind, loss_scaling=True) is None) == has, kind
    assert refusal("cpu", loss_scaling=True) is None


@pytest.mark.parametrize("script, flags", [
    ("train_DP", ["--device", "mps"]),
    ("train_DDP", ["--device", "xpu"]),
    ("eval_without", ["--device", "mps"]),
])
def test_a_device_that_is_not_there_is_one_line(script, flags, imagefolder_root, tmp_path):
    if accelerator() == flags[1]:
        pytest.skip(f"this machine has {flags[1]}")
    argv = (quick_flags(imagefolder_root, tmp_path, cuda=None) if script.startswith("train")
            else ["--checkpoint", str(tmp_path)])
    res = run_main(script, *argv, *flags)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.describe()
    assert f"--device {flags[1]}: this machine has no" in lines[0], lines


def test_the_autocast_dtype_is_the_devices():
    from ampkit.precision import resolve_amp_dtype

    assert resolve_amp_dtype(None, torch.device("cpu")) is torch.bfloat16
    kind = accelerator()
    if kind is not None:  # float16 on an accelerator, its fast low precision
        assert resolve_amp_dtype(None, torch.device(kind)) is torch.float16
