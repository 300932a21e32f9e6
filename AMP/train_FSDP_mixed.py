"""Train with FSDP2 (fully_shard) in its own mixed precision: MixedPrecisionPolicy, no autocast.

    torchrun --nproc_per_node=2 AMP/train_FSDP_mixed.py --epochs 20     # float16 (CUDA's default)
    torchrun --nproc_per_node=2 AMP/train_FSDP_mixed.py --amp_dtype bfloat16

Several nodes (the same command on every node; HOST_OF_NODE0: the first node's address):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE0:29400 --rdzv-id=alexnet-amp AMP/train_FSDP_mixed.py

How this differs from autocast (train_FSDP_autocast.py): autocast decides per operator,
as each one runs, and keeps float32 weights around it. MixedPrecisionPolicy decides per
block: when FSDP2 gathers a block's parameters, it casts them to param_dtype (--amp_dtype),
so the all-gather moves half the bytes and the whole block computes in that dtype,
normalisation and softmax included; gradients are reduce-scattered in reduce_dtype
(float32 here, as torchtitan trains) and the sharded parameters and AdamW stay float32.
The root's output is cast back to float32, so the loss is computed in float32.

Pitfall: float16 still needs loss scaling (the scaler is on for float16, off for
bfloat16). Buffers are not cast: BatchNorm's float32 running statistics cannot run beside
bf16/fp16 weights, so networks with BatchNorm (ResNets...) take train_FSDP_autocast.py.
--batch_size is per process.
The rest of the run (data, validation, checkpoints, logs, resume) is ampkit.train.Trainer;
`python AMP/train_FSDP_mixed.py --help` lists the flags.
"""
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ampkit.engine import Parts, Variant
from ampkit.machinery.errors import report_user_errors
from ampkit.models import check_param_dtype_fits, shard_units
from ampkit.train import Trainer


def build(parts: Parts) -> Variant:
    check_param_dtype_fits(parts.model, parts.arch)  # BatchNorm: no (its statistics are fp32)
    dtype, fp32 = parts.amp_dtype, torch.float32
    for block in shard_units(parts.model):  # each layer or residual block, then the root
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=fp32))
    model = fully_shard(parts.model, mp_policy=MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=fp32, output_dtype=fp32))
    criterion, optimizer = parts.criterion, parts.optimizer  # AdamW over this process's shards
    scaler = torch.amp.GradScaler(parts.device.type, enabled=dtype == torch.float16)

    def train_step(images, targets):
        loss = criterion(model(images), targets)  # each block computes in param_dtype
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # float16: gradients of loss x scale; bfloat16: as is
        scaler.step(optimizer)         # unscales them; skips the step if any is inf/NaN
        scaler.update()
        return loss

    return Variant(model, train_step, scaler=scaler if scaler.is_enabled() else None,
                   param_dtype=dtype)


@report_user_errors
def main(argv=None):
    Trainer("train_FSDP_mixed", argv, ddp=True).fit(build)


if __name__ == "__main__":
    main()
