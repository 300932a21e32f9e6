"""How a run uses the hardware: FLOPs and the share of the peak, peak memory, profiler traces.

FLOPs (``training_flops_per_image``): one forward and backward on the meta device, counted by
PyTorch's own ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions; not the
optimizer, normalisation or activations, a rounding error of a CNN's work). The peaks are
NVIDIA's datasheets', dense (the headline figures assume 2:4 sparsity, which doubles them):
``half`` fp16/bf16 on the tensor cores with fp32 accumulation, as autocast computes; ``tf32``
fp32 convolutions and matmuls on the tensor cores; ``fp32`` the CUDA cores. The first pattern
that matches ``torch.cuda.get_device_name()`` wins; a GPU not listed has no peak (give one).

Peak memory, per period (reset at its start, read at its end): on a GPU
``torch.cuda.max_memory_allocated`` (what the caching allocator handed out, not what it
holds); on the CPU the peak resident memory (``VmHWM``), which Linux >= 4.0 lets a process
reset through ``/proc/self/clear_refs``. Without a reset the figure would be the peak since the
process started: the first epoch's cuDNN autotuning workspaces, say, in every later epoch's.

Traces (``--profile``, benchmark.py): a few steps after warm-up recorded by ``torch.profiler``,
a Chrome trace per rank (https://ui.perfetto.dev), and the operators that took the most time.
"""
from __future__ import annotations

import contextlib
import re
import resource
import sys
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.flop_counter import FlopCounterMode

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


def run_peak(given: Optional[float], device: torch.device, compute_dtype: Optional[torch.dtype],
             fp32_math: str) -> Tuple[Optional[float], str]:
    """(one device's peak for a run's math, a note): ``given`` (``--peak_tflops``) if
    given; on CUDA the table's for the GPU and the math (``compute_dtype`` fp16/bf16, else
    ``fp32_math``); none on the CPU. The note, for a GPU the table lacks, says so once."""
    if given is not None or device.type != "cuda":
        return given, ""
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops(name, "half" if compute_dtype is not None else fp32_peak_math(fp32_math))
    note = "" if peak is not None else (f"no peak TFLOP/s known for {name} (ampkit/machinery/"
                                        "hardware_use.py): the epoch lines give TFLOP/s without a "
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


def reset_peak_memory(device: torch.device, all_gpus: bool = False) -> bool:
    """Start a new peak: the memory in use now. ``all_gpus``: every visible GPU (as
    DataParallel uses them). False where the CPU's peak cannot be reset (not Linux)."""
    if device.type == "cuda":
        for i in (range(torch.cuda.device_count()) if all_gpus else [device]):
            torch.cuda.reset_peak_memory_stats(i)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
        return True
    except OSError:
        return False


def peak_memory_mb(device: torch.device, all_gpus: bool = False) -> float:
    """Peak memory since the last :func:`reset_peak_memory`: allocated on the GPU
    (``all_gpus``: the largest over the visible GPUs), or peak RSS on the CPU."""
    if device.type == "cuda":
        ids = range(torch.cuda.device_count()) if all_gpus else [device]
        return max(torch.cuda.max_memory_allocated(i) for i in ids) / 2**20
    return _host_peak_mb()


def memory_kind(device: torch.device, reset: bool = True) -> str:
    """What :func:`peak_memory_mb` measures, for logs and tables."""
    if device.type == "cuda":
        return "cuda_allocated"
    return "max_rss" if reset else "max_rss_since_start"


def _host_peak_mb() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


class StepProfiler:
    """``torch.profiler`` over training steps: ``wait`` steps skipped, ``warmup`` recorded and
    dropped (the profiler's own start-up), ``active`` recorded; then the Chrome trace is
    written to ``path`` and ``table`` holds the top operators by self time; ``say`` prints
    :meth:`report` at the end."""

    def __init__(self, path: Path, device: torch.device, wait: int = 1, warmup: int = 1,
                 active: int = 3, say: Optional[Callable[[str], None]] = None) -> None:
        self.say = say
        self.path, self.cuda, self.needed, self.table = Path(path), device.type == "cuda", \
            wait + warmup + active, ""
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # One recording cycle: acc_events changes nothing but the warning torch 2.11 gives.
        self.prof = profile(activities=activities, on_trace_ready=self._ready, acc_events=True,
                            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1))

    def _ready(self, prof) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        self.table = prof.key_averages().table(sort_by=sort, row_limit=12)

    def __enter__(self) -> "StepProfiler":
        self.prof.start()
        return self

    def step(self) -> None:
        self.prof.step()

    def __exit__(self, *exc) -> None:
        self.prof.stop()
        if self.say is not None and exc[0] is None:
            self.say(self.report())

    def report(self) -> str:
        """What to print once the steps are over."""
        if not self.table:
            return (f"--profile: fewer than the {self.needed} steps it records "
                    "(1 skipped, 1 warm-up, 3 traced): no trace written (more steps: a "
                    "smaller --batch_size)")
        return (f"{self.table}\ntrace: {self.path} (open it in https://ui.perfetto.dev or "
                "chrome://tracing)")
