"""DDP's communication hooks through the training scripts' own build() and step, under torchrun.

    torchrun --nproc_per_node=3 tests/helpers/wire_check.py

Every rank builds the same small network (MobileNet V3, its dropout seeded alike) and takes
optimizer steps over windows of unequal micro-batches (4, 1, 2 and 1 images on rank 0; 1, 3
and 2 on the others), through the scripts' own build():
- with --comm_hook bf16 (train_DDP.py) and fp16 (train_DDP_GradScaler.py: fp16 needs the
  scaled gradients, or the smallest flush to zero) the gradients after a step must be those
  of the fp32 all-reduce (--comm_hook none) to the wire dtype's precision, tensor by tensor,
  and not bit for bit (the hook did cast); one all-reduce round a step; half the bytes;
- with powersgd (rank 1, warm-up of 2 steps) under train_DDP_GradScaler.py, a step whose
  input holds an inf (an overflow on every rank's gradients) is skipped, and every later
  step trains: none skipped, finite losses, PowerSGD's error feedback and Q finite;
- PowerSGD's error feedback under a changing scale (a small network of two buckets, lr 0
  and one window every step, so the true gradient is the same at every step): the
  gradients applied are the same whether the scale stays or doubles at every step, and
  after an overflow in one bucket on a step of another batch their running mean tracks
  the fp32 all-reduce's gradient as closely as before it;
- train_FSDP_mixed.py (a small network without BatchNorm) with --reduce_dtype bfloat16 /
  float16, over 3 micro-batches of the same (the
  micro-batches' gradients add up in that dtype): every gradient after the step (float16:
  scaled back by the GradScaler it brings) is a value of the reduce dtype (what crossed the
  wire), and the float32 reduce's to its precision.
Prints the figures; exits 1 on a mismatch.
"""
import copy
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "AMP"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import train_DDP  # noqa: E402
import train_DDP_GradScaler  # noqa: E402
from ampkit.comm_hooks import CommHook  # noqa: E402
from tools.variants import build_variant  # noqa: E402
from ampkit.models import build_model  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = build_model("mobilenet_v3_small", 3)
gen = torch.Generator().manual_seed(1 + rank)
cuts = [0, 4, 5, 7, 8] if rank == 0 else [0, 1, 4, 6]  # unequal windows, unequal ranks
images = torch.randn(cuts[-1], 3, 64, 64, generator=gen)
targets = torch.randint(0, 3, (cuts[-1],), generator=gen)
window = [(images[a:b], targets[a:b]) for a, b in zip(cuts, cuts[1:])]
failures = []


def one_step(script, hook):
    torch.manual_seed(5)  # the same dropout in every run, on every rank
    t = build_variant(script.__name__, copy.deepcopy(model), amp_dtype=torch.bfloat16,
                      comm_hook=hook)
    t.train_step(window)
    return {name: p.grad.clone() for name, p in t.model.named_parameters()}


def worst(grads, want) -> float:
    return max(((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
               for n, g in want.items())


lines = []
for name, script, tolerance in (("bf16", train_DDP, 1.5e-2),
                                ("fp16", train_DDP_GradScaler, 2e-3)):
    fp32, hook = None, CommHook(name)  # None: DDP's own all-reduce
    want = one_step(script, fp32)
    diff = worst(one_step(script, hook), want)
    fp32_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # DDP's own
    lines.append(f"{script.__name__}: none {fp32_bytes} bytes; "
                 f"{name}: {hook.bytes_sent} bytes ({hook.bytes_sent / fp32_bytes:.3f} "
                 f"of fp32), {hook.rounds} round, largest relative difference {diff:.2e}")
    if not (0 < diff < tolerance) or hook.rounds != 1 or 2 * hook.bytes_sent != fp32_bytes:
        failures.append(name)

# PowerSGD under GradScaler: 2 warm-up steps, 2 compressed, one overflow, then 4 more.
hook = CommHook("powersgd", powersgd_rank=1, start_iter=2, seed=0)
t = build_variant("train_DDP_GradScaler", copy.deepcopy(model), amp_dtype=torch.bfloat16,
                  comm_hook=hook)
torch.manual_seed(5)
skipped, losses, per_step = 0, [], []
poisoned = [(images.clone().index_put_((torch.tensor(0),), torch.tensor(float("inf"))),
             targets)] if rank == 0 else window
for step in range(9):
    before = hook.bytes_sent
    scale = t.scaler.get_scale()
    batches = poisoned if step == 4 else window
    step_losses, _ = t.train_step(batches)
    skipped += t.scaler.get_scale() < scale  # update() halves the scale after a skipped step
    per_step.append(hook.bytes_sent - before)
    # The step's loss: its micro-batches' means, weighted by their images.
    losses.append(sum(loss.item() * len(y) for loss, (_, y) in zip(step_losses, batches))
                  / sum(len(y) for _, y in batches))
    if step == 4 and t.scaler.get_scale() >= scale:
        failures.append("the overflowing step was not skipped")
after = losses[5:]
memory = list(hook.state.error_dict.values()) + list(hook.state.q_memory_dict.values())
finite_memory = all(torch.isfinite(m).all().item() for m in memory)
lines.append(f"powersgd: bytes per step {per_step}, skipped {skipped} of 9, "
             f"losses after the overflow {[round(v, 3) for v in after]}, memory finite "
             f"{finite_memory}")
if skipped != 1 or not all(map(torch.isfinite, torch.tensor(after))) \
        or not finite_memory or not per_step[3] < per_step[0]:
    failures.append("powersgd")


# PowerSGD's error feedback, followed through a changing scale. Two DDP buckets (the last
# linear layers fill the first, 1 MB); lr 0 and no dropout: the true gradient is the same at
# every step. Step OVERFLOW trains on another batch (x50, other labels) whose first conv
# weight's gradient is inf on rank 0: the step is skipped, and what its finite bucket left
# in the error feedback was never applied.
torch.manual_seed(0)
two_buckets = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(),
                                          nn.Conv2d(8, 16, 3, stride=2), nn.ReLU()),
                            nn.Flatten(), nn.Sequential(nn.Linear(16 * 15 * 15, 96), nn.ReLU(),
                                                        nn.Linear(96, 3)))
other = [(50 * x, (y + 1) % 3) for x, y in window]
STEPS, OVERFLOW = 24, 10


def applied_gradients(name: str, growth_interval: int) -> torch.Tensor:
    """The gradients the optimizer got, step by step (the skipped step's left out)."""
    # "none": DDP's own all-reduce, no hook at all.
    hook = None if name == "none" else CommHook(name, powersgd_rank=1, start_iter=2, seed=0)
    t = build_variant("train_DDP_GradScaler", copy.deepcopy(two_buckets), lr=0.0,
                      amp_dtype=torch.bfloat16, comm_hook=hook)
    t.scaler.load_state_dict(t.scaler.state_dict() | {"growth_interval": growth_interval})
    first, applied = next(t.model.parameters()), []
    for step in range(STEPS):
        poison = (first.register_hook(lambda g: torch.full_like(g, float("inf")))
                  if step == OVERFLOW and rank == 0 else None)
        t.train_step(other if step == OVERFLOW else window)
        if poison is not None:
            poison.remove()
        grads = torch.cat([p.grad.flatten() for p in t.model.parameters()])
        if torch.isfinite(grads).all() and step >= 2:  # compressed, and applied
            applied.append(grads.clone())
    return torch.stack(applied)


true = applied_gradients("none", 2000)[0]
steady, doubling = applied_gradients("powersgd", 2000), applied_gradients("powersgd", 1)
invariance = ((steady - doubling).norm(dim=1) / steady.norm(dim=1)).max().item()
means = torch.cumsum(doubling, 0) / torch.arange(1, len(doubling) + 1).view(-1, 1)
tracking = ((means - true).norm(dim=1) / true.norm()).tolist()
before = tracking[OVERFLOW - 3]  # the running mean just before the overflow
lines.append(f"powersgd error feedback: steady scale vs doubling every step, largest relative "
             f"difference {invariance:.1e}; running mean against the fp32 gradient "
             f"{[round(e, 3) for e in tracking]} (the overflow after {OVERFLOW - 2})")
if not invariance < 1e-4 or max(tracking[OVERFLOW - 2:]) > 1.5 * before \
        or tracking[-1] > 1.1 * before:
    failures.append("powersgd error feedback")


torch.manual_seed(0)  # without BatchNorm, which train_FSDP_mixed.py leaves to autocast
small = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(),
                                    nn.Conv2d(8, 16, 3, stride=2), nn.ReLU()),
                      nn.Flatten(), nn.Sequential(nn.Linear(16 * 15 * 15, 64), nn.ReLU(),
                                                  nn.Linear(64, 3)))


def fsdp_step(reduce_dtype: torch.dtype) -> dict:
    t = build_variant("train_FSDP_mixed", copy.deepcopy(small), amp_dtype=torch.bfloat16,
                      reduce_dtype=reduce_dtype)
    t.train_step(window[:3])  # as many micro-batches on every rank: each forward gathers
    return {name: p.grad.full_tensor() for name, p in t.model.named_parameters()}, \
        t.scaler.get_scale() if t.scaler is not None else 1.0


want, _ = fsdp_step(torch.float32)
for dtype, tolerance in ((torch.bfloat16, 1.5e-2), (torch.float16, 2e-3)):
    grads, scale = fsdp_step(dtype)
    # As they crossed the wire: float16 brings a GradScaler, whose unscale_ divided them.
    of_dtype = all(bool(((g * scale).to(dtype).float() == g * scale).all())
                   for g in grads.values())
    fp32_of_dtype = all(bool((g.to(dtype).float() == g).all()) for g in want.values())
    diff = worst(grads, want)
    lines.append(f"FSDP2 reduce {str(dtype)[6:]}: gradients all {str(dtype)[6:]} values "
                 f"{of_dtype} (float32 reduce: {fp32_of_dtype}), largest relative "
                 f"difference {diff:.2e}")
    if not of_dtype or fp32_of_dtype or not diff < tolerance:
        failures.append(f"FSDP2 {dtype}")
if rank == 0:
    print("\n".join(lines + [f"FAILED: {failures}" if failures else "OK"]), flush=True)
# FSDP2's reference cycles hold gloo's work objects: collected at the interpreter's exit,
# they abort the process now and then (tests/helpers/group_check.py).
gc.collect()
dist.destroy_process_group()
sys.exit(1 if failures else 0)
