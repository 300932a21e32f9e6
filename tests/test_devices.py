"""Runs on the accelerator the user has: ``--device`` (auto: this machine's accelerator,
by ``torch.accelerator``, else the CPU), what each device cannot run refused in one line,
and the precision, the process group's backend and DataParallel's placement taken from the
device. The suite runs on the CPU: a machine with CUDA, XPU or MPS devices is pretended
(tests/helpers/machines.py, as Lightning's suite mocks the accelerators it does not own),
and the code's decisions on it are checked; no kernel runs on a pretended device. What a
device's kernels take is checked on the CPU by its rules: test_device_rules.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import torch.distributed as dist

from conftest import FAST_ARCH, quick_flags, run_main
from ampkit.device import (accelerator, choose_device, device_type, peak_memory_mb, refusal,
                           refuse_unsupported)
from ampkit.errors import RankError, UserError
from helpers.machines import pretend_machine


def single_process_device(choice: str, **what) -> torch.device:
    """As a one-process script takes its device: ``--device``, then what it cannot run."""
    device = choose_device(choice)
    refuse_unsupported(device, **what)
    return device


def process_device(choice: str, local_rank: int, **what) -> torch.device:
    """As a process of a group takes its device (torchrun's LOCAL_RANK)."""
    device = choose_device(choice, local_rank)
    refuse_unsupported(device, process_group=True, **what)
    return device


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
    from ampkit.device import resolve_amp_dtype

    assert resolve_amp_dtype(None, torch.device("cpu")) is torch.bfloat16
    kind = accelerator()
    if kind is not None:  # float16 on an accelerator, its fast low precision
        assert resolve_amp_dtype(None, torch.device(kind)) is torch.float16


# ------------------------------------------------------------------ a machine pretended
@pytest.mark.parametrize("kind, count", [("cuda", 2), ("xpu", 1), ("mps", 1), (None, 0)])
def test_auto_takes_the_accelerator_the_machine_has(kind, count, monkeypatch):
    pretend_machine(monkeypatch, kind, count)
    assert device_type("auto") == (kind or "cpu")
    assert single_process_device("auto") == torch.device(kind or "cpu")
    assert device_type("cpu") == "cpu"  # the CPU is always there
    for other in {"cuda", "xpu", "mps"} - {kind}:
        with pytest.raises(UserError, match=f"--device {other}: this machine has no"):
            device_type(other)


@pytest.mark.parametrize("kind, what, says", [
    ("xpu", dict(data_parallel=True), "nn.DataParallel is CUDA's"),
    ("mps", dict(data_parallel=True), "nn.DataParallel is CUDA's"),
    ("mps", dict(loss_scaling=True), "#186360"),
    ("xpu", dict(loss_scaling=True), "has no GradScaler kernels"),  # this build: no XPU's
])
def test_a_one_process_script_is_refused_what_its_device_cannot_run(kind, what, says,
                                                                    monkeypatch):
    pretend_machine(monkeypatch, kind, 1)
    with pytest.raises(UserError, match=says):
        single_process_device("auto", **what)
    assert single_process_device("cpu", **what) == torch.device("cpu")  # --device cpu runs


def test_a_cuda_machine_runs_every_one_process_script(monkeypatch):
    pretend_machine(monkeypatch, "cuda", 2)
    assert single_process_device("auto", data_parallel=True, loss_scaling=True).type == "cuda"


@pytest.mark.parametrize("kind, count, backend", [("cuda", 2, "nccl"), ("xpu", 2, "xccl"),
                                                  (None, 0, "gloo")])
def test_a_groups_process_takes_its_local_device_and_its_backend(kind, count, backend,
                                                                  monkeypatch):
    """torchrun's LOCAL_RANK picks the process's device; the group's backend is the
    device's: NCCL for CUDA, XCCL for XPU, gloo on the CPU."""
    pretend_machine(monkeypatch, kind, count)
    device = process_device("auto", local_rank=1 if kind else 0, loss_scaling=kind == "cuda")
    assert device == (torch.device(kind, 1) if kind else torch.device("cpu"))
    assert dist.get_default_backend_for_device(device) == backend
    if kind:  # one process per device, no more; said by the rank that finds it (never 0)
        with pytest.raises(RankError, match=f"LOCAL_RANK {count} but only {count}"):
            process_device("auto", local_rank=count)


def test_no_process_group_on_mps(monkeypatch):
    pretend_machine(monkeypatch, "mps", 1)
    with pytest.raises(UserError, match="cannot move MPS tensors"):
        process_device("auto", local_rank=0)
    assert process_device("cpu", local_rank=0) == torch.device("cpu")


@pytest.mark.parametrize("kind, count, scope", [("cuda", 2, "model"), ("cuda", 2, "features"),
                                               ("cuda", 1, "model"), ("xpu", 1, "model"),
                                               ("mps", 1, "model")])
def test_dataparallel_on_the_cpu_leaves_the_model_there_whatever_the_machine_has(
        kind, count, scope, monkeypatch, imagefolder_root, tmp_path):
    """nn.DataParallel looks at the machine, not at the model: built on a machine with GPUs
    it moves the model to the first (one GPU: the loss then meets the CPU's targets; two: "module
    must have its parameters and buffers on device cuda:0"). A DataParallel script with
    --device cpu builds none, and trains on the CPU."""
    import train_DP  # noqa: F401  (imported first: torch._dynamo's import asks the real CUDA)

    pretend_machine(monkeypatch, kind, count)
    # --dp_scope features: a network with .features (SqueezeNet's, smaller than AlexNet's).
    arch = "squeezenet1_1" if scope == "features" else FAST_ARCH
    res = run_main("train_DP", *quick_flags(imagefolder_root, tmp_path, batch_size=48, epochs=1,
                                            arch=arch, dp_scope=scope))
    assert res.returncode == 0, res.describe()
    assert "on cpu (DataParallel is CUDA's: on the cpu the model runs as it is)" in res.stdout
    assert "done: train_DP" in res.stdout


def test_dataparallel_wraps_the_model_on_cuda(monkeypatch):
    """On CUDA the DataParallel scripts wrap what they replicate: the model, or with
    --dp_scope features its convolutions alone."""
    from alexnet import alexnet
    from tools.variants import build_variant

    made = []

    class Recorded(torch.nn.Module):  # DataParallel on 2 GPUs, as far as build() can tell
        def __init__(self, module):
            super().__init__()
            self.module = module
            made.append(module)

    pretend_machine(monkeypatch, "cuda", 2)
    monkeypatch.setattr(torch.nn, "DataParallel", Recorded)
    for scope in ("model", "features"):
        net = alexnet(num_classes=3)
        replicated = net if scope == "model" else net.features
        model = build_variant("train_DP", net, dp_scope=scope, device=torch.device("cuda")).model
        wrapped = model if scope == "model" else model.features
        assert isinstance(wrapped, Recorded) and made[-1] is replicated
    cpu_net = alexnet(num_classes=3)
    assert build_variant("train_DP", cpu_net, device=torch.device("cpu")).model is cpu_net
    assert len(made) == 2


# A node of mixed GPUs: a V100 (bfloat16 emulated only, slower than float32) as device 0,
# an A100 as device 1.
MIXED_NODE = {"cuda": [SimpleNamespace(name="Tesla V100-SXM2-16GB", major=7),
                       SimpleNamespace(name="NVIDIA A100-SXM4-80GB", major=8)],
              "xpu": [SimpleNamespace(name="Intel(R) Iris(R) Xe Graphics",
                                      has_bfloat16_conversions=False),
                      SimpleNamespace(name="Intel(R) Data Center GPU Max 1550",
                                      has_bfloat16_conversions=True)]}


def pretend_mixed_node(monkeypatch, kind: str) -> None:
    """MIXED_NODE's GPUs of ``kind``, device 0 current (as in a process of a group before it
    sets its own); torch's ``is_bf16_supported`` answers, as torch's does, for the current
    device."""
    pretend_machine(monkeypatch, kind, 2)
    gpus, module = MIXED_NODE[kind], getattr(torch, kind)
    props = lambda device=None: gpus[getattr(device, "index", device) or 0]
    native = (lambda p: p.major >= 8) if kind == "cuda" else (
        lambda p: p.has_bfloat16_conversions)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(module, "current_device", lambda: 0)
    monkeypatch.setattr(module, "get_device_properties", props)
    monkeypatch.setattr(module, "get_device_name", lambda device=None: props(device).name)
    monkeypatch.setattr(module, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or native(gpus[0]))


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_each_rank_asks_its_own_gpu_for_bfloat16(kind, monkeypatch):
    """A process of a group decides its autocast dtype before it sets its device: on a node
    of mixed GPUs rank 1 gets its own GPU's answer (bfloat16), not device 0's; rank 0, on
    a GPU that only emulates bfloat16, is refused in one line naming it."""
    from ampkit.device import resolve_amp_dtype

    pretend_mixed_node(monkeypatch, kind)
    assert resolve_amp_dtype("bfloat16", process_device(kind, 1)) is torch.bfloat16
    with pytest.raises(UserError) as refused:
        resolve_amp_dtype("bfloat16", process_device(kind, 0))
    assert str(refused.value) == (f"--amp_dtype bfloat16: {MIXED_NODE[kind][0].name} does not "
                                  "support bfloat16 (use --amp_dtype float16)")
    assert resolve_amp_dtype(None, process_device(kind, 0)) is torch.float16


@pytest.mark.parametrize("script", ["train_DP_autocast", "train_DP_GradScaler", "eval_DP"])
def test_data_parallel_asks_every_gpu_it_replicates_to_for_bfloat16(script, monkeypatch,
                                                                    tmp_path):
    """DataParallel replicates over every visible GPU: on a node whose current GPU, device 0,
    is an A100 and whose device 1 is a V100, bfloat16 is one line naming the V100, not
    accepted on device 0's word and then emulated on the V100."""
    import importlib

    # Imported on this machine: torch's first import of dynamo reads the real one.
    importlib.import_module(script)
    monkeypatch.setitem(MIXED_NODE, "cuda", MIXED_NODE["cuda"][::-1])
    pretend_mixed_node(monkeypatch, "cuda")
    flags = ["--amp_dtype", "bfloat16", "--dataset", "FakeData", "--checkpoint", tmp_path]
    run = run_main(script, *flags, *(["--autocast"] if script.startswith("eval") else []))
    assert run.returncode == 2, run.describe()
    assert run.stderr.strip().endswith("--amp_dtype bfloat16: Tesla V100-SXM2-16GB does not "
                                       "support bfloat16 (use --amp_dtype float16)"), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("answer, peak", [(0, None), (3 * 2**20, 3.0)])
def test_a_device_without_allocator_statistics_has_no_peak(answer, peak, monkeypatch):
    """``torch.accelerator.max_memory_allocated`` answers 0 where the allocator keeps no
    statistics: "n/a", not a 0 MB peak."""
    pretend_machine(monkeypatch, "xpu", 1)
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda index=None: answer)
    assert peak_memory_mb(torch.device("xpu", 0)) == peak


@pytest.mark.parametrize("variant", ["train_without", "train_autocast", "train_GradScaler"])
def test_cuda_graphs_with_accumulation_are_refused_at_the_flags(variant, monkeypatch):
    """--compile reduce-overhead with --accum_steps 2: refused when the flags are read, on a
    pretended CUDA machine too (the crash it avoids is CUDA's, in the first optimizer step);
    one micro-batch per step stays accepted."""
    from ampkit.flags import parse_train_args

    pretend_machine(monkeypatch, "cuda", 1)
    with pytest.raises(UserError, match="takes one micro-batch per optimizer step"):
        parse_train_args(variant, ["--cuda", "--compile", "reduce-overhead", "--accum_steps", "2"])
    assert parse_train_args(variant, ["--cuda", "--compile", "reduce-overhead"]).accum_steps == 1
    assert parse_train_args(variant, ["--compile", "--accum_steps", "2"]).compile == "default"


def test_benchmark_refuses_cuda_graphs_with_accumulation_in_one_line(capsys):
    from tools.benchmark_flags import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--cuda", "--variants", "train_autocast", "--compile", "reduce-overhead",
                    "--accum_steps", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "takes one micro-batch per optimizer step" in err
    assert parse_args(["--cuda", "--variants", "train_autocast", "--compile",
                       "reduce-overhead"]).accum_steps == 1


@pytest.mark.parametrize("flags, says", [
    (["--tf32"], "--tf32 chooses CUDA's fp32 math"),
    (["--no-tf32"], "--no-tf32 chooses CUDA's fp32 math"),
    (["--dataset", "FakeData", "--num_workers", "2"], "--num_workers is for the classic"),
    (["--dataset", "FakeData", "--skip_bad_images"], "--skip_bad_images is for the classic"),
    (["--compile", "reduce-overhead"], "replays CUDA graphs: CUDA's alone, not the cpu's"),
    (["--compile", "reduce-overhead", "train_DDP"], "is for the one-device scripts"),
])
def test_a_flag_this_run_cannot_honour_is_one_line(flags, says, imagefolder_root, tmp_path):
    script, flags = ((flags[-1], flags[:-1]) if flags[-1].startswith("train_")
                     else ("train_without", flags))
    res = run_main(script, *quick_flags(imagefolder_root, tmp_path, epochs=1), *flags)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.describe()


@pytest.mark.parametrize("kind", ["cpu", "cuda", "xpu", "mps"])
def test_the_help_says_the_defaults_the_code_takes(kind, monkeypatch):
    """--amp_dtype's and --num_workers' help give the defaults that resolve_amp_dtype and the
    classic loader's default_workers take, on each kind of device."""
    from ampkit.data.classic import default_workers
    from ampkit.device import resolve_amp_dtype
    from ampkit.flags import train_parser

    helps = {a.dest: " ".join(a.help.split()) for a in train_parser("train_autocast")._actions}
    device = torch.device(kind)
    where = "the CPU" if kind == "cpu" else "an accelerator"
    dtype = str(resolve_amp_dtype(None, device))[len("torch."):]
    assert f"{dtype} on {where}" in helps["amp_dtype"], helps["amp_dtype"]
    assert f"{default_workers(None, device)} on {where}" in helps["num_workers"]


def test_the_header_reads_the_precision_and_dataparallel_from_the_objects():
    """The header's "MixedPrecisionPolicy" is FSDP2's policy object, "autocast" the autocast
    object's, "DataParallel is CUDA's" a DataParallel script's without a DataParallel: not the
    script's name, nor the absence of an autocast."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ampkit.distributed import DistInfo
    from ampkit.engine import Technique
    from ampkit.run import header_line

    data = SimpleNamespace(name="FakeData", train_size=8, val_size=4, num_classes=2,
                           image_shape=(3, 64, 64), batch_size=2, kind="fast")
    info, net = DistInfo(device=torch.device("cpu")), torch.nn.Linear(2, 2)

    def precision(variant, technique, **kw):
        line = header_line(variant, technique, data, info, accum_steps=1, clip_grad=None,
                           fp32_math="", **kw)
        return line.split("precision ")[1].split(",")[0], line

    plain = Technique(net, None, None)
    policy = Technique(net, None, None, mp_policy=MixedPrecisionPolicy(torch.bfloat16))
    autocast = Technique(net, None, None, torch.autocast("cpu", dtype=torch.bfloat16))
    assert precision("mine", policy)[0] == "MixedPrecisionPolicy (bfloat16)"
    assert precision("train_FSDP_mixed", plain)[0] == "fp32"
    assert precision("mine", autocast)[0] == "autocast (bfloat16)"
    assert precision("mine", plain)[0] == "fp32"
    note = "on cpu (DataParallel is CUDA's: on the cpu the model runs as it is)"
    assert note in precision("mine", plain, data_parallel=True)[1]
    assert "DataParallel" not in precision("train_DP", plain)[1]
