"""This process's device: which one, what it cannot run, what it computes in, its clock sync
and memory peaks, by PyTorch's device-generic calls (``torch.accelerator``), and its peak
TFLOP/s.

- The device (``--device``, :func:`choose_device`): ``auto`` is the accelerator this machine
  has -- ``torch.accelerator.current_accelerator(check_available=True)``: CUDA (and ROCm,
  which PyTorch calls cuda), Intel's XPU or Apple's MPS -- else the CPU; a named one that is
  not there is one line. A process of a group takes ``<type>:LOCAL_RANK``.
- What a device cannot run is refused in one line (:func:`refuse_unsupported`): DataParallel
  is CUDA's; c10d, PyTorch's collectives, cannot move MPS tensors, so no DDP or FSDP2 there;
  no GradScaler where its kernels are missing or, on MPS, not yet trusted.
- What it computes in (:func:`resolve_amp_dtype`): float16 on an accelerator, bfloat16 on
  the CPU, bfloat16 only where the device has it natively; CUDA's fp32 math (TF32).
- ``synchronize`` before a clock is read; the peak memory of a period (reset at its start,
  read at its end): an accelerator's allocator peak (``torch.accelerator.memory``: what it
  handed out, not what it holds), where the device keeps one ("n/a" where not); on the
  CPU the peak resident memory (``VmHWM``), which Linux >= 4.0 lets a process reset
  through ``/proc/self/clear_refs``.
- One GPU's dense peak in the run's math (:func:`run_peak`), NVIDIA's datasheets' figures
  halved where they assume 2:4 sparsity: ``half`` fp16/bf16 on the tensor cores with fp32
  accumulation, as autocast computes; ``tf32`` fp32 convolutions and matmuls on the tensor
  cores; ``fp32`` the CUDA cores. The first pattern that matches
  ``torch.cuda.get_device_name()`` wins; a GPU not listed has none (``--peak_tflops``)."""
from __future__ import annotations

import contextlib
import re
import resource
import sys
from pathlib import Path
from typing import Optional, Tuple

import torch

from .errors import RankError, UserError


DEVICES = ("auto", "cuda", "xpu", "mps", "cpu")
NAMES = {"cuda": "CUDA (or ROCm) GPU", "xpu": "Intel XPU", "mps": "Apple MPS device",
         "cpu": "CPU"}


def accelerator() -> Optional[str]:
    """The type of this machine's accelerator that is there to use (None: none)."""
    found = torch.accelerator.current_accelerator(check_available=True)
    return found.type if found is not None else None


def device_type(choice: str) -> str:
    """``--device``'s type: ``auto`` -> this machine's accelerator, else ``cpu``; a named
    accelerator must be there (one line if not: a silent CPU run would be many times
    slower than the user asked for)."""
    there = accelerator()
    if choice == "auto":
        return there or "cpu"
    if choice != "cpu" and choice != there:
        sees = f"it has {NAMES[there]}s (--device {there})" if there else "it has no accelerator"
        raise UserError(f"--device {choice}: this machine has no {NAMES[choice]} that torch "
                        f"{torch.__version__.split('+')[0]} can use ({sees}); leave --device "
                        "out to use what it has, or give --device cpu")
    return choice


# GradScaler's own kernels: a build has them for a device, or it cannot scale losses there.
_SCALER_OPS = ("aten::_amp_foreach_non_finite_check_and_unscale_", "aten::_amp_update_scale_")


def refusal(kind: str, *, data_parallel: bool = False, process_group: bool = False,
            loss_scaling: bool = False) -> Optional[str]:
    """Why a script cannot run on a device of type ``kind`` (None if it can): with
    ``data_parallel``, ``process_group`` (DDP, FSDP2) or ``loss_scaling`` (a GradScaler)."""
    if data_parallel and kind not in ("cuda", "cpu"):
        return (f"nn.DataParallel is CUDA's: it cannot replicate over {NAMES[kind]}s; "
                "train_DDP*.py runs one process per device")
    if process_group and kind == "mps":
        return ("DDP and FSDP2 cannot run on MPS: c10d, PyTorch's collectives, cannot move "
                "MPS tensors; train_without.py or train_autocast.py run on it")
    if loss_scaling and kind == "mps":
        return ("torch.amp.GradScaler on MPS: its kernels (torch 2.8 on) had silent-correctness "
                "fixes merged as late as June 2026 (pytorch#184286: fp16 gradients zeroed, "
                "#186360: fused AdamW ignoring a skipped step); on MPS, train_autocast.py "
                "(--amp_dtype bfloat16 needs no scaler)")
    # Looked up in this build's dispatcher (torch has no public call that says it).
    if loss_scaling and not all(torch._C._dispatch_has_kernel_for_dispatch_key(
            op, kind.upper()) for op in _SCALER_OPS):
        return (f"torch {torch.__version__.split('+')[0]} has no GradScaler kernels for "
                f"{NAMES[kind]}s: train_autocast.py, or --amp_dtype bfloat16 without a scaler")
    return None


def choose_device(choice: str, local_rank: Optional[int] = None) -> torch.device:
    """The device of ``--device`` ``choice`` (:func:`device_type`); a process of a group
    (``local_rank``: torchrun's LOCAL_RANK) takes its own, ``<type>:LOCAL_RANK``."""
    kind = device_type(choice)
    if local_rank is None or kind == "cpu":
        return torch.device(kind)
    count = torch.accelerator.device_count()
    if local_rank >= count:
        # Only ranks past the device count find this, never rank 0: each says it itself.
        raise RankError(f"LOCAL_RANK {local_rank} but only {count} {NAMES[kind]}(s) are "
                        "visible: start at most one process per device")
    return torch.device(kind, local_rank)


def refuse_unsupported(device: torch.device, *, data_parallel: bool = False,
                       process_group: bool = False, loss_scaling: bool = False) -> None:
    """One line if ``device`` cannot run the script: with DataParallel, in a process group
    (DDP, FSDP2), or with a GradScaler (``loss_scaling``)."""
    why = refusal(device.type, data_parallel=data_parallel, process_group=process_group,
                  loss_scaling=loss_scaling)
    if why is not None:
        raise UserError(why)


# The profiler's name (torch.profiler.record_function) for each read of the device's figures
# by the host: a training epoch's only host syncs, every --log_every steps and at its end.
HOST_READ = "ampkit: host read"


def pinned(device: torch.device) -> bool:
    """Whether host buffers for copies from/to ``device`` are pinned (page-locked: the copy
    runs asynchronously): on CUDA and XPU; MPS shares the host's memory, the CPU is it."""
    return device.type in ("cuda", "xpu")


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.accelerator.current_device_index()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock); a no-op on the CPU."""
    if device.type != "cpu":
        torch.accelerator.synchronize(_index(device))


def _devices(device: torch.device, all_devices: bool) -> range:
    """The accelerator indices a period's peak covers (``all_devices``: DataParallel's)."""
    return range(torch.accelerator.device_count()) if all_devices else range(
        _index(device), _index(device) + 1)


def reset_peak_memory(device: torch.device, all_gpus: bool = False) -> bool:
    """Start a new peak: the memory in use now. ``all_gpus``: every visible device (as
    DataParallel uses them). False where the peak cannot be reset."""
    if device.type != "cpu":
        try:
            for i in _devices(device, all_gpus):
                torch.accelerator.reset_peak_memory_stats(i)
            return True
        # A device whose allocator keeps no statistics has no peak to reset.
        except (RuntimeError, NotImplementedError, AttributeError):
            return False
    try:
        # "5" resets Linux's peak RSS (VmHWM) to the current RSS.
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory_mb(device: torch.device, all_gpus: bool = False) -> Optional[float]:
    """Peak memory since the last :func:`reset_peak_memory`: what the accelerator's
    allocator handed out (``all_gpus``: the largest over the visible devices; None where
    the device keeps no such figure), or peak RSS on the CPU."""
    if device.type != "cpu":
        try:
            peak = max(torch.accelerator.max_memory_allocated(i)
                       for i in _devices(device, all_gpus))
        except (RuntimeError, NotImplementedError, AttributeError):
            return None
        # A device whose allocator keeps no statistics answers 0: a training period always
        # holds its weights.
        return peak / 2**20 if peak > 0 else None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def memory_kind(device: torch.device, reset: bool = True) -> str:
    """What :func:`peak_memory_mb` measures, for logs and tables."""
    if device.type != "cpu":
        return f"{device.type}_allocated"
    return "max_rss" if reset else "max_rss_since_start"


# ---- what the device computes in
def resolve_amp_dtype(name: Optional[str], device: torch.device, *,
                      data_parallel: bool = False) -> torch.dtype:
    """``--amp_dtype``, or the device's default: float16 on an accelerator (its fast low
    precision: CUDA's and ROCm's tensor cores, XPU's, MPS's), bfloat16 on the CPU (where
    CPU autocast supports float16 only for some operators). A dtype the device cannot
    compute in is one line. ``data_parallel``: the run replicates over every visible GPU
    (DataParallel on CUDA), and each must compute in it."""
    if name is None:
        name = "bfloat16" if device.type == "cpu" else "float16"
    dtype = getattr(torch, name)
    replicas = [device]
    if data_parallel and device.type == "cuda":
        replicas = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for replica in replicas:
        if dtype is torch.bfloat16 and not _bf16_supported(replica):
            module = torch.get_device_module(replica.type)
            what = (module.get_device_name(_index(replica))
                    if hasattr(module, "get_device_name") else f"this {replica.type} device")
            raise UserError(f"--amp_dtype bfloat16: {what} does not support bfloat16 (use "
                            "--amp_dtype float16)")
    return dtype


def _bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` itself -- not the current device, which a process of a group has
    not set yet when it decides its dtype -- computes in bfloat16 natively, by the rule
    ``is_bf16_supported(including_emulation=False)`` applies to the current one: ROCm
    always, CUDA from compute capability 8 (Ampere; a V100 or T4 only emulates it, slower
    than float32), an XPU with bfloat16 conversions. MPS computes in bfloat16 from macOS 14
    on, and an older one refuses a bfloat16 tensor."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return bool(torch.version.hip) or torch.cuda.get_device_properties(
            _index(device)).major >= 8
    if device.type == "xpu":
        return bool(torch.xpu.get_device_properties(_index(device)).has_bfloat16_conversions)
    try:
        torch.ones(1, dtype=torch.bfloat16, device=device).add_(1)
        return True
    except (RuntimeError, TypeError):
        return False


def cpu_has_fast_bf16() -> Optional[bool]:
    """True/False from the CPU flags (AVX512-BF16 or AMX), None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def slow_bf16(dtype: Optional[torch.dtype], device: torch.device) -> Optional[str]:
    """A warning when a run computes in bfloat16 on a CPU without native bfloat16."""
    if dtype is torch.bfloat16 and device.type == "cpu" and cpu_has_fast_bf16() is False:
        return ("this CPU has no native bfloat16 (AVX512-BF16/AMX): CPU autocast will be "
                "several times slower than fp32 here")
    return None


def set_tf32(enabled: Optional[bool]) -> str:
    """Apply --tf32 / --no-tf32 to CUDA's fp32 convolutions and matmuls; None keeps PyTorch's
    defaults. Returns what fp32 math then is, for labels: on Ampere and newer GPUs TF32
    (10-bit mantissa) is several times faster than fp32, so an "fp32" baseline is only
    fp32 where it says so.

    Convolutions take cuDNN's ``fp32_precision`` (torch >= 2.9; the legacy ``allow_tf32``
    flags warn there). Matmuls take ``torch.set_float32_matmul_precision``, not
    ``torch.backends.cuda.matmul.fp32_precision``: after the latter, reading the matmul
    precision (``torch.get_float32_matmul_precision()``, as inductor's autotuning cache
    does under --compile) raises on torch 2.14, the former keeps every reading consistent."""
    if enabled is not None:
        conv = getattr(torch.backends.cudnn, "conv", None)
        # torch 2.9 on; earlier releases have allow_tf32 alone.
        if conv is not None and hasattr(conv, "fp32_precision"):
            conv.fp32_precision = "tf32" if enabled else "ieee"
        else:
            torch.backends.cudnn.allow_tf32 = enabled
        torch.set_float32_matmul_precision("high" if enabled else "highest")
    return {True: "tf32", False: "fp32"}.get(enabled, "tf32 conv, fp32 matmul")


def set_cuda_math(tf32: Optional[bool], device: torch.device) -> str:
    """A run's CUDA math: ``set_tf32(tf32)``, and cuDNN picks its convolution kernels for
    the run's fixed input size; the fp32 math's label ("" off CUDA, where --tf32 and
    --no-tf32 would change nothing: refused in one line)."""
    if device.type != "cuda":
        if tf32 is not None:
            flag = "--tf32" if tf32 else "--no-tf32"
            raise UserError(f"{flag} chooses CUDA's fp32 math (TF32 tensor cores or full "
                            f"fp32); this run is on the {device.type}, whose fp32 is fp32: "
                            "leave it out")
        return ""
    torch.backends.cudnn.benchmark = True
    return set_tf32(tf32)


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
    # The first row that matches, on whole words: a longer name stands above its prefix
    # ("H100 NVL" above "H100"), and an "RTX A1000" is no A100.
    for row in PEAKS:
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
                                        "device.py): the epoch lines give TFLOP/s without a "
                                        "share of the peak; --peak_tflops gives one")
    return peak, note


def fp32_peak_math(fp32_math: str) -> str:
    """Which peak an fp32 run's figures are against, from its math label
    (``device.set_tf32``): TF32 where its convolutions run in TF32 (they do most of the
    work of a CNN; PyTorch's default keeps matmuls in fp32), fp32 where nothing does."""
    return "fp32" if fp32_math == "fp32" else "tf32"
