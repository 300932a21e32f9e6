"""Gradient accumulation (--accum_steps) and clipping (--clip_grad), as the scripts do them:
one optimizer step over K micro-batches is the step over their union, a short last window
is weighted by what it holds, GradScaler unscales once before clipping, DDP all-reduces
once a step, and a stop mid-window saves whole steps only."""
from __future__ import annotations

import copy
import signal

import pytest
import torch
from torch import nn

from conftest import REPO_ROOT, quick_flags, run_main
from helpers.processes import PYTHON, run, torchrun

CPU = torch.device("cpu")


def _build(script: str, model, **kw):
    """The script's own build() of ``model`` (its technique, on the CPU)."""
    from tools.variants import build_variant

    return build_variant(script, model, **kw)


def _batches(n: int, size: int, px: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, px, px, generator=gen), torch.randint(0, 3, (size,), generator=gen))
            for _ in range(n)]


def _grads(model) -> list:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _close(a: list, b: list, rtol: float) -> bool:
    assert len(a) == len(b) and a, (len(a), len(b))  # every gradient compared, and some
    return all(((x - y).abs().max() / y.abs().max().clamp(min=1e-12)).item() <= rtol
               for x, y in zip(a, b))


def test_micro_batches_of_4_and_1_make_the_step_of_their_union():
    """One device: one optimizer step over micro-batches of 4 images and 1 gives the
    gradients, loss, norm and weights of one step over the 5 at once: each micro-batch's
    loss weighs by its share of the images (the mean of the two micro-batches' means would
    give the lone image 4 times its weight). AlexNet without dropout, in float64: in
    float32 the kernels of one CPU round a batch of 4 and one of 5 differently enough to
    move a ReLU or a max-pool's pick now and then, a test of the hardware, not of the
    step."""
    from alexnet import alexnet

    torch.manual_seed(0)
    model = alexnet(num_classes=3).eval().double()
    for i in (1, 4):  # the two 4096-wide layers (95% of the weights) as they are: quicker
        model.classifier[i].requires_grad_(False)
    twin = copy.deepcopy(model)
    window = [(x.double(), y) for x, y in _batches(1, 5, 64)]
    window = [(window[0][0][:4], window[0][1][:4]), (window[0][0][4:], window[0][1][4:])]
    accumulated = _build("train_without", model)
    losses, norm = accumulated.train_step(window)
    whole = _build("train_without", twin)
    [whole_loss], whole_norm = whole.train_step([(torch.cat([x for x, _ in window]),
                                                  torch.cat([y for _, y in window]))])
    # The step's loss, as the loop makes it of the micro-batches' means: by their images.
    loss = sum(part.item() * len(y) for part, (_, y) in zip(losses, window)) / 5
    assert _close(_grads(model), _grads(twin), 1e-10)
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters()))
    assert moved <= 1e-6 * accumulated.optimizer.param_groups[0]["lr"], moved
    assert loss == pytest.approx(whole_loss.item(), rel=1e-12)
    assert norm.item() == pytest.approx(whole_norm.item(), rel=1e-10)


def test_a_short_last_window_is_weighted_as_what_it_holds():
    """5 micro-batches with K = 2: steps over 2, 2 and 1; the last one's gradient is that one
    micro-batch's mean loss's, not half of it."""
    from ampkit.distributed import DistInfo
    from ampkit.engine import train_one_epoch
    from helpers.meters import meters_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 3))
    t = _build("train_without", model)
    batches, sizes, want = _batches(5, 4, 16), [], []

    def step(window):
        sizes.append(len(window))
        if len(sizes) == 3:  # the reference: the last micro-batch alone, on today's weights
            twin = copy.deepcopy(model)
            nn.functional.cross_entropy(twin(window[0][0]), window[0][1]).backward()
            want.extend(_grads(twin))
        return t.train_step(window)

    stats = train_one_epoch(step, batches, DistInfo(device=CPU), meters=meters_of(t),
                            accum_steps=2)
    assert sizes == [2, 2, 1] and stats.steps == 3 and stats.images == 20
    assert _close(_grads(model), want, 1e-5), "the short window's gradient is not its own"


@pytest.mark.parametrize("accum_steps", [1, 3])
def test_clipped_gradients_with_a_scaler_are_those_without(accum_steps):
    """GradScaler (a fixed scale of 2**16) with --clip_grad: unscale_ once per step, then the
    clip, gives the gradients the same step gets without a scaler; K > 1 raises no
    "unscale_() has already been called"."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 3))
    twin = copy.deepcopy(net)
    window = [(100 * x, y) for x, y in _batches(accum_steps, 4, 16)]  # norms well above 0.5
    scaled = _build("train_GradScaler", net, clip_grad=0.5)
    scaled.scaler.load_state_dict(scaled.scaler.state_dict()
                                  | {"scale": 2.0 ** 16, "growth_interval": 10**6})
    plain = _build("train_autocast", twin, clip_grad=0.5)
    _, norm = scaled.train_step(window)
    _, plain_norm = plain.train_step(window)
    assert norm.item() == pytest.approx(plain_norm.item(), rel=1e-6) and norm.item() > 0.5
    assert _close(_grads(net), _grads(twin), 1e-6)
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in _grads(net)]))
    assert clipped.item() == pytest.approx(0.5, rel=1e-4), "the gradients were not clipped"
    assert scaled.scaler.get_scale() == 2.0 ** 16  # no step was skipped


@pytest.mark.parametrize("script", ["train_GradScaler", "train_DP_GradScaler",
                                    "train_DDP_GradScaler", "train_FSDP_GradScaler",
                                    "train_FSDP_mixed"])
def test_every_scaler_script_accumulates_and_clips_as_at_scale_one(script, gloo_of_one):
    """Each GradScaler script, one step over micro-batches of 4 and 1 images with
    --clip_grad 0.5: at a scale of 2**8 its gradients, norm and clipped step are those at a
    scale of 1 (a power of two scales exactly), so the scale comes off once per step, before
    the clip (a second unscale_ raises; none would clip the scaled gradients). FSDP2's own
    mixed precision takes the scaler in float16."""
    from ampkit.checkpoint.files import strip_prefixes

    dtype = torch.float16 if script == "train_FSDP_mixed" else None
    made = []
    for scale in (2.0 ** 8, 1.0):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                            nn.Flatten(), nn.Linear(8, 3))
        t = _build(script, net, clip_grad=0.5, amp_dtype=dtype)
        t.scaler.load_state_dict(t.scaler.state_dict()
                                 | {"scale": scale, "growth_interval": 10**6})
        batch = _batches(1, 5, 16)[0]
        _, norm = t.train_step([(10 * batch[0][:4], batch[1][:4]),
                                (10 * batch[0][4:], batch[1][4:])])
        grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for k, p in strip_prefixes(dict(t.model.named_parameters())).items()}
        made.append((norm.item(), grads, t.scaler.get_scale()))
    (norm, grads, scale), (norm1, grads1, _) = made
    assert scale == 2.0 ** 8, "a step was skipped"
    assert norm > 0.5 and norm == pytest.approx(norm1, rel=1e-3 if dtype else 1e-6)
    assert grads.keys() == grads1.keys() and grads
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert clipped.item() == pytest.approx(0.5, rel=1e-3), "the gradients were not clipped"
    # Unscaled and clipped as at scale 1 (float16: to its rounding, from the scale-1 run's).
    assert _close(list(grads.values()), list(grads1.values()), 1e-3 if dtype else 1e-6)


@pytest.mark.slow
def test_ddp_and_fsdp_accumulate_as_one_process_and_ddp_reduces_once_a_step():
    res = run(torchrun("--standalone", "--nproc_per_node=3", "tests/helpers/accum_check.py"),
              timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "all-reduce rounds in one step of 4 micro-batches: 1;" in res.stdout, res.stdout
    assert "micro-batches after a reduce-scatter: 0 of 4;" in res.stdout, res.stdout


def _adam_steps(path) -> int:
    state = torch.load(path, map_location="cpu", weights_only=True)["optimizer"]["state"]
    return int(next(iter(state.values()))["step"])


@pytest.mark.slow
def test_a_stop_mid_window_saves_whole_steps_and_resume_counts_every_step(imagefolder_root,
                                                                          tmp_path):
    """48 images, micro-batches of 8, K = 2: 3 optimizer steps an epoch. SIGTERM during the
    second step's first micro-batch: that step is finished, then saved (2 steps, no half
    window); --resume then ends with the 6 optimizer steps of an uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    run_dir = ckpt / "train_without"
    flags = quick_flags(imagefolder_root, ckpt, arch="resnet18", batch_size=8, accum_steps=2,
                        epochs=2)
    helper = REPO_ROOT / "tests" / "helpers" / "faulty_train.py"
    res = run([PYTHON, helper, "train_without", *flags], {"FAULT_SIGTERM_AT_LOSS": "3"},
              timeout=300)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-2000:]
    stopped = torch.load(run_dir / "last.pth", map_location="cpu", weights_only=True)
    assert (stopped["progress"]["epoch"], stopped["progress"]["step"]) == (0, 2)
    assert _adam_steps(run_dir / "last.pth") == 2
    res = run_main("train_without", *flags, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stdout and "step 2" in res.stdout
    assert _adam_steps(run_dir / "last.pth") == 6
