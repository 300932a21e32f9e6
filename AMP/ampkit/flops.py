"""How close a run comes to the hardware's peak: the FLOPs of a training image, and the
achieved TFLOP/s against one device's dense peak in the run's precision.

FLOPs (``training_flops_per_image``): one forward and backward on the meta device, counted by
PyTorch's own ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions; not the
optimizer, normalisation or activations, a rounding error of a CNN's work). The peaks are
NVIDIA's datasheets', dense (the headline figures assume 2:4 sparsity, which doubles them):
``half`` fp16/bf16 on the tensor cores with fp32 accumulation, as autocast computes; ``tf32``
fp32 convolutions and matmuls on the tensor cores; ``fp32`` the CUDA cores. The first pattern
that matches ``torch.cuda.get_device_name()`` wins; a GPU not listed has no peak (give one).
"""
from __future__ import annotations

import re
import warnings
from typing import Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from .models import build_model

PEAKS = (
    # (pattern, half, tf32, fp32)   source, with-sparsity figures halved
    ("H200 NVL", 835, 418, 60),     # H200 NVL datasheet: FP16 1,671 / TF32 835 sparse; FP32 60
    ("H200", 989, 495, 67),         # H200 SXM datasheet: FP16 1,979 / TF32 989 sparse; FP32 67
    ("H100 NVL", 835, 418, 60),     # H100 NVL datasheet: FP16 1,671 / TF32 835 sparse; FP32 60
    ("H100.*PCIe", 756, 378, 51),   # H100 PCIe datasheet: FP16 1,513 / TF32 756 sparse; FP32 51
    ("H100", 989, 495, 67),         # H100 SXM datasheet ("H100 80GB HBM3"): as the H200 SXM
    ("A100", 312, 156, 19.5),       # A100 datasheet, SXM and PCIe: FP16 624 / TF32 312 sparse
    ("L40S", 362, 183, 91.6),       # L40S datasheet: FP16 733 / TF32 366 sparse; FP32 91.6
    ("RTX 4090", 165, 82.6, 82.6),  # Ada whitepaper: FP16 with FP32 accumulate 330 sparse
)
MATHS = ("half", "tf32", "fp32")


def peak_tflops(gpu_name: str, math: str) -> Optional[float]:
    """One GPU's dense peak for ``math`` (``half``, ``tf32`` or ``fp32``); None if unknown."""
    column = MATHS.index(math) + 1
    for row in PEAKS:  # whole words: an "RTX A1000" is no A100
        if re.search(rf"\b{row[0]}\b", gpu_name):
            return float(row[column])
    return None


def run_peak(given: Optional[float], device: torch.device, amp_dtype: Optional[torch.dtype],
             fp32_math: str) -> Tuple[Optional[float], str]:
    """(one device's peak for a run's math, a note): ``given`` (``--peak_tflops``) if
    given; on CUDA the table's for the GPU and the math (``amp_dtype`` fp16/bf16, else
    ``fp32_math``); none on the CPU. The note, for a GPU the table lacks, says so once."""
    if given is not None or device.type != "cuda":
        return given, ""
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops(name, "half" if amp_dtype is not None else fp32_peak_math(fp32_math))
    note = "" if peak is not None else (f"no peak TFLOP/s known for {name} (ampkit/"
                                        "flops.py): the epoch lines give TFLOP/s without a "
                                        "share of the peak; --peak_tflops gives one")
    return peak, note


def achieved(flops: float, seconds: float, peak: Optional[float], devices: int) -> dict:
    """``{"tflops": achieved TFLOP/s, "utilisation": its share of peak x devices, or None}``."""
    tflops = flops / seconds / 1e12 if seconds > 0 else float("nan")
    return {"tflops": tflops, "utilisation": tflops / (peak * devices) if peak else None}


def fp32_peak_math(fp32_math: str) -> str:
    """Which peak an fp32 run's figures are against, from its math label
    (``precision.set_tf32``): TF32 where its convolutions run in TF32 (they do most of the
    work of a CNN; PyTorch's default keeps matmuls in fp32), fp32 where nothing does."""
    return "fp32" if fp32_math == "fp32" else "tf32"


def training_flops_per_image(model: nn.Module, image_shape: Tuple[int, ...],
                             batch: int = 2) -> float:
    """FLOPs of one training image: a forward and backward of ``batch`` images through the
    bare ``model`` (in eval mode), divided by ``batch``, counted on the meta device: the
    model's parameters and buffers are stood in for by meta tensors of their shapes
    (``torch.func.functional_call``), so nothing is computed, and no weight, gradient,
    running statistic or random stream of the model moves. (Counted by running the real
    model on the CPU, attention's fused kernel goes uncounted: ViT-B/16 at 224 px then
    shows 4 % fewer FLOPs.)"""
    was_training = model.training
    model.eval()
    try:
        state = {name: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
                 for name, p in model.named_parameters()}
        state |= {name: torch.empty_like(b, device="meta") for name, b in model.named_buffers()}
        images = torch.empty((batch, *image_shape), device="meta")
        counter = FlopCounterMode(display=False)
        with counter:
            functional_call(model, state, (images,)).float().sum().backward()
    finally:
        model.train(was_training)
    return counter.get_total_flops() / batch


def arch_flops_per_image(arch: str, num_classes: int, image_shape: Tuple[int, ...]) -> float:
    """:func:`training_flops_per_image` of ``arch`` with ``num_classes`` outputs, built on the
    meta device from its name: the run's own network may be sharded or wrapped by then."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an initialiser's warning about meta tensors
        network = build_model(arch, num_classes)
    return training_flops_per_image(network, image_shape)
