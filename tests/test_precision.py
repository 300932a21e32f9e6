"""In-process dtype checks: each variant's forward runs in the precision it names.

Each training script's ``build()`` makes its variant's objects. The autocast variants
must compute AlexNet in the low-precision dtype (bfloat16 on the CPU), also through
``nn.DataParallel`` and ``DistributedDataParallel``; the fp32 variants must stay float32.
``AlexNet.forward`` re-enters autocast itself (with the model's ``amp_dtype``, which the
DataParallel autocast scripts set), which is what keeps DataParallel's worker threads --
where the caller's thread-local autocast state is not active -- in the right dtype.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
from torch import nn

from alexnet import AlexNet, alexnet
from ampkit.engine import Technique
from ampkit.models import AutocastForward
from conftest import as_a_dataparallel_replica
from ampkit.device import resolve_amp_dtype
from tools.variants import ARTICLE_VARIANTS, TRAIN_VARIANTS, build_variant

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    """One AlexNet (3 classes) shared by the tests here: building one takes ~1 s."""
    torch.manual_seed(0)
    m = alexnet(num_classes=3).eval()
    yield m
    m.amp_dtype = None


@pytest.fixture(scope="module")
def images():
    torch.manual_seed(1)
    return torch.randn(2, 3, 64, 64)


@contextlib.contextmanager
def recording(model: nn.Module):
    """Record the dtypes of a conv activation, a hidden linear activation and the output."""
    seen = {}
    hooks = [model.features[0].register_forward_hook(lambda m, i, o: seen.__setitem__("conv1", o.dtype)),
             model.classifier[4].register_forward_hook(lambda m, i, o: seen.__setitem__("fc2", o.dtype))]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def build(variant: str, model: nn.Module, dp_scope: str = "model",
          amp_dtype: str = "bfloat16") -> Technique:
    """The variant's objects, as its training script's build() makes them; a DataParallel
    script's as on CUDA, where it wraps the model (on this machine without GPUs the
    DataParallel it builds calls the model as it is, in this thread)."""
    cuda = variant.startswith("train_DP") and not variant.startswith("train_DDP")
    with warnings.catch_warnings():  # CUDA's autocast and GradScaler, disabled without a GPU
        warnings.filterwarnings("ignore", ".*CUDA is not available", UserWarning)
        return build_variant(variant, model, amp_dtype=getattr(torch, amp_dtype),
                             dp_scope=dp_scope, lr=0.0,
                             device=torch.device("cuda" if cuda else "cpu"))


def bf16_ctx():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_cpu_default_amp_dtype_is_bfloat16():
    assert resolve_amp_dtype(None, CPU) is torch.bfloat16
    assert resolve_amp_dtype("float16", CPU) is torch.float16


@pytest.mark.parametrize("variant", sorted(ARTICLE_VARIANTS))
def test_variant_forward_dtype(variant, model, images, gloo_of_one):
    parallel, precision = TRAIN_VARIANTS[variant]
    want = torch.float32 if precision == "fp32" else torch.bfloat16
    v = build(variant, model)
    expected_wrapper = {"single": AlexNet, "dp": nn.DataParallel,
                        "ddp": nn.parallel.DistributedDataParallel}[parallel]
    assert type(v.model) is expected_wrapper
    assert (v.autocast is None) == (precision == "fp32")
    assert v.autocast is None or v.autocast.fast_dtype == want
    assert (v.scaler is not None) == (precision == "grad_scaler")
    assert v.optimizer.param_groups[0]["params"][0] is next(model.parameters())
    # The DataParallel autocast scripts wrap what is replicated, so that it re-enters autocast
    # in the replica threads; the others leave the precision to their visible autocast.
    replicated = v.model.module if parallel == "dp" else None
    assert isinstance(replicated, AutocastForward) == (parallel == "dp" and precision != "fp32")
    assert model.amp_dtype is None  # AlexNet's own re-entry is left alone
    with torch.no_grad(), recording(model) as seen, v.autocast or contextlib.nullcontext():
        out = v.model(images)
    assert out.shape == (2, 3)
    assert seen == {"conv1": want, "fc2": want}, variant
    assert out.dtype == want, variant


def test_forward_decorator_applies_dtype_without_outer_autocast(model, images):
    """No autocast around the call (as in a DP worker thread): the model enters it itself."""
    assert not torch.is_autocast_enabled("cpu")
    model.amp_dtype = torch.bfloat16
    try:
        with torch.no_grad(), recording(model) as seen:
            out = model(images)
    finally:
        model.amp_dtype = None
    assert out.dtype == torch.bfloat16
    assert seen == {"conv1": torch.bfloat16, "fc2": torch.bfloat16}
    assert not torch.is_autocast_enabled("cpu"), "forward leaked autocast into the caller"
    # amp_dtype None: plain fp32, as the fp32 variants need.
    with torch.no_grad():
        assert model(images).dtype == torch.float32


def test_forward_uses_the_dtype_chosen_at_run_time(model, images):
    """--amp_dtype float16 on the CPU: the decorator uses the model's dtype, not a fixed one."""
    model.amp_dtype = torch.float16
    try:
        with torch.no_grad(), recording(model) as seen:
            out = model(images)
    finally:
        model.amp_dtype = None
    assert out.dtype == torch.float16
    assert seen["fc2"] == torch.float16


def test_dtype_in_a_worker_thread_under_callers_autocast(model, images):
    """DataParallel runs replicas in threads; autocast state is thread-local and a thread
    does not inherit the caller's dtype. The decorated forward must still run in bf16."""
    results = {}

    def worker():
        with torch.no_grad():
            results["plain_linear"] = nn.Linear(4, 2)(torch.randn(1, 4)).dtype
            results["alexnet"] = model(images).dtype

    model.amp_dtype = torch.bfloat16
    try:
        with bf16_ctx():
            t = threading.Thread(target=worker)
            t.start()
            t.join()
    finally:
        model.amp_dtype = None
    # Control: the thread really is outside the caller's autocast ...
    assert results["plain_linear"] == torch.float32
    # ... and the model still computes in bf16 there.
    assert results["alexnet"] == torch.bfloat16


@pytest.mark.parametrize("arch,dp_scope", [("alexnet", "model"), ("alexnet", "features"),
                                           ("mobilenet_v3_small", "model"),
                                           ("mobilenet_v3_small", "features"),
                                           pytest.param("vgg11", "features",
                                                        marks=pytest.mark.slow)])
def test_what_dataparallel_replicates_keeps_the_run_dtype(arch, dp_scope):
    """DataParallel's workers call what it replicates -- the model, or model.features alone
    with --dp_scope features -- under ``autocast(device_type, enabled=True)``, which takes
    the thread's default dtype, not the caller's. Whatever is replicated must still compute
    in the run's dtype, for any --arch with a features block. float16 on the CPU, where the
    default is bfloat16, makes the difference visible."""
    from ampkit.models import build_model

    torch.manual_seed(0)
    net = build_model(arch, 3).eval()
    model = build("train_DP_autocast", net, dp_scope=dp_scope, amp_dtype="float16").model
    dp = model.features if dp_scope == "features" else model
    assert isinstance(dp, nn.DataParallel)
    seen = {}
    first_conv = next(m for m in net.features.modules() if isinstance(m, nn.Conv2d))
    first_conv.register_forward_hook(lambda m, i, o: seen.__setitem__("conv", o.dtype))
    default, _ = as_a_dataparallel_replica(dp.module, torch.randn(2, 3, 64, 64), torch.float16)
    assert default == torch.bfloat16  # control: the thread's own default dtype
    assert seen["conv"] == torch.float16


def test_dataparallel_wrapper_keeps_bf16_without_outer_autocast(model, images):
    model.amp_dtype = torch.bfloat16
    try:
        with torch.no_grad(), recording(model) as seen:
            out = nn.DataParallel(model)(images)
    finally:
        model.amp_dtype = None
    assert out.dtype == torch.bfloat16
    assert seen["conv1"] == torch.bfloat16


def test_fp32_model_stays_fp32_under_dataparallel(model, images):
    with torch.no_grad(), recording(model) as seen:
        out = nn.DataParallel(model)(images)
    assert out.dtype == torch.float32
    assert seen == {"conv1": torch.float32, "fc2": torch.float32}


def test_amp_dtype_is_not_saved_in_the_state_dict():
    """amp_dtype is a plain attribute: checkpoints of fp32 and AMP runs are interchangeable."""
    with torch.device("meta"):
        fp32, amp = AlexNet(num_classes=3), AlexNet(num_classes=3, amp_dtype=torch.bfloat16)
    assert fp32.state_dict().keys() == amp.state_dict().keys()
    assert all(v.dtype == torch.float32 for v in amp.state_dict().values())


@pytest.mark.slow  # a process of its own: the settings are process-wide
def test_tf32_flags_stay_readable_after_set_tf32():
    """--tf32/--no-tf32 set TF32 so that every later reading of the matmul precision works:
    inductor's autotuning (--compile) calls torch.get_float32_matmul_precision(), which
    raises on torch 2.14 after torch.backends.cuda.matmul.fp32_precision is set. (In a
    process of its own: these are process-wide settings.)"""
    from conftest import AMP_DIR
    from helpers.processes import PYTHON, run

    read = ("print(torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32, "
            "torch.backends.cudnn.conv.fp32_precision)")
    code = (f"import sys; sys.path.insert(0, {str(AMP_DIR)!r}); import torch; "
            f"from ampkit.device import set_tf32; set_tf32(True); {read}; "
            f"set_tf32(False); {read}")
    res = run([PYTHON, "-c", code], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == "high True tf32 highest False ieee".split()


@pytest.mark.slow
def test_compile_runs_the_backward_outside_autocast():
    """The loops call backward() outside autocast; a compiled backward must too (torch's AMP
    notes: backward_pass_autocast "off"; the default runs it under the forward's autocast)."""
    from torch._functorch import config

    from ampkit.models import compile_in_place

    before = config.backward_pass_autocast
    try:
        assert before == "same_as_forward"  # torch's default
        compile_in_place(nn.Linear(2, 2))  # compiles lazily: at its first call, not here
        assert config.backward_pass_autocast == "off"
    finally:
        config.backward_pass_autocast = before


@pytest.mark.slow
def test_the_compiled_step_trains_as_the_eager_one():
    """--compile on the CPU (inductor): over a few steps of train_autocast's own step, the
    compiled model's losses and gradient norms are the eager one's within bfloat16's
    tolerance (inductor fuses and reorders, and bfloat16 rounds at other points)."""
    import copy

    from ampkit.models import compile_in_place

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    eager = build_variant("train_autocast", copy.deepcopy(net), amp_dtype=torch.bfloat16, lr=1e-2)
    compiled = build_variant("train_autocast", net, amp_dtype=torch.bfloat16, lr=1e-2)
    compile_in_place(compiled.model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        batch = [(torch.randn(8, 3, 16, 16, generator=gen),
                  torch.randint(0, 3, (8,), generator=gen))]
        [want], want_norm = eager.train_step(batch)
        [got], got_norm = compiled.train_step(batch)
        assert got.item() == pytest.approx(want.item(), rel=2e-2)
        assert got_norm.item() == pytest.approx(want_norm.item(), rel=5e-2)
    assert type(compiled.model).__name__ == "Sequential" and compiled.model._compiled_call_impl


def test_cuda_graphs_are_cudas_alone():
    """--compile reduce-overhead captures CUDA graphs: one line off CUDA."""
    from ampkit.errors import UserError
    from ampkit.models import compile_in_place

    with pytest.raises(UserError, match="replays CUDA graphs: CUDA's alone, not the cpu's"):
        compile_in_place(nn.Linear(2, 2), mode="reduce-overhead")
