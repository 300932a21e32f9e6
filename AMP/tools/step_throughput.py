"""Steady-state step throughput of a variant: what ``AMP/benchmark.py`` times.

Each variant's own ``build()`` -- imported from its training script, so what is timed is the
script's wrapper, precision objects and step -- run by :func:`ampkit.engine.train_one_epoch`
over synthetic batches already on the device (no data loading timed). DDP and FSDP2
variants run as a one-process group, or in torchrun's (``DDPGroup``).

- ``warmup`` steps run first and are not counted (allocator, cuDNN autotuning,
  optimizer state creation, compilation, PowerSGD's plain all-reduce steps).
- The timed ``steps``: CUDA events on a GPU (the host waits for the end), else perf_counter;
  no host sync while timed (the loop's host read comes after the last step).
- Peak memory and FLOPs (:mod:`ampkit.device`, :mod:`ampkit.models`, as in training): the peak
  reset after warm-up; ``training_flops_per_image`` x batch per step;
  utilisation = achieved FLOP/s / (peak x devices), where the peak is the precision's
  own: ``peak_tflops`` (fp16/bf16) for the autocast variants, ``peak_tflops_fp32`` for
  the fp32 ones, whose math on CUDA is labelled (``fp32_math``: TF32 or true fp32).
- DDP's ``comm_hook`` (``--comm_hook`` of the DDP scripts): the bytes this rank sent per
  step, counted by :class:`ampkit.comm_hooks.CommHook` over the timed steps.

Traces: ``profile`` (a folder) records a few more steps (``ampkit.profiler.StepProfiler``).
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ampkit.checkpoint import Progress
from ampkit.comm_hooks import CommHook, wire_per_step
from ampkit.device import (choose_device, memory_kind, peak_memory_mb, reset_peak_memory,
                           resolve_amp_dtype, synchronize)
from ampkit.distributed import DistInfo, StopChannel, group_store, this_process, torchrun_ranks
from ampkit.engine import train_one_epoch
from ampkit.errors import UserError
from ampkit.meters import Meters
from ampkit.models import build_model, compile_in_place, training_flops_per_image
from ampkit.profiler import STEPS
from ampkit.run import RunLogger
from ampkit.stop import Stop, StopRequest

from .variants import DISTRIBUTED, TRAIN_VARIANTS, build_variant


@dataclass
class SyntheticData:
    """What the meters read of a run's data, for steps over synthetic batches: the batch and
    image size, the classes, no image left out."""
    batch_size: int
    num_classes: int
    image_shape: Tuple[int, ...]

    def global_batch(self, accum_steps: int, world_size: int) -> int:
        return self.batch_size * accum_steps * world_size

    def take_unreadable(self) -> list:
        return []


def step_meters(technique, info: DistInfo, data: SyntheticData, *, arch: Optional[str],
                profile_dir: Optional[Path] = None) -> Meters:
    """The run's meters over a loop of synthetic steps: a run's figures, nothing said (but
    --profile's table, on rank 0)."""
    return Meters(technique, data, info, RunLogger(info.is_main and profile_dir is not None),
                  progress=Progress(), arch=arch, accum_steps=1, profile_dir=profile_dir)


@dataclass
class StepResult:
    variant: str
    parallel: str
    precision: str
    amp_dtype: str
    arch: str
    device: str
    devices: int
    # Per micro-batch, and per process for DDP.
    batch_size: int
    img_size: int
    warmup: int
    # Optimizer steps, each of ``accum_steps`` micro-batches.
    steps: int
    accum_steps: int = 1
    channels_last: bool = False
    # torch.compile's mode ("": eager).
    compiled: str = ""
    # CUDA fp32 variants: "tf32", "fp32" or "tf32 conv, fp32 matmul".
    fp32_math: str = ""
    # DP variants: "model" or "features".
    dp_scope: str = ""
    seconds: Optional[float] = None
    step_ms: Optional[float] = None
    images_per_s: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    peak_mem_kind: str = ""
    gflop_per_step: Optional[float] = None
    achieved_tflops: Optional[float] = None
    # The fraction of the precision's peak times the devices.
    utilisation: Optional[float] = None
    # --busy: the share of the wall time in kernels.
    gpu_busy: Optional[float] = None
    # images/s over the fp32 row of its parallel mode.
    speedup: Optional[float] = None
    # DDP variants: --comm_hook, and what this rank's hook sent a step.
    comm_hook: str = ""
    wire_mb_per_step: Optional[float] = None
    timer: str = ""
    note: str = ""
    status: str = "ok"
    reason: str = ""

    def as_dict(self) -> Dict:
        return asdict(self)


class DDPGroup:
    """A one-process group for the DDP and FSDP2 variants (an in-memory store: no port),
    created on first use, closed at the end."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.info: Optional[DistInfo] = None

    def get(self) -> DistInfo:
        """The group: torchrun's when benchmark.py runs under it, else one of one process."""
        if self.info is None:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                rank, world_size, local_rank = torchrun_ranks()
                device = choose_device("cuda" if self.cuda else "cpu", local_rank)
                if self.cuda:
                    torch.accelerator.set_device_index(device.index)
                kw = dict(rank=rank, world_size=world_size, store=group_store(rank, world_size))
            else:
                device = torch.device("cuda", torch.cuda.current_device()) if self.cuda \
                    else torch.device("cpu")
                kw = dict(rank=0, world_size=1, store=dist.HashStore())
            dist.init_process_group(dist.get_default_backend_for_device(device),
                                    device_id=device.index, **kw)
            self.info = this_process(device)
        return self.info

    def close(self) -> None:
        if self.info is not None:
            dist.destroy_process_group()
            self.info = None


def _result(variant: str, device: torch.device, ddp: Optional[DDPGroup], **kw) -> tuple:
    """(DistInfo, an empty StepResult) for ``variant`` on ``device``."""
    parallel, precision = TRAIN_VARIANTS[variant]
    cuda = device.type == "cuda"
    if parallel in DISTRIBUTED:
        info = (ddp or DDPGroup(cuda)).get()
        devices, note = info.world_size, f"{parallel.upper()} as a {info.world_size}-process group"
    else:
        info = DistInfo(device=device)
        devices = torch.cuda.device_count() if parallel == "dp" and cuda else 1
        note = (f"DataParallel ({kw['dp_scope']}) over {devices} GPUs" if parallel == "dp" and cuda
                else "DataParallel calls the module directly without CUDA" if parallel == "dp"
                else "")
    if kw["compiled"] == "reduce-overhead" and parallel != "single":
        raise UserError("--compile reduce-overhead (CUDA graphs) is for one device: "
                        + ("DataParallel is not compiled" if parallel == "dp" else
                           f"{variant} is compiled without them by --compile"))
    if kw["compiled"] and parallel == "dp":
        kw["compiled"], note = "", note + "; not compiled (DataParallel)"
    if parallel != "dp":
        kw["dp_scope"] = ""
    res = StepResult(variant=variant, parallel=parallel, precision=precision, amp_dtype="",
                     arch=kw.pop("arch"), device=device.type, devices=devices, note=note,
                     timer="cuda events" if cuda else "perf_counter",
                     peak_mem_kind=memory_kind(device),
                     **kw)
    return info, res


def measure_variant(variant: str, *, device: torch.device, batch_size: int, img_size: int,
                    warmup: int, steps: int, amp_dtype: Optional[str] = None,
                    num_classes: int = 10, lr: float = 1e-4, arch: str = "alexnet",
                    peak_tflops: Optional[float] = None,
                    peak_tflops_fp32: Optional[float] = None, fp32_math: str = "",
                    ddp: Optional[DDPGroup] = None, channels_last: bool = False,
                    compile: Optional[str] = None, dp_scope: str = "model",
                    accum_steps: int = 1, keep_sync: bool = False,
                    profile: Optional[Path] = None, busy: bool = False,
                    comm_hook: str = "none", powersgd_rank: int = 1) -> StepResult:
    """Time ``steps`` optimizer steps of ``variant``'s own ``build()`` after ``warmup``
    uncounted ones, each of ``accum_steps`` micro-batches of ``batch_size`` (training flags:
    ``channels_last``, ``compile``, ``dp_scope``); ``keep_sync``: no DDP ``no_sync``;
    ``comm_hook``: --comm_hook (PowerSGD compresses from the third step: warm-up 2 or more);
    ``fp32_math`` labels fp32 on CUDA; ``profile``: a few more steps traced after the timing;
    ``busy`` (CUDA): 10 more, and their share of time in kernels (:func:`gpu_busy_share`)."""
    info, res = _result(variant, device, ddp, arch=arch, batch_size=batch_size,
                        img_size=img_size, warmup=warmup, steps=steps, accum_steps=accum_steps,
                        channels_last=channels_last, compiled=compile or "", dp_scope=dp_scope)
    if res.precision == "fp32" and device.type == "cuda":
        res.fp32_math = fp32_math
    if keep_sync:
        res.note += "; DDP all-reduces every micro-batch (no no_sync)"
    hook = None if comm_hook == "none" else CommHook(comm_hook, powersgd_rank=powersgd_rank,
                                                     start_iter=2)
    t, pool, flops = _built(variant, res, device, num_classes, lr, amp_dtype, hook)
    # Skipped steps counted and a stop asked on every step: a timed step costs a training one.
    data = SyntheticData(res.batch_size, num_classes, (3, res.img_size, res.img_size))
    meters, stop = step_meters(t, info, data, arch=res.arch), Stop(StopRequest(), StopChannel(info))

    def run(n: int, meters: Meters = meters, **kw):
        micro = [pool[i % len(pool)] for i in range(n * accum_steps)]
        with _all_reduce_every_micro_batch() if keep_sync else contextlib.nullcontext():
            return train_one_epoch(t.train_step, micro, info, meters=meters,
                                   accum_steps=accum_steps, stop=stop, **kw)

    if warmup > 0:
        run(warmup, desc=f"{variant} warm-up")
    _reset_peaks(device, res)
    if hook is not None:
        hook.reset_counts()
    # log_every past the last step: the loop's host read would sync while timed.
    seconds, stats = _timed(lambda: run(steps, desc=variant, log_every=steps + 1), device)
    res.peak_mem_mb = peak_memory_mb(device, all_gpus=res.parallel == "dp")
    res.seconds, res.images_per_s = seconds, stats.images / seconds
    res.step_ms = 1000.0 * seconds / steps
    res.gflop_per_step = flops * accum_steps * info.world_size / 1e9
    res.achieved_tflops = res.gflop_per_step * steps / seconds / 1e3
    if res.parallel == "ddp":
        res.comm_hook, wire = comm_hook, wire_per_step(t.model, hook)
        res.wire_mb_per_step = wire.get("wire_mb_per_step")
    if busy and device.type == "cuda":
        res.gpu_busy = gpu_busy_share(lambda: run(10, desc="busy", log_every=11), device)
    if profile is not None:
        profiling = step_meters(t, info, data, arch=res.arch, profile_dir=profile)
        run(STEPS, profiling, desc=f"{variant} profile")
    peak = peak_tflops_fp32 if res.precision == "fp32" else peak_tflops
    if peak:
        res.utilisation = res.achieved_tflops / (peak * res.devices)
    return res


def _built(variant: str, res: StepResult, device: torch.device, num_classes: int, lr: float,
           amp_dtype: Optional[str], hook: Optional[CommHook]) -> tuple:
    """(the variant's Technique, a pool of synthetic batches on the device, the FLOPs of one
    micro-batch's forward and backward)."""
    torch.manual_seed(0)
    fmt = torch.channels_last if res.channels_last else torch.contiguous_format
    model = build_model(res.arch, num_classes).to(device, memory_format=fmt)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    gen, b, px = torch.Generator().manual_seed(0), res.batch_size, res.img_size
    pool = [(torch.randn(b, 3, px, px, generator=gen).to(device, memory_format=fmt),
             torch.randint(0, num_classes, (b,), generator=gen).to(device))
            for _ in range(min(4, max(res.steps * res.accum_steps, 1)))]
    flops = training_flops_per_image(model, (3, px, px)) * b
    dtype = None if res.precision == "fp32" else resolve_amp_dtype(amp_dtype, device)
    t = build_variant(variant, model, device=device, lr=lr, amp_dtype=dtype,
                      dp_scope=res.dp_scope or "model", comm_hook=hook)
    res.amp_dtype = str(dtype)[6:] if dtype is not None else ""
    if res.compiled:
        # The compile itself happens in the warm-up steps, outside the clock.
        compile_in_place(t.model, mode=res.compiled)
    t.model.train()
    return t, pool, flops


def gpu_busy_share(steps, device: torch.device) -> float:
    """The share of ``steps()``'s wall time in which the GPU ran a kernel: the union of the
    kernels' intervals (torch.profiler's CUDA activity) over the wall time between two
    synchronizations. The rest the GPU waited for the host: Python, the dispatcher, the
    launches. (CUDA events around a step cannot tell: they span the waits inside it too.)"""
    from torch.profiler import ProfilerActivity, profile

    # No CUDA kernel to count, and the profiler refuses to record no activity at all.
    if device.type != "cuda":
        return 0.0
    # The CUDA activity alone: recording every host op too would slow the very host the
    # share measures, an eager step's ~170 ops more than a graph replay's few.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        synchronize(device)
        t0 = time.perf_counter()
        steps()
        synchronize(device)
        wall_us = 1e6 * (time.perf_counter() - t0)
    spans = [(e.device_type, e.time_range.start, e.time_range.end) for e in prof.events()]
    kernels = [(start, end) for kind, start, end in spans
               if kind == torch.autograd.DeviceType.CUDA]
    return min(covered_us(kernels) / wall_us, 1.0) if wall_us > 0 else 0.0


def covered_us(intervals) -> float:
    """The time that (start, end) intervals cover, each instant once: kernels of several
    streams overlap."""
    covered, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            covered += end - max(start, reached)
            reached = end
    return covered


@contextlib.contextmanager
def _all_reduce_every_micro_batch() -> Iterator[None]:
    """DDP's ``no_sync`` made a no-op: with --accum_steps, what the all-reduce of every
    micro-batch costs (for measuring only)."""
    real = DistributedDataParallel.no_sync
    DistributedDataParallel.no_sync = lambda self: contextlib.nullcontext()
    try:
        yield
    finally:
        DistributedDataParallel.no_sync = real


def _reset_peaks(device: torch.device, res: StepResult) -> None:
    synchronize(device)
    gc.collect()
    if not reset_peak_memory(device, all_gpus=True):
        res.peak_mem_kind = memory_kind(device, reset=False)


def _timed(fn, device: torch.device) -> tuple:
    """(seconds, fn()) timed with CUDA events on a GPU, perf_counter on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0, out
