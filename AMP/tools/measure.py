"""Everything the project measures, in one place: peak memory, step throughput, input pipeline.

Step throughput (``measure_variant``, used by ``AMP/benchmark.py``): each variant's own
``build()`` -- imported from its training script, so what is timed is the script's
wrapper, precision objects and step -- run by :func:`ampkit.engine.train_one_epoch`
over synthetic batches already on the device (no data loading timed). DDP variants
run as a one-process group (the DDP machinery on one device; multi-process runs are
what ``compare.py`` measures end to end).

- ``warmup`` steps run first and are not counted (allocator, cuDNN autotuning,
  optimizer state creation, compilation).
- The timed ``steps`` are clocked with CUDA events on a GPU (the host waits for the
  end event), with ``time.perf_counter`` on the CPU.
- Peak memory (:mod:`ampkit.machinery.memory`, reset after warm-up):
  ``torch.cuda.max_memory_allocated`` on a GPU; on the CPU the process's peak resident
  memory (``VmHWM``, reset through ``/proc/self/clear_refs`` where Linux allows).
- No host sync inside the timed window: the loop's host read (``--log_every``) is put
  after the last timed step.
- FLOPs per step: ``machinery.flops.training_flops_per_image`` (the training scripts'
  counter: ``FlopCounterMode`` over one forward + backward of the bare model) x batch;
  utilisation = achieved FLOP/s / (peak x devices), where the peak is the precision's
  own: ``peak_tflops`` (fp16/bf16) for the autocast variants, ``peak_tflops_fp32`` for
  the fp32 ones, whose math on CUDA is labelled (``fp32_math``: TF32 or true fp32).

Traces: ``--profile`` records a few more steps with :class:`ampkit.machinery.profiler.StepProfiler`.

Input pipeline (``measure_input_pipeline``): images/s that an input path delivers to
the device, one epoch after another, first ``warmup`` batches not timed:

- ``article``: torchvision's CIFAR10 with ``Resize(img_size)`` + ``ToTensor()`` in PIL,
  ``num_workers=0``, as the article does;
- ``classic``: ampkit's DataLoader path (:mod:`ampkit.machinery.data`);
- ``fast``: ampkit's device path (:mod:`ampkit.machinery.fastdata`).

Without CIFAR-10 under ``root``, generated images in CIFAR-10's on-disk format are used
(``write_cifar10``; the pipelines' cost does not depend on the pixel values).
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import os
import pickle
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torchvision import transforms

import torch.distributed as dist

from ampkit.distributed import StopVote, elastic_store, this_process, torchrun_env
from ampkit.machinery.ranks import DistInfo, synchronize
from ampkit.engine import Parts, train_one_epoch
from ampkit.machinery.data import train_loader
from ampkit.machinery.cifar import CIFAR10
from ampkit.machinery.datasets import build_datasets
from ampkit.machinery.fastdata import fast_loaders
from ampkit.machinery.flops import training_flops_per_image
from ampkit.machinery.memory import memory_kind, peak_memory_mb, reset_peak_memory
from ampkit.machinery.profiler import StepProfiler
from ampkit.machinery.signals import StopFlag
from ampkit.models import build_model
from ampkit.precision import SkippedSteps, compile_in_place

from .variants import DISTRIBUTED, TRAIN_VARIANTS

KINDS = ("article", "classic", "fast")
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                 "ship", "truck")


# --------------------------------------------------------------------------- model steps
@dataclass
class StepResult:
    variant: str
    parallel: str
    precision: str
    amp_dtype: str
    arch: str
    device: str
    devices: int
    batch_size: int          # per micro-batch (per process for DDP)
    img_size: int
    warmup: int
    steps: int               # optimizer steps
    accum_steps: int = 1     # micro-batches per optimizer step
    channels_last: bool = False
    compiled: bool = False
    fp32_math: str = ""      # CUDA fp32 variants: "tf32", "fp32" or "tf32 conv, fp32 matmul"
    dp_scope: str = ""       # DP variants: "model" or "features"
    seconds: Optional[float] = None
    step_ms: Optional[float] = None
    images_per_s: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    peak_mem_kind: str = ""
    gflop_per_step: Optional[float] = None
    achieved_tflops: Optional[float] = None
    utilisation: Optional[float] = None    # fraction of the precision's peak x devices
    speedup: Optional[float] = None        # images/s over the fp32 row of its parallel mode
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
                rank, world_size, device = torchrun_env(self.cuda)
                if self.cuda:
                    torch.cuda.set_device(device)
                kw = dict(rank=rank, world_size=world_size, store=elastic_store(rank, world_size))
            else:
                device = torch.device("cuda", torch.cuda.current_device()) if self.cuda \
                    else torch.device("cpu")
                kw = dict(rank=0, world_size=1, store=dist.HashStore())
            dist.init_process_group("nccl" if self.cuda else "gloo", device_id=device.index, **kw)
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
    if kw["compiled"] and parallel == "dp":
        kw["compiled"], note = False, note + "; not compiled (DataParallel)"
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
                    compile: bool = False, dp_scope: str = "model", accum_steps: int = 1,
                    keep_sync: bool = False, profile: Optional[Path] = None) -> StepResult:
    """Time ``steps`` optimizer steps of ``variant``'s own ``build()`` after ``warmup``
    uncounted ones, each over ``accum_steps`` micro-batches of ``batch_size``.
    ``channels_last``, ``compile``, ``dp_scope`` and ``accum_steps`` are the training flags
    of those names; ``keep_sync``: DDP all-reduces every micro-batch (no ``no_sync``: what it
    saves); ``fp32_math`` labels the fp32 variants on CUDA (``precision.set_tf32``'s);
    ``profile``: after the timing, a few more steps under :class:`StepProfiler`, traced."""
    info, res = _result(variant, device, ddp, arch=arch, batch_size=batch_size,
                        img_size=img_size, warmup=warmup, steps=steps, accum_steps=accum_steps,
                        channels_last=channels_last, compiled=compile, dp_scope=dp_scope)
    if res.precision == "fp32" and device.type == "cuda":
        res.fp32_math = fp32_math
    if keep_sync:
        res.note += "; DDP all-reduces every micro-batch (no no_sync)"
    t, pool, flops = _built(variant, res, device, num_classes, lr, amp_dtype)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    skipped = SkippedSteps(t.scaler, device)
    vote = StopVote(StopFlag(), info)  # as in training: the ranks' stop vote every step

    def run(n: int, **kw):  # n optimizer steps, over the pool's batches in turn
        micro = [pool[i % len(pool)] for i in range(n * accum_steps)]
        with _all_reduce_every_micro_batch() if keep_sync else contextlib.nullcontext():
            return train_one_epoch(t.step, micro, info, skipped=skipped, input_format=fmt,
                                   accum_steps=accum_steps, stop=vote, **kw)

    if warmup > 0:
        run(warmup, desc=f"{variant} warm-up")
    _reset_peaks(device, res)
    # log_every past the last step: the loop's host read (the loss for the progress bar, the
    # stop and divergence checks) would sync inside the timed window.
    seconds, stats = _timed(lambda: run(steps, desc=variant, log_every=steps + 1), device)
    res.peak_mem_mb = peak_memory_mb(device, all_gpus=res.parallel == "dp")
    res.seconds, res.step_ms = seconds, 1000.0 * seconds / steps
    res.images_per_s = stats.images / seconds  # all ranks together
    res.gflop_per_step = flops * accum_steps * info.world_size / 1e9
    res.achieved_tflops = res.gflop_per_step * steps / seconds / 1e3
    if profile is not None:  # started and stopped by train_one_epoch
        profiler = StepProfiler(profile, device)
        run(profiler.needed, desc=f"{variant} profile", profiler=profiler)
        print(profiler.report(), flush=True)
    peak = peak_tflops_fp32 if res.precision == "fp32" else peak_tflops
    if peak:
        res.utilisation = res.achieved_tflops / (peak * res.devices)
    return res  # the caller frees the model (gc.collect, torch.cuda.empty_cache)


def _built(variant: str, res: StepResult, device: torch.device, num_classes: int, lr: float,
           amp_dtype: Optional[str]) -> tuple:
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
    t = importlib.import_module(variant).build(
        Parts(device, model, nn.CrossEntropyLoss(), amp_dtype, res.dp_scope or "model", lr=lr,
              arch=res.arch))
    res.amp_dtype = str(t.compute_dtype)[6:] if t.compute_dtype is not None else ""
    if res.compiled:
        compile_in_place(t.model)  # compiled during the warm-up steps
    t.model.train()
    return t, pool, flops


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


# --------------------------------------------------------------------------- input pipeline
@dataclass
class PipelineResult:
    path: str                # one of KINDS
    dataset: str             # "CIFAR10", or "CIFAR10 (generated, N)" images in its format
    img_size: int
    batch_size: int
    num_workers: int
    device: str
    images_per_s: Optional[float] = None   # the best of ``repeat`` measurements
    batches: int = 0         # timed batches (after the uncounted warm-up ones)
    status: str = "ok"
    reason: str = ""

    def as_dict(self) -> Dict:
        return asdict(self)


def has_cifar10(root: Optional[Path]) -> bool:
    if root is None:
        return False
    folder = Path(root) / CIFAR_FOLDER
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    return all((folder / n).is_file() for n in names)


def write_cifar10(root: Path, n_train: int, n_test: int, *, seed: int = 0,
                  learnable: bool = False, num_classes: int = 10) -> Path:
    """Write a CIFAR-10-format data set (``<root>/cifar-10-batches-py/``) that torchvision reads.

    ``learnable=False``: uniform random pixels. ``learnable=True``: each class is a
    well-separated colour plus noise, so a small network separates the classes within
    a few steps (and flips do not hide the cue). Labels cycle through ``num_classes``
    (at most 10) classes, shuffled.
    """
    rng = np.random.default_rng(seed)
    folder = Path(root) / CIFAR_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    palette = np.array([(230, 30, 30), (30, 230, 30), (30, 30, 230), (230, 230, 30),
                        (230, 30, 230), (30, 230, 230), (240, 240, 240), (20, 20, 20),
                        (128, 128, 30), (30, 128, 128)], dtype=np.int16)

    def make(n: int) -> tuple:
        labels = np.arange(n) % num_classes
        rng.shuffle(labels)
        if not learnable:
            return rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8), labels
        noise = rng.integers(-40, 41, (n, 3, 32, 32), dtype=np.int16)
        images = np.clip(palette[labels][:, :, None, None] + noise, 0, 255).astype(np.uint8)
        return images.reshape(n, -1), labels

    data, labels = make(n_train)
    for k, (part, lab) in enumerate(zip(np.array_split(data, 5), np.array_split(labels, 5))):
        with open(folder / f"data_batch_{k + 1}", "wb") as f:
            pickle.dump({"batch_label": f"training batch {k + 1} of 5", "data": part,
                         "labels": lab.tolist()}, f)
    data, labels = make(n_test)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"batch_label": "testing batch 1 of 1", "data": data,
                     "labels": labels.tolist()}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": list(CIFAR_CLASSES), "num_cases_per_batch": n_train // 5,
                     "num_vis": 3072}, f)
    return Path(root)


@contextlib.contextmanager
def cifar_root(root: Optional[Path], n: int) -> Iterator[Path]:
    """``root`` if it holds CIFAR-10, else a temporary folder with ``n`` generated images."""
    if has_cifar10(root):
        yield Path(root)
        return
    with tempfile.TemporaryDirectory(prefix="ampkit-bench-") as tmp:
        yield write_cifar10(Path(tmp), n, max(n // 8, 64))


def _pipeline(kind: str, root: Path, img_size: int, batch_size: int, num_workers: int,
              info: DistInfo, channels_last: bool):
    if kind == "article":
        # torchvision's CIFAR10 apart from its md5 check at construction (generated data
        # would fail it); images are read and transformed exactly as torchvision does.
        tf = transforms.Compose([transforms.Resize(img_size), transforms.ToTensor()])
        dataset = CIFAR10(str(root), train=True, transform=tf, download=False)
        return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=0)
    if kind == "classic":
        data = build_datasets("CIFAR10", root, img_size, info)
        return train_loader(data.train, batch_size, num_workers, info, seed=0)
    if kind == "fast":
        return fast_loaders("CIFAR10", root, img_size, batch_size, info,
                            channels_last=channels_last)[0].loader()
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _endless(loader) -> Iterator:
    """The loader's batches, epoch after epoch (a new permutation each epoch)."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        sampler = getattr(sampler, "sampler", sampler)  # the order inside a ResumableSampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the training split gives no batch")
        epoch += 1


def measure_input_pipeline(kind: str, *, root: Optional[Path] = None, img_size: int = 227,
                           batch_size: int = 64, num_workers: int = 0,
                           device: Optional[torch.device] = None, n: int = 2048,
                           warmup: int = 2, max_batches: Optional[int] = None,
                           channels_last: bool = False) -> float:
    """Images per second that the ``kind`` input path delivers to ``device``.

    ``root``: a folder with CIFAR-10; without one, ``n`` generated images are used.
    ``warmup`` batches are not timed; then ``max_batches`` batches are (default: one
    epoch's worth), over as many epochs as that takes.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    info = DistInfo(device=device)
    with cifar_root(root, n) as data_root:
        loader = _pipeline(kind, data_root, img_size, batch_size, num_workers, info,
                           channels_last)
        batches = _endless(loader)
        for _ in range(warmup):  # worker start-up, first allocations: not counted
            next(batches)[0].to(device, non_blocking=True)
        synchronize(device)
        t0 = time.perf_counter()
        images = 0
        for _ in range(max_batches if max_batches is not None else len(loader)):
            x, y = next(batches)
            images += x.to(device, non_blocking=True).shape[0]
            y.to(device, non_blocking=True)
        synchronize(device)
        seconds = time.perf_counter() - t0
        batches.close()
        del batches, loader  # stops persistent workers before the data folder goes
    return images / seconds


def measure_pipelines(kinds: Sequence[str], root: Optional[Path], img_size: int,
                      batch_size: int, num_workers: int, device: torch.device, *,
                      warmup: int = 2, batches: int = 10, repeat: int = 1,
                      channels_last: bool = False) -> List[PipelineResult]:
    """The best images/s of ``repeat`` interleaved measurements of each path in ``kinds``,
    on the same data (CIFAR-10 under ``root``, else generated images in its format).
    A path that fails is reported (``status="failed"``) and the others still run."""
    n = max(batch_size * (warmup + batches + 1), 256)  # no epoch boundary inside the clock
    dataset = "CIFAR10" if has_cifar10(root) else f"CIFAR10 (generated, {n})"
    results = [PipelineResult(path=k, dataset=dataset, img_size=img_size, batch_size=batch_size,
                              num_workers=num_workers if k == "classic" else 0,
                              device=device.type, batches=batches) for k in kinds]
    with cifar_root(root, n) as data_root:
        for _ in range(repeat):
            for res in results:
                if res.status != "ok":
                    continue
                try:
                    rate = measure_input_pipeline(
                        res.path, root=data_root, img_size=img_size, batch_size=batch_size,
                        num_workers=res.num_workers, device=device, n=n, warmup=warmup,
                        max_batches=batches, channels_last=channels_last)
                    res.images_per_s = max(res.images_per_s or 0.0, rate)
                except (RuntimeError, ValueError, OSError) as e:
                    res.status, res.images_per_s = "failed", None
                    res.reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    return results


# --------------------------------------------------------------------------- tables
def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def add_speedups(results: Sequence[StepResult]) -> None:
    """Each result's images/s over those of the fp32 row of the same parallel mode and
    settings (batch, accumulation, memory format, compilation), where there is one: the
    article's question, what a precision buys over fp32."""
    def key(r: StepResult) -> tuple:
        return r.parallel, r.batch_size, r.accum_steps, r.channels_last, r.compiled, r.dp_scope

    base = {key(r): r for r in results if r.precision == "fp32" and r.status == "ok"}
    for r in results:
        b = base.get(key(r))
        if r.status == "ok" and b is not None and b.images_per_s:
            r.speedup = r.images_per_s / b.images_per_s


def step_table(results: Sequence[StepResult]) -> str:
    head = ["variant", "precision", "math", "dev", "batch", "step ms", "images/s", "x fp32",
            "peak MB", "GFLOP/step", "TFLOP/s", "util", "note"]
    rows = []
    for r in results:
        ok = r.status == "ok"
        rows.append([r.variant, r.precision, r.amp_dtype or r.fp32_math or "-",
                     f"{r.devices} {r.device}",
                     f"{r.batch_size}" + (f"x{r.accum_steps}" if r.accum_steps > 1 else ""),
                     _fmt(r.step_ms, ".1f"), _fmt(r.images_per_s, ".1f"),
                     _fmt(r.speedup, ".2f"), _fmt(r.peak_mem_mb, ".0f"),
                     _fmt(r.gflop_per_step, ".2f"), _fmt(r.achieved_tflops, ".3f"),
                     "-" if r.utilisation is None else f"{100 * r.utilisation:.1f}%",
                     r.note if ok else f"{r.status}: {r.reason}"])
    return text_table(head, rows, left={0, 1, 2, 12})


def pipeline_table(results: Sequence[PipelineResult]) -> str:
    head = ["input path", "dataset", "img", "batch", "workers", "device", "images/s", "note"]
    rows = [[r.path, r.dataset, str(r.img_size), str(r.batch_size), str(r.num_workers),
             r.device, _fmt(r.images_per_s, ".1f"),
             "" if r.status == "ok" else f"{r.status}: {r.reason}"] for r in results]
    return text_table(head, rows, left={0, 1, 5, 7})


def text_table(head: List[str], rows: List[List[str]], left: set) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])
