"""CUDA-only checks, skipped without a GPU: fp16 autocast on the GPU, training steps that
never sync the host, DataParallel over the visible GPUs, DDP over NCCL with one process.

Run them on a GPU machine with ``python -m pytest -q -m cuda``.
"""
from __future__ import annotations

import math
import threading

import pytest
import torch
from torch import nn

from conftest import IF_VAL_SIZE, assert_clean_stderr, parse_accuracy, run_script, tiny_args

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(dtype):
    from alexnet import alexnet
    torch.manual_seed(0)
    return alexnet(num_classes=3, amp_dtype=dtype).cuda().eval()


def _build(variant, model, amp_dtype=None, dp_scope="model"):
    """The variant's objects as its training script makes them, with the script's optimizer."""
    from tools.variants import build_variant

    model = model.to(torch.device("cuda", torch.cuda.current_device()))
    return build_variant(variant, model, amp_dtype=amp_dtype, dp_scope=dp_scope)


def test_gpu_default_autocast_is_float16():
    from ampkit.device import resolve_amp_dtype

    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = resolve_amp_dtype(None, dev)
    assert dtype is torch.float16
    model = _model(dtype)
    x = torch.randn(4, 3, 64, 64, device=dev)
    with torch.no_grad():
        with torch.autocast("cuda", dtype=dtype):
            assert model(x).dtype == torch.float16
        assert model(x).dtype == torch.float16  # the forward decorator alone
        model.amp_dtype = None
        assert model(x).dtype == torch.float32


@pytest.fixture
def nccl_of_one():
    """A one-process NCCL group on the current GPU, in-process."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("variant,dtype,vote", [("train_without", None, False),
                                                ("train_autocast", "float16", False),
                                                ("train_GradScaler", "float16", False),
                                                ("train_autocast", "bfloat16", False),
                                                ("train_GradScaler", "float16", True)])
def test_training_steps_never_sync_the_host(variant, dtype, vote, request):
    """The engine's hot loop with the training script's own step (fused AdamW, GradScaler,
    channels_last) under CUDA's sync debug mode "error": any per-step host sync (an
    .item(), a blocking copy, GradScaler reading its inf flag) raises. ``vote``: in an
    NCCL group, with the ranks' stop vote after every step (on its gloo group, a CPU
    tensor: reading it must not wait for the GPU)."""
    from ampkit.distributed import StopChannel, this_process
    from ampkit.stop import Stop
    from ampkit.engine import train_one_epoch
    from helpers.meters import meters_of
    from ampkit.stop import StopRequest

    if vote:
        request.getfixturevalue("nccl_of_one")

    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    dev = torch.device("cuda")
    cl = torch.channels_last
    torch.manual_seed(0)
    v = _build(variant, _model(None).train().to(memory_format=cl), amp_dtype=dtype)
    batches = [(torch.randn(16, 3, 96, 96, device=dev).contiguous(memory_format=cl),
                torch.randint(0, 3, (16,), device=dev)) for _ in range(8)]
    checked = []

    def stream():  # steps 0-1 warm up (lazy state, cuDNN); steps 2-7 run in "error" mode
        for i, batch in enumerate(batches):
            if i == 2:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            if i >= 2:
                checked.append(i)
            yield batch
        torch.cuda.set_sync_debug_mode("default")  # before the epoch-end reduction

    try:
        info = this_process(dev)
        assert info.distributed == vote
        stats = train_one_epoch(v.train_step, stream(), info, log_every=1000,
                                meters=meters_of(v, info),
                                stop=Stop(StopRequest(), StopChannel(info)) if vote else None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert checked == [2, 3, 4, 5, 6, 7]
    assert stats.steps == 8 and stats.images == 8 * 16 and math.isfinite(stats.loss)


@pytest.mark.parametrize("dp_scope", ["model", "features"])
def test_dataparallel_replicas_keep_the_amp_dtype(dp_scope):
    """Replicas run in worker threads that get autocast's enabled flag but not its dtype
    (float16 by default on CUDA): bf16 must still be bf16 there, with either --dp_scope.
    Through DataParallel's own parallel_apply with two replicas on GPU 0, whose threads
    fail on one GPU too when the re-entry is gone (DataParallel itself calls a lone
    replica in the caller's thread); with several GPUs, also through DataParallel itself
    on every one of them."""
    from torch.nn.parallel import parallel_apply

    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16: nothing tells it from float16 here")
    n, dtype = torch.cuda.device_count(), torch.bfloat16
    model = _model(None)
    seen, lock = [], threading.Lock()

    def hook(module, inputs, output):
        with lock:
            seen.append((output.device, output.dtype))

    model.features[0].register_forward_hook(hook)  # conv1 runs in the replicas with either scope
    dp = _build("train_DP_autocast", model, "bfloat16", dp_scope).model
    wrapper = dp if dp_scope == "model" else dp.features
    assert wrapper.device_ids == list(range(n))
    x = torch.randn(2 * n, 3, 64, 64, device="cuda")
    control = nn.Conv2d(3, 2, 3).cuda()  # a module without the re-entry, beside them
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        outs = parallel_apply([wrapper.module, wrapper.module, control], [(x,), (x,), (x,)],
                              devices=[0, 0, 0])
    assert outs[2].dtype == torch.float16  # the threads' own default: the test can tell
    assert seen == [(x.device, dtype)] * 2, seen
    if n > 1:
        seen.clear()
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            assert dp(x).dtype == dtype
        assert {d for d, _ in seen} == {torch.device("cuda", i) for i in range(n)}
        assert all(t == dtype for _, t in seen), seen


def test_train_dp_autocast_on_visible_gpus(tmp_path, imagefolder_root):
    n = torch.cuda.device_count()
    result = run_script("train_DP_autocast", *tiny_args(tmp_path, imagefolder_root, cuda=True))
    assert result.returncode == 0, result.describe()
    assert_clean_stderr(result.stderr)
    assert " on cuda" in result.stdout and f"x{n} GPUs" in result.stdout, result.stdout
    assert "(float16)" in result.stdout, result.stdout
    assert (tmp_path / "checkpoint" / "train_DP_autocast" / "last.pth").is_file()


def test_ddp_nccl_one_process_plain_python(tmp_path, imagefolder_root):
    """`python AMP/train_DDP_autocast.py --cuda`: NCCL group of one on cuda:0, then eval."""
    result = run_script("train_DDP_autocast", *tiny_args(tmp_path, imagefolder_root, cuda=True))
    assert result.returncode == 0, result.describe()
    assert_clean_stderr(result.stderr)
    assert "on cuda:0 x1 processes over nccl" in result.stdout, result.stdout
    assert "(float16)" in result.stdout, result.stdout
    ckpt = tmp_path / "checkpoint" / "train_DDP_autocast" / "last.pth"
    assert ckpt.is_file()
    ev = run_script("eval_DDP", "--checkpoint", ckpt, "--cuda", "--autocast")
    assert ev.returncode == 0, ev.describe()
    assert parse_accuracy(ev.stdout)[1] == IF_VAL_SIZE
