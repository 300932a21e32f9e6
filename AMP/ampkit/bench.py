"""Steady-state step throughput of the training variants, and of the input pipeline.

The model measurement runs the real training loop, :func:`ampkit.engine.train_one_epoch`,
over a list of synthetic batches already on the device (so no data loading is
timed), with each variant's own objects: AlexNet with its ``amp_dtype``, the
autocast factory and GradScaler of :mod:`ampkit.precision`, and the DP/DDP wrapper
of :func:`ampkit.train.wrap_model`. DDP variants run as a one-process group (world
size 1: the DDP machinery, gradient buckets and all-reduce hooks, on one device;
not multi-device scaling, which ``compare.py`` measures end to end).

- ``warmup`` steps run first and are not counted (allocator, cuDNN autotuning,
  optimizer state creation).
- The timed ``steps`` are clocked with CUDA events on a GPU (and the host waits for
  the end event), with ``time.perf_counter`` on the CPU; the engine itself
  synchronises the device before and after its loop.
- Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU (reset after warm-up);
  on the CPU the process's peak resident memory (``VmHWM``, reset through
  ``/proc/self/clear_refs`` before each variant where Linux allows, else ``ru_maxrss``,
  the peak since the process started).
- FLOPs per step are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one
  forward + backward of the bare model (matmuls and convolutions; the optimizer's
  element-wise work is not counted); utilisation = achieved FLOP/s divided by
  ``peak_tflops`` x devices.

The input pipeline is measured alone, by :func:`ampkit.pipeline_bench.measure_input_pipeline`
(:func:`measure_pipelines` only gathers its images/s into :class:`PipelineResult` rows):
images/s delivered to the device at ``img_size`` through ampkit's classic DataLoader path
(:mod:`ampkit.data`) and the fast device path (:mod:`ampkit.fastdata`), on CIFAR-10 when
the given root holds it, else on generated images in CIFAR-10's format.
"""
from __future__ import annotations

import gc
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from alexnet import alexnet

from .distributed import DistInfo, synchronize
from .engine import train_one_epoch
from .errors import UserError
from .precision import autocast_factory, make_scaler, resolve_amp_dtype
from .variants import TRAIN_VARIANTS


@dataclass
class StepResult:
    variant: str
    parallel: str
    precision: str
    amp_dtype: str
    device: str
    devices: int
    batch_size: int          # per step (per process for DDP)
    img_size: int
    warmup: int
    steps: int
    channels_last: bool = False
    compiled: bool = False
    dp_scope: str = ""       # DP variants: "model" or "features" (see train.wrap_model)
    seconds: Optional[float] = None
    step_ms: Optional[float] = None
    images_per_s: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    peak_mem_kind: str = ""
    gflop_per_step: Optional[float] = None
    achieved_tflops: Optional[float] = None
    utilisation: Optional[float] = None    # fraction of peak_tflops x devices
    timer: str = ""
    note: str = ""
    status: str = "ok"
    reason: str = ""

    def as_dict(self) -> Dict:
        return asdict(self)


@dataclass
class PipelineResult:
    path: str                # one of pipeline_bench.KINDS (benchmark.py: "classic", "fast")
    dataset: str             # "CIFAR10", or "CIFAR10 (generated, N)" images in its format
    img_size: int
    batch_size: int
    num_workers: int
    device: str
    images_per_s: Optional[float] = None
    batches: int = 0         # timed batches (after the uncounted warm-up ones)
    status: str = "ok"
    reason: str = ""

    def as_dict(self) -> Dict:
        return asdict(self)


# --------------------------------------------------------------------------- memory
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _reset_host_peak() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _host_peak_mb() -> float:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)



# --------------------------------------------------------------------------- FLOPs
def count_step_flops(model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                     criterion: nn.Module, autocast: Callable) -> int:
    """FLOPs of one forward + backward, counted by ``torch.utils.flop_counter``."""
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        with autocast():
            loss = criterion(model(images), targets)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


# --------------------------------------------------------------------------- model steps
class DDPGroup:
    """A one-process group for the DDP variants, created on first use, closed at the end."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.info: Optional[DistInfo] = None

    def get(self) -> DistInfo:
        if self.info is None:
            from .distributed import setup
            self.info = setup(True, self.cuda)
        return self.info

    def close(self) -> None:
        if self.info is not None:
            from .distributed import cleanup
            cleanup(self.info)
            self.info = None


def measure_variant(variant: str, *, device: torch.device, batch_size: int, img_size: int,
                    warmup: int, steps: int, amp_dtype: Optional[str] = None,
                    num_classes: int = 10, lr: float = 1e-4,
                    peak_tflops: Optional[float] = None, ddp: Optional[DDPGroup] = None,
                    log_every: int = 20, channels_last: bool = False, compile: bool = False,
                    dp_scope: str = "model") -> StepResult:
    """Time ``steps`` training steps of ``variant`` after ``warmup`` uncounted ones.

    ``channels_last``, ``compile`` and ``dp_scope`` are the training scripts' options of
    the same names; ``compile`` is not applied to DataParallel variants (as in training).
    """
    from .train import wrap_model  # the variants' own wrapper (DataParallel / DDP)

    parallel, precision = TRAIN_VARIANTS[variant]
    dtype = resolve_amp_dtype(amp_dtype, device) if precision != "fp32" else None
    if parallel == "ddp":
        if ddp is None:
            ddp = DDPGroup(device.type == "cuda")
        info = ddp.get()
        devices = info.world_size
        note = f"DDP as a {info.world_size}-process group"
    else:
        info = DistInfo(device=device)
        devices = torch.cuda.device_count() if parallel == "dp" and device.type == "cuda" else 1
        note = (f"DataParallel ({dp_scope}) over {devices} GPUs"
                if parallel == "dp" and device.type == "cuda"
                else "DataParallel calls the module directly without CUDA" if parallel == "dp"
                else "")
    compiled = compile and parallel != "dp"
    if compile and not compiled:
        note += "; not compiled (DataParallel)"
    res = StepResult(variant=variant, parallel=parallel, precision=precision,
                     amp_dtype=str(dtype)[6:] if dtype is not None else "",
                     device=device.type, devices=devices, batch_size=batch_size,
                     img_size=img_size, warmup=warmup, steps=steps,
                     channels_last=channels_last, compiled=compiled,
                     dp_scope=dp_scope if parallel == "dp" else "",
                     timer="cuda events" if device.type == "cuda" else "perf_counter",
                     peak_mem_kind=("cuda max_memory_allocated" if device.type == "cuda"
                                    else "max RSS (process)"), note=note)

    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = alexnet(num_classes=num_classes, amp_dtype=dtype).to(device, memory_format=fmt)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr,
                                  fused=True if device.type == "cuda" else None)
    scaler = make_scaler(device, enabled=precision == "grad_scaler")
    criterion = nn.CrossEntropyLoss()
    autocast = autocast_factory(device, dtype)

    gen = torch.Generator().manual_seed(0)
    pool = [(torch.randn(batch_size, 3, img_size, img_size, generator=gen)
             .to(device, memory_format=fmt),
             torch.randint(0, num_classes, (batch_size,), generator=gen).to(device))
            for _ in range(min(4, max(steps, 1)))]
    flops = count_step_flops(model, *pool[0], criterion, autocast)
    model = wrap_model(model, parallel, info, dp_scope=dp_scope)
    if compiled:
        model = torch.compile(model)  # compiled during the warm-up steps

    if warmup > 0:
        train_one_epoch(model, [pool[i % len(pool)] for i in range(warmup)], criterion,
                        optimizer, scaler, autocast, info, desc=f"{variant} warm-up",
                        log_every=log_every, input_format=fmt)
    synchronize(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif not _reset_host_peak():
        res.peak_mem_kind = "max RSS (process, since start)"

    batches = [pool[i % len(pool)] for i in range(steps)]
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        stats = train_one_epoch(model, batches, criterion, optimizer, scaler, autocast, info,
                                desc=variant, log_every=log_every, input_format=fmt)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000.0
        res.peak_mem_mb = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        t0 = time.perf_counter()
        stats = train_one_epoch(model, batches, criterion, optimizer, scaler, autocast, info,
                                desc=variant, log_every=log_every, input_format=fmt)
        seconds = time.perf_counter() - t0
        res.peak_mem_mb = _host_peak_mb()

    res.seconds = seconds
    res.step_ms = 1000.0 * seconds / steps
    res.images_per_s = stats.images / seconds  # all ranks together
    res.gflop_per_step = flops * info.world_size / 1e9 if parallel == "ddp" else flops / 1e9
    res.achieved_tflops = res.gflop_per_step * steps / seconds / 1e3
    if peak_tflops:
        res.utilisation = res.achieved_tflops / (peak_tflops * devices)
    del model, optimizer, scaler, pool, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------- input pipeline
def pipeline_images(batch_size: int, warmup: int, batches: int) -> int:
    """Generated images for the pipeline measurement: one epoch covers the warm-up and
    the timed batches (and a spare one), so no epoch boundary falls inside the clock."""
    return max(batch_size * (warmup + batches + 1), 256)


def measure_pipelines(kinds: List[str], root: Optional[Path], img_size: int, batch_size: int,
                      num_workers: int, device: torch.device, warmup: int = 2,
                      batches: int = 10) -> List[PipelineResult]:
    """Images/s of each input path in ``kinds`` (see :data:`ampkit.pipeline_bench.KINDS`),
    each timed by :func:`ampkit.pipeline_bench.measure_input_pipeline` on the same data:
    CIFAR-10 under ``root`` when it is there, else generated images in its format.
    A path that fails is reported (``status="failed"``) and the others still run."""
    from .pipeline_bench import cifar_root, has_cifar10, measure_input_pipeline

    n = pipeline_images(batch_size, warmup, batches)
    dataset = "CIFAR10" if has_cifar10(root) else f"CIFAR10 (generated, {n})"
    results = []
    with cifar_root(root, n) as data_root:
        for kind in kinds:
            workers = 0 if kind != "classic" else num_workers  # only the classic path has workers
            res = PipelineResult(path=kind, dataset=dataset, img_size=img_size,
                                 batch_size=batch_size, num_workers=workers, device=device.type)
            try:
                res.images_per_s = measure_input_pipeline(
                    kind, root=data_root, img_size=img_size, batch_size=batch_size,
                    num_workers=workers, device=device, n=n, warmup=warmup, max_batches=batches)
                res.batches = batches
            except (UserError, RuntimeError, ValueError, OSError) as e:
                res.status = "failed"
                res.reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            results.append(res)
    return results


# --------------------------------------------------------------------------- tables
def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def step_table(results: List[StepResult]) -> str:
    head = ["variant", "precision", "amp", "dev", "batch", "step ms", "images/s",
            "peak MB", "GFLOP/step", "TFLOP/s", "util", "note"]
    rows = []
    for r in results:
        if r.status != "ok":
            rows.append([r.variant, r.precision, r.amp_dtype or "-", f"{r.devices} {r.device}",
                         str(r.batch_size), "-", "-", "-", "-", "-", "-", f"{r.status}: {r.reason}"])
            continue
        rows.append([r.variant, r.precision, r.amp_dtype or "-", f"{r.devices} {r.device}",
                     str(r.batch_size), _fmt(r.step_ms, ".1f"), _fmt(r.images_per_s, ".1f"),
                     _fmt(r.peak_mem_mb, ".0f"), _fmt(r.gflop_per_step, ".2f"),
                     _fmt(r.achieved_tflops, ".3f"),
                     "-" if r.utilisation is None else f"{100 * r.utilisation:.1f}%", r.note])
    return _table(head, rows, left={0, 1, 2, 11})


def pipeline_table(results: List[PipelineResult]) -> str:
    head = ["input path", "dataset", "img", "batch", "workers", "device", "images/s", "note"]
    rows = [[r.path, r.dataset, str(r.img_size), str(r.batch_size), str(r.num_workers),
             r.device, _fmt(r.images_per_s, ".1f"),
             "" if r.status == "ok" else f"{r.status}: {r.reason}"] for r in results]
    return _table(head, rows, left={0, 1, 5, 7})


def _table(head: List[str], rows: List[List[str]], left: set) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])
