"""What a training step costs the host: ops dispatched per optimizer step by each train
script, against a hand-written floor of its technique, and the host time of a step.

    python checks/ops_per_step.py                              # the 13 scripts (~17 min on 2 cores)
    python checks/ops_per_step.py --scripts train_autocast,train_GradScaler --rounds 5

On a GPU every op a step dispatches is a kernel launch and some microseconds of host time
(Python, the dispatcher, the launch); where the step's arithmetic is short the GPU waits for
the host. A ``TorchDispatchMode`` counts the ops between consecutive optimizer steps
(``register_optimizer_step_post_hook``) over one epoch of the script's own run -- its
``main()``, in a process of its own (a DDP or FSDP2 script makes a group of one) -- on
FakeData, the fast input path, AlexNet at 64 px, batch 32; the median step is the figure.
The floor is the loop written here for the script's technique and parallel mode, with
nothing else: the same data on the device, flipped, resized and normalised there in batch;
autocast, a GradScaler, DataParallel, DDP or FSDP2 as the script has them; fused AdamW; no
loss or norm kept, no stop vote, no progress bar. The host time is the wall time between
optimizer steps, timed without the counting mode, floor and script taking turns round
after round (``--rounds``), at a size where dispatch, not arithmetic, fills the step
(``--time_arch``, default squeezenet1_1 at 32 px, batch 4: no BatchNorm, which
train_FSDP_mixed refuses).
A script's own run writes its checkpoint into a temporary folder, deleted after.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "AMP"))

SCRIPTS = ["train_without", "train_autocast", "train_GradScaler", "train_DP",
           "train_DP_autocast", "train_DP_GradScaler", "train_DDP", "train_DDP_autocast",
           "train_DDP_GradScaler", "train_FSDP", "train_FSDP_autocast", "train_FSDP_GradScaler",
           "train_FSDP_mixed"]
BOUND = 1.05  # a script's ops per step over its floor's, at most


def technique_of(script: str) -> tuple:
    """(parallel mode, precision) of a train script, by its name."""
    parallel = ("ddp" if script.startswith("train_DDP") else "fsdp" if script.startswith(
        "train_FSDP") else "dp" if script.startswith("train_DP") else "single")
    precision = ("mixed" if script.endswith("mixed") else "scaler" if script.endswith(
        "GradScaler") else "autocast" if script.endswith("autocast") else "fp32")
    return parallel, precision


# ------------------------------------------------------------------ counting, timing
def _step_marks(marks: list, now) -> object:
    """Appends ``now()`` at every optimizer step (any optimizer's) until removed."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(lambda optimizer, args, kwargs: marks.append(now()))


def measure(run, count: bool) -> Dict:
    """``run()`` with its optimizer steps marked: the ops dispatched between consecutive
    steps (``count``) or the host seconds between them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: Counter = Counter()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    marks: list = []
    hook = _step_marks(marks, (lambda: ops.copy()) if count else time.perf_counter)
    try:
        with Ops() if count else contextlib.nullcontext():
            run()
    finally:
        hook.remove()
    if count:
        steps = [b - a for a, b in zip(marks, marks[1:])]
        per_step = [sum(s.values()) for s in steps]
        median = statistics.median_low(per_step)  # a step's own count
        typical = next(s for s, n in zip(steps, per_step) if n == median) if per_step else {}
        return {"ops": per_step, "median": median, "typical": dict(typical)}
    seconds = [b - a for a, b in zip(marks, marks[1:])][2:]  # past the first steps' warm-up
    return {"us": [1e6 * s for s in seconds], "median_us": 1e6 * statistics.median(seconds)}


def run_script(script: str, arch: str, img_size: int, batch_size: int, folder: Path):
    """The script's own run: one epoch of FakeData on the fast path, on the CPU."""
    module = importlib.import_module(script)
    argv = ["--dataset", "FakeData", "--loader", "fast", "--arch", arch, "--img_size",
            str(img_size), "--batch_size", str(batch_size), "--epochs", "1", "--device", "cpu",
            "--no-tensorboard", "--checkpoint", str(folder)]

    def run():
        status = module.main(argv)
        if status:
            raise SystemExit(f"{script} exited {status}")
    return run


def run_floor(script: str, arch: str, img_size: int, batch_size: int,
              max_steps: Optional[int] = None):
    """The floor of ``script``'s technique: its loop with nothing but the technique (an epoch
    of FakeData, or its first ``max_steps`` steps)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from ampkit.data.datasets import MEAN, STD
    from ampkit.data.on_device import load_uint8
    from ampkit.distributed import DistInfo
    from ampkit.models import build_model, shard_units

    parallel, precision = technique_of(script)
    device = torch.device("cpu")
    dtype = torch.bfloat16  # the CPU's autocast dtype

    def run():
        if parallel in ("ddp", "fsdp"):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            loop()
        finally:
            if parallel in ("ddp", "fsdp"):
                dist.destroy_process_group()

    def loop():
        images, labels = (t.to(device) for t in load_uint8("FakeData", REPO / "data",
                                                           DistInfo(device), train=True))
        torch.manual_seed(0)
        model = build_model(arch, 10).to(device)
        if parallel == "dp" and device.type == "cuda":
            model = torch.nn.DataParallel(model)
        elif parallel == "ddp":
            model = DistributedDataParallel(model)
        elif parallel == "fsdp":
            mixed = dict(param_dtype=dtype, reduce_dtype=torch.float32) if precision == \
                "mixed" else {}
            for block in shard_units(model):
                fully_shard(block, mp_policy=MixedPrecisionPolicy(**mixed))
            model = fully_shard(model, mp_policy=MixedPrecisionPolicy(
                **mixed, output_dtype=torch.float32 if mixed else None))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "scaler")
        autocast = torch.autocast(device.type, dtype=dtype,
                                  enabled=precision in ("autocast", "scaler"))
        scale = (1 / (torch.tensor(STD) * 255)).view(1, 3, 1, 1).to(device)
        bias = (-torch.tensor(MEAN) / torch.tensor(STD)).view(1, 3, 1, 1).to(device)
        generator = torch.Generator().manual_seed(0)
        order = torch.randperm(len(labels), generator=generator).to(device)
        flips = (torch.rand(len(labels), generator=generator) < 0.5).view(-1, 1, 1, 1).to(device)
        steps = zip(order.split(batch_size), flips.split(batch_size))
        for index, flip in itertools.islice(steps, max_steps):
            x = images.index_select(0, index)
            x = torch.where(flip, x.flip(3), x)
            size = (img_size, img_size)
            if x.shape[-2:] != size and device.type == "cpu":  # its uint8 resize: channels_last
                x = F.interpolate(x.contiguous(memory_format=torch.channels_last), size=size,
                                  mode="bilinear", antialias=True)
            if x.shape[-2:] != size:  # CUDA's: normalised first, resized in float
                x = F.interpolate(x.float().mul_(scale).add_(bias), size=size, mode="bilinear",
                                  antialias=True)
            else:
                x = x.to(torch.float32, memory_format=torch.contiguous_format)
                x = x.mul_(scale).add_(bias)
            y = labels.index_select(0, index)
            with autocast:
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return run


def child(args) -> None:
    """One measurement, in this process: a JSON line on stdout."""
    import torch

    if not args.count:  # one thread: the host's own work, without the pool's hand-offs
        torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="ops_per_step.") as folder:
        make = (run_floor(args.child, args.arch, args.img_size, args.batch_size)
                if args.floor else
                run_script(args.child, args.arch, args.img_size, args.batch_size, Path(folder)))
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), \
                contextlib.redirect_stderr(quiet):
            result = measure(make, count=args.count)
    print(json.dumps(result))


def one(script: str, *, floor: bool, count: bool, arch: str, img_size: int,
        batch_size: int) -> Dict:
    """A measurement in a process of its own (a script's group of one, its imports, its
    allocator: nothing carried from one to the next)."""
    cmd = [sys.executable, __file__, "--child", script, "--arch", arch, "--img_size",
           str(img_size), "--batch_size", str(batch_size)] + (["--floor"] if floor else []) + (
        ["--count"] if count else [])
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if res.returncode != 0:
        raise SystemExit(f"ops_per_step.py: {' '.join(cmd[2:])} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--scripts", default=",".join(SCRIPTS), help="comma-separated train scripts")
    p.add_argument("--arch", default="alexnet", help="the network whose ops are counted")
    p.add_argument("--img_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--time_arch", default="squeezenet1_1",
                   help="the network of the host-time rounds: one whose step dispatch fills")
    p.add_argument("--time_img_size", type=int, default=32)
    p.add_argument("--time_batch_size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="host-time rounds (0: none)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    scripts = [s.strip() for s in args.scripts.split(",") if s.strip()]
    unknown = [s for s in scripts if s not in SCRIPTS]
    if unknown:
        p.error(f"unknown script(s) {', '.join(unknown)}; choose from {', '.join(SCRIPTS)}")
    import torch

    print(f"ops_per_step.py: torch {torch.__version__}, {torch.get_num_threads()} threads; ops per "
          f"optimizer step: {args.arch} at {args.img_size} px, batch {args.batch_size}, "
          f"FakeData, fast input path, CPU", flush=True)
    rows: List[Dict] = []
    for script in scripts:
        kw = dict(arch=args.arch, img_size=args.img_size, batch_size=args.batch_size, count=True)
        mine, floor = one(script, floor=False, **kw), one(script, floor=True, **kw)
        extra = Counter(mine["typical"]) - Counter(floor["typical"])
        rows.append({"script": script, "ops": mine["median"], "floor": floor["median"],
                     "ratio": mine["median"] / floor["median"], "extra": dict(extra),
                     "us": [], "floor_us": []})
        print(f"  {script}: {mine['median']:g} ops / step, floor {floor['median']:g} "
              f"({rows[-1]['ratio']:.3f}x); more than the floor: "
              + (", ".join(f"{k.split('::')[-1]} {n}" for k, n in extra.most_common())
                 or "nothing"), flush=True)
    for r in range(args.rounds):
        for row in rows:  # floor and script in turn, round after round
            kw = dict(arch=args.time_arch, img_size=args.time_img_size,
                      batch_size=args.time_batch_size, count=False)
            row["floor_us"].append(one(row["script"], floor=True, **kw)["median_us"])
            row["us"].append(one(row["script"], floor=False, **kw)["median_us"])
        print(f"  host-time round {r + 1}/{args.rounds} done", flush=True)
    print()
    print(table(rows, args))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2) + "\n")
    return 1 if any(row["ratio"] > BOUND for row in rows) else 0


def table(rows: List[Dict], args) -> str:
    timed = args.rounds > 0
    head = ("| script | ops / step | floor | ratio |"
            + (" host µs / step | floor µs | ratio |" if timed else ""))
    lines = [head, "|---|--:|--:|--:|" + ("--:|--:|--:|" if timed else "")]
    for row in rows:
        line = f"| `{row['script']}` | {row['ops']:g} | {row['floor']:g} | {row['ratio']:.3f}x |"
        if timed:
            us, floor_us = statistics.median(row["us"]), statistics.median(row["floor_us"])
            line += f" {us:.0f} | {floor_us:.0f} | {us / floor_us:.3f}x |"
        lines.append(line)
    note = (f"\n(ops: the median step of one epoch, {args.arch} at {args.img_size} px, batch "
            f"{args.batch_size}; bound {BOUND}x" + (
                f"; host µs: the median step, median of {args.rounds} rounds, "
                f"{args.time_arch} at {args.time_img_size} px, batch {args.time_batch_size}, "
                "floor and script in turn" if timed else "") + ")")
    return "\n".join(lines) + note


if __name__ == "__main__":
    sys.exit(main())
