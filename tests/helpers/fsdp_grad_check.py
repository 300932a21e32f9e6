"""FSDP2's gradients against a one-process reference, under torchrun (gloo on the CPU).

    torchrun --nproc_per_node=2 tests/helpers/fsdp_grad_check.py

Every rank builds the same AlexNet (same seed), keeps an unsharded copy as the reference,
and shards the other with train_FSDP.py's own build(). Each rank's forward/backward runs
on its half of a global batch; the reference runs on the whole batch in one process.
Data-parallel training must give the reference's gradients (the mean over the global
batch): a backend that summed the ranks' gradients instead of averaging them would give
twice as much. Prints the largest relative difference; exits 1 if it is not small.
"""
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "AMP"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import train_FSDP  # noqa: E402
from alexnet import alexnet  # noqa: E402
from ampkit.engine import Parts  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = alexnet(num_classes=3).eval()  # eval: no dropout, so both sides compute the same
reference = copy.deepcopy(model)
gen = torch.Generator().manual_seed(1)
images = torch.randn(4 * world, 3, 64, 64, generator=gen)
targets = torch.randint(0, 3, (4 * world,), generator=gen)

v = train_FSDP.build(Parts(torch.device("cpu"), model, nn.CrossEntropyLoss()))
mine = slice(4 * rank, 4 * rank + 4)
nn.functional.cross_entropy(v.model(images[mine]), targets[mine]).backward()
grads = {name: p.grad.full_tensor() for name, p in v.model.named_parameters()}  # all ranks

nn.functional.cross_entropy(reference(images), targets).backward()
worst = max(((grads[name] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)).item()
            for name, p in reference.named_parameters())
if rank == 0:
    print(f"largest relative gradient difference: {worst:.2e}", flush=True)
dist.destroy_process_group()
sys.exit(0 if worst < 1e-4 else 1)
