"""Gradient accumulation under DDP and FSDP2 against a one-process reference, under torchrun.

    torchrun --nproc_per_node=2 tests/helpers/accum_check.py

Every rank builds the same small network (MobileNet V3: same seed, eval mode: no dropout,
BatchNorm on its running statistics, so each image's gradient is its own). The reference takes
the whole global batch of 8 x world size in one backward pass, in one process. DDP and FSDP2
(each through its training script's own build() and train_step) take one optimizer step over
4 micro-batches of 4, 1, 2 and 1 images on each rank, and FSDP2 one step over its 8 images
at once: their gradients must be the reference's (the mean over the global batch: not the
mean of the micro-batches' means, which would weigh a lone image 4 times a batch of 4's,
nor a sum over the ranks). DDP must all-reduce once for that step, not once per
micro-batch (counted by a hook of the check's own); FSDP2 must not reduce-scatter before the last
micro-batch: until then the sharded parameters hold no gradient. Prints the figures;
exits 1 on a mismatch.
"""
import copy
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "AMP"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

from ampkit.models import build_model  # noqa: E402
from tools.variants import build_variant  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = build_model("mobilenet_v3_small", 3).eval()
gen = torch.Generator().manual_seed(1)
images = torch.randn(8 * world, 3, 64, 64, generator=gen)
targets = torch.randint(0, 3, (8 * world,), generator=gen)
mine = slice(8 * rank, 8 * rank + 8)
cuts = [0, 4, 5, 7, 8]  # micro-batches of 4, 1, 2 and 1 images
window = [(images[mine][a:b], targets[mine][a:b]) for a, b in zip(cuts, cuts[1:])]

reference = copy.deepcopy(model)
nn.functional.cross_entropy(reference(images), targets).backward()
want = {name: p.grad for name, p in reference.named_parameters()}


def worst(grads) -> float:
    assert grads.keys() == want.keys(), sorted(set(want) ^ set(grads))
    return max(((grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
               for name, g in want.items())


class Probe(nn.CrossEntropyLoss):
    """The loss, which also notes, as each micro-batch's loss is computed, whether the
    model's sharded parameters hold a gradient yet (from the micro-batches before it)."""

    def __init__(self) -> None:
        super().__init__()
        self.model, self.reduced = None, []

    def forward(self, outputs, targets):
        self.reduced.append(any(p.grad is not None for p in self.model.parameters()))
        return super().forward(outputs, targets)


rounds = []


def counted(state, bucket):
    """DDP's all-reduce of a bucket (PyTorch's own hook), its rounds counted."""
    rounds.extend([1] if bucket.index() == 0 else [])
    return default_hooks.allreduce_hook(state, bucket)


ddp = build_variant("train_DDP", copy.deepcopy(model))
ddp.model.register_comm_hook(None, counted)  # --comm_hook none: the script registers none
ddp.train_step(window)
ddp_worst = worst({name.removeprefix("module."): p.grad for name, p in ddp.model.named_parameters()})

probe = Probe()
fsdp = build_variant("train_FSDP", copy.deepcopy(model), probe)
probe.model = fsdp.model
fsdp.train_step(window)
fsdp_worst = worst({name: p.grad.full_tensor() for name, p in fsdp.model.named_parameters()})

whole = build_variant("train_FSDP", copy.deepcopy(model))
whole.train_step([(images[mine], targets[mine])])
whole_worst = worst({name: p.grad.full_tensor() for name, p in whole.model.named_parameters()})

early = sum(probe.reduced)  # micro-batches that found gradients already reduced: 0
ok = len(rounds) == 1 and early == 0 and max(ddp_worst, fsdp_worst, whole_worst) < 1e-4
if rank == 0:
    print(f"DDP all-reduce rounds in one step of 4 micro-batches: {len(rounds)}; FSDP2 "
          f"micro-batches after a reduce-scatter: {early} of {len(probe.reduced)}; largest "
          f"relative gradient difference: DDP {ddp_worst:.2e}, FSDP2 {fsdp_worst:.2e}, "
          f"FSDP2 without accumulation {whole_worst:.2e}", flush=True)
# FSDP2's reference cycles hold gloo's work objects: collected at the interpreter's exit,
# they abort the process now and then (tests/helpers/group_check.py).
del fsdp, whole, probe
gc.collect()
dist.destroy_process_group()
sys.exit(0 if ok else 1)
