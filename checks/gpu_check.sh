#!/usr/bin/env bash
# One call on a GPU machine: first every CUDA path of the scripts, briefly -- the CUDA tests,
# torchrun (NCCL) for DDP and FSDP2 (with gradient accumulation and clipping), DataParallel
# with GradScaler, SIGTERM and --resume, the eval scripts -- then the GPU figures of
# docs/results.md, then --compile and CUDA graphs last.
#   bash checks/gpu_check.sh              # on the GPU (device tool: timeout_s 600)
#   bash checks/gpu_check.sh --dry-run    # the same steps on the CPU at toy sizes: checks the
#                                        # script before GPU time is spent (3 min 18 s, 21
#                                        # steps passed, on this project's 2-core machine,
#                                        # 2026-12-05: time OUT=/tmp/dryout bash ... --dry-run)
# $OUT (default ./gpu_out) receives two files, as the device tool brings back at most 8:
# summary.txt (first the verdict; every step's command, result lines, exit status, or why
# it was skipped; at the end the figures as markdown tables, each step's status, and the
# failed steps) and details.tar.gz (each step's whole output, JSON and log.jsonl), repacked
# after every step. Checkpoints and data sets live outside what is packed and are deleted
# once the steps that read them are over; any file over 1 MiB stays out of the archive
# (named in the summary). The exit status is non-zero if any step failed or was skipped,
# or if $OUT does not fit what the device tool brings back.
# Steps run in the order of what a try must bring back -- whether the CUDA paths are right,
# then the timings, then compile (a compile that hangs or runs long must not cost the
# answers before it) -- each under a timeout capped by what is left of BUDGET seconds
# (default 500), so a slow step cannot cost the ones before it; no process of a step
# outlives it (checks/gpu_check_steps.sh); the header's commands have timeouts too.
#   1. pytest -m cuda (the only step that asserts);
#   2. short runs (1 epoch of 2,560 generated images at 128, batch 64): DDP + GradScaler
#      under torchrun with accumulation and clipping, then eval_DDP --autocast on its
#      checkpoint; FSDP2 + GradScaler, resumed to epoch 2, then eval_without on its
#      gathered checkpoint; FSDP2's MixedPrecisionPolicy; DataParallel + GradScaler, then
#      eval_DP; SIGTERM mid-run (exit 143), then --resume to the end of that epoch;
#   3. the step benchmark at 227, batch 256, every row with its speed-up over the fp32 row
#      of its parallel mode and its share of the GPU's peak (by name, ampkit/device.py):
#      single device, DataParallel, DDP and FSDP2 (one-process NCCL groups) in fp32 /
#      fp16 / fp16 + GradScaler; channels_last; bf16; fp32 without TF32;
#   4. a real run of the fastest single-device configuration of step 3: 2 epochs of 50,000
#      generated (learnable) CIFAR-format images at 227, fast input path;
#   5. the input pipeline alone (article PIL path, classic DataLoader with as many workers
#      as /dev/shm holds, fast);
#   6. where a step's time goes at the scripts' own batch (64 at 227 px): the share of the
#      wall time the GPU ran kernels (torch.profiler, CUDA activity alone), train_autocast
#      eager, with --compile and with --compile reduce-overhead (CUDA graphs, one
#      micro-batch per step), and which is fastest; then --compile in training, in one
#      configuration (the fastest, with --tf32).
# Uses whatever python3 has torch (the device machine: torch 2.11, no network).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; rm -f "$OUT/summary.txt" "$OUT/details.tar.gz"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)          # packed: outputs, JSON, logs
SCRATCH=$(mktemp -d /tmp/gpu_check_data.XXXXXX)  # never packed: data sets, checkpoints
trap 'rm -rf "$WORK" "$WORK.tar.gz" "$SCRATCH"' EXIT
CK=$SCRATCH/ckpt
BUDGET=${BUDGET:-500}
export PYTHONUNBUFFERED=1
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
if [ $DRY = 1 ]; then
  # Batches of 2: a bf16 step of AlexNet takes seconds on a CPU without native bf16.
  DEV=--no-cuda; IMG=64; BS=2; STEPS="--steps 2 --warmup 1"; NTRAIN=16; NTEST=4
  PIPE_B=2; WORKERS=1; PEAK="--peak_tflops 1 --peak_tflops_fp32 1"
  S_TRAIN=4; S_TEST=2; S_IMG=64; S_BS=2
  TF32=""; NO_TF32=""  # CUDA's fp32 math: refused on the CPU
  BUSY_BS=2
else
  DEV=--cuda; IMG=227; BS=256; STEPS="--steps 30 --warmup 10"; NTRAIN=50000; NTEST=10000
  PIPE_B=30; WORKERS=8; PEAK=""  # the peaks: by the GPU's name (ampkit/device.py)
  S_TRAIN=2560; S_TEST=512; S_IMG=128; S_BS=64  # the short runs: data, image size, batch
  TF32=--tf32; NO_TF32=--no-tf32
  BUSY_BS=64  # the scripts' default batch
fi
source checks/gpu_check_steps.sh

{ timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 ||
  echo "nvidia-smi: none, or no answer in 30 s"; } | head -3 >> "$OUT/summary.txt"
timeout 120 python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" 2>&1 | tee -a "$OUT/summary.txt"
[ "${PIPESTATUS[0]}" = 0 ] || log "torch did not answer in 120 s (or failed): the steps below will tell"

run pytest_cuda 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests
keep "$WORK/pytest_cuda.txt" 15

# Two learnable CIFAR-format sets, outside WORK: the real run's and the short runs'.
run data 60 python3 -c "import sys; sys.path.insert(0, 'AMP'); from tools.cifar_files import write_cifar10 as w; \
w('$SCRATCH/cifar', $NTRAIN, $NTEST, learnable=True); w('$SCRATCH/small', $S_TRAIN, $S_TEST, learnable=True)"
keep "$WORK/data.txt" 2

# drop NAME: a run folder's logs into WORK (packed), its checkpoints deleted.
drop() {
  local f
  for f in "$CK/$1"/*/log.jsonl; do [ -f "$f" ] && cp "$f" "$WORK/$1.log.jsonl"; done
  rm -rf "${CK:?}/$1"
}

# The short runs: one epoch each (two when resumed), their checkpoints read by the evals.
S="$DEV --dataset CIFAR10 --dataset_root $SCRATCH/small --img_size $S_IMG --batch_size $S_BS --no-tensorboard"
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node=1"  # one GPU here

c=$CK/ddp_gs/train_DDP_GradScaler
# With gradient accumulation and clipping: no_sync on NCCL, unscale_ + clip with fused AdamW.
run ddp_gs 60 $TORCHRUN AMP/train_DDP_GradScaler.py $S --channels_last --accum_steps 2 --clip_grad 1 \
  --epochs 1 --checkpoint "$CK/ddp_gs"
keep "$WORK/ddp_gs.txt" 4
needs "$c/last.pth" eval_ddp_autocast &&
  run eval_ddp_autocast 45 $TORCHRUN AMP/eval_DDP.py $DEV --autocast --checkpoint "$c/last.pth"
keep "$WORK/eval_ddp_autocast.txt" 2; drop ddp_gs

c=$CK/fsdp_gs/train_FSDP_GradScaler
# set_requires_gradient_sync and clip_grad_norm_ on DTensors, on CUDA.
run fsdp_gs 60 $TORCHRUN AMP/train_FSDP_GradScaler.py $S --accum_steps 2 --clip_grad 1 --epochs 1 \
  --checkpoint "$CK/fsdp_gs"
keep "$WORK/fsdp_gs.txt" 4
needs "$c/last.pth" fsdp_gs_resume &&
  run fsdp_gs_resume 60 $TORCHRUN AMP/train_FSDP_GradScaler.py $S --accum_steps 2 --clip_grad 1 \
    --epochs 2 --resume --checkpoint "$CK/fsdp_gs"
keep "$WORK/fsdp_gs_resume.txt" 5
needs "$c/last.pth" eval_without && run eval_without 45 python3 AMP/eval_without.py $DEV --checkpoint "$c/last.pth"
keep "$WORK/eval_without.txt" 2; drop fsdp_gs

run fsdp_mixed 60 $TORCHRUN AMP/train_FSDP_mixed.py $S --epochs 1 --checkpoint "$CK/fsdp_mixed"
keep "$WORK/fsdp_mixed.txt" 4; drop fsdp_mixed

c=$CK/dp_gs/train_DP_GradScaler
run dp_gs 45 python3 AMP/train_DP_GradScaler.py $S --epochs 1 --checkpoint "$CK/dp_gs"
keep "$WORK/dp_gs.txt" 4
needs "$c/last.pth" eval_dp && run eval_dp 45 python3 AMP/eval_DP.py $DEV --checkpoint "$c/last.pth"
keep "$WORK/eval_dp.txt" 2; drop dp_gs

# SIGTERM once the first epoch is saved, in a run of more epochs than the step has time
# for: the stop must end it (exit 143, last.pth where it stopped); then --resume to the end
# of the epoch it stopped in: the stop's save, the restored CUDA RNG state and GradScaler.
c=$CK/sigterm/train_GradScaler
run sigterm 60 bash -c "python3 AMP/train_GradScaler.py $S --epochs 1000 --checkpoint $CK/sigterm & p=\$!; \
  while kill -0 \$p 2>/dev/null && [ ! -f $c/last.pth ]; do sleep 0.2; done; \
  kill -TERM \$p 2>/dev/null; wait \$p; rc=\$?; echo exit status \$rc; [ \$rc -eq 143 ]"
keep "$WORK/sigterm.txt" 4
needs "$c/last.pth" sigterm_resume &&
  run sigterm_resume 60 bash -c "e=\$(python3 -c \"import torch; print(torch.load('$c/last.pth', \
weights_only=True, mmap=True)['epoch'] + 1)\") && python3 AMP/train_GradScaler.py $S --epochs \$e --resume \
--checkpoint $CK/sigterm"
keep "$WORK/sigterm_resume.txt" 5; drop sigterm

B="python3 AMP/benchmark.py $DEV --img_size $IMG --batch_size $BS $STEPS --pipeline none"
run bench_fp16 150 $B $PEAK --variants train_without,train_autocast,train_GradScaler,train_DP,train_DP_autocast,\
train_DDP,train_DDP_GradScaler,train_FSDP,train_FSDP_GradScaler --json "$WORK/bench_fp16.json"
keep "$WORK/bench_fp16.txt" 16

run bench_fp16_cl 60 $B $PEAK --channels_last --variants train_without,train_autocast,train_GradScaler \
  --json "$WORK/bench_fp16_cl.json"; keep "$WORK/bench_fp16_cl.txt" 8
run bench_bf16_cl 60 $B $PEAK --channels_last --amp_dtype bfloat16 --variants train_without,train_autocast \
  --json "$WORK/bench_bf16_cl.json"; keep "$WORK/bench_bf16_cl.txt" 7
run bench_fp32_ieee 45 $B $PEAK $NO_TF32 --channels_last --variants train_without \
  --json "$WORK/bench_fp32_ieee.json"; keep "$WORK/bench_fp32_ieee.txt" 6

# The fastest single-device configuration measured above -> its training script's flags
# (a missing or truncated JSON is skipped; nothing measured: a fixed choice).
BEST=$(python3 - "$WORK" <<'PY'
import json, pathlib, sys
best = None
for f in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.json")):
    try:
        steps = json.loads(f.read_text())["steps"]
    except (OSError, ValueError, KeyError):
        continue
    for s in steps:
        if s.get("status") == "ok" and s.get("parallel") == "single" and (
                best is None or s["images_per_s"] > best["images_per_s"]):
            best = s
if best is not None:
    flags = [best["variant"]] + (["--amp_dtype", best["amp_dtype"]] if best["amp_dtype"] else [])
    print(" ".join(flags + (["--channels_last"] if best["channels_last"] else [])))
PY
)
BEST=${BEST:-train_autocast --channels_last}
log "fastest single-device configuration: $BEST"
set -- $BEST; VARIANT=$1; shift; BEST_FLAGS="$*"

run real_run 150 python3 AMP/$VARIANT.py $DEV $BEST_FLAGS --dataset CIFAR10 --dataset_root "$SCRATCH/cifar" \
  --img_size $IMG --epochs 2 --batch_size $BS --lr 1e-4 --no-tensorboard --checkpoint "$CK/real_run"
keep "$WORK/real_run.txt" 6; drop real_run

# The classic path's workers each hold 2 batches in /dev/shm (a container's may be small):
# as many workers as it has room for, none (the classic path skipped, said here) if none fit.
SHM_MB=$(df -Pm /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}'); SHM_MB=${SHM_MB:-0}
BATCH_MB=$(( BS * 3 * IMG * IMG * 4 / 1048576 + 1 ))
W=$(( SHM_MB / (3 * BATCH_MB) )); [ "$W" -gt "$WORKERS" ] && W=$WORKERS
PIPES=all
if [ "$W" -lt 1 ]; then
  PIPES=no_classic; W=0
  log "pipeline: the classic path skipped: /dev/shm has ${SHM_MB} MB free, and each DataLoader worker keeps 2 batches of ${BATCH_MB} MB there"
fi
run pipeline 60 python3 AMP/benchmark.py $DEV --variants none --pipeline $PIPES --img_size $IMG \
  --num_workers $W --batch_size $BS --pipeline_batches $PIPE_B --json "$WORK/pipeline.json"
keep "$WORK/pipeline.txt" 8

# Where a step's time goes, at the scripts' own batch: the share of the wall time the GPU
# ran kernels (the rest it waited for the host), eager, compiled, and replayed as CUDA
# graphs (one device and one micro-batch per step: DataParallel, DDP, FSDP2 and
# --accum_steps 2 or more refuse them in one line, so no step here asks for them). A dry run on
# the CPU has no kernels to see (busy "-") and no CUDA graphs to replay.
BB="python3 AMP/benchmark.py $DEV --img_size $IMG --batch_size $BUSY_BS $STEPS --pipeline none --busy"
run busy_eager 45 $BB $PEAK --variants train_autocast,train_GradScaler --json "$WORK/busy_eager.json"
keep "$WORK/busy_eager.txt" 5
run busy_compile 100 $BB $PEAK --compile --variants train_autocast --json "$WORK/busy_compile.json"
keep "$WORK/busy_compile.txt" 4
if [ $DRY = 1 ]; then
  log "busy_graphs: not in a dry run (CUDA graphs are CUDA's; the CPU refuses them in one line)"
else
  run busy_graphs 100 $BB $PEAK --compile reduce-overhead --variants train_autocast \
    --json "$WORK/busy_graphs.json"
  keep "$WORK/busy_graphs.txt" 4
fi
python3 - "$WORK" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, pathlib, sys
rows = []
for mode in ("eager", "compile", "graphs"):
    try:
        steps = json.loads((pathlib.Path(sys.argv[1]) / f"busy_{mode}.json").read_text())["steps"]
    except (OSError, ValueError, KeyError):
        continue
    rows += [(s["variant"], mode, s) for s in steps if s.get("status") == "ok"]
for variant in dict.fromkeys(v for v, _, _ in rows):
    mine = [(m, s) for v, m, s in rows if v == variant]
    for m, s in mine:
        busy = "-" if s.get("gpu_busy") is None else f"{100 * s['gpu_busy']:.0f}%"
        print(f"busy: {variant} {m}: {s['step_ms']:.2f} ms/step, {s['images_per_s']:.0f} "
              f"images/s, GPU busy {busy}")
    fastest = min(mine, key=lambda ms: ms[1]["step_ms"])
    print(f"busy: fastest {variant}: {fastest[0]} ({fastest[1]['step_ms']:.2f} ms/step)")
PY

# torch.compile in training, with the new fp32_precision API set (--tf32): the compiler must
# not read the legacy TF32 flags then. Then the benchmark in the same configuration, warm.
run train_compile 150 python3 AMP/$VARIANT.py $DEV $BEST_FLAGS --compile $TF32 --dataset CIFAR10 \
  --dataset_root "$SCRATCH/small" --img_size $IMG --batch_size $BS --epochs 1 --no-tensorboard --checkpoint "$CK/train_compile"
keep "$WORK/train_compile.txt" 4; drop train_compile

# The figures as markdown tables, to copy into the README; each step's status.
python3 - "$WORK" >> "$OUT/summary.txt" 2>&1 <<'PY'
import json, pathlib, re, sys
work = pathlib.Path(sys.argv[1])
tsv = work / "steps.tsv"
steps = [line.split("\t") for line in (tsv.read_text().splitlines() if tsv.exists() else [])]
order = [s[0] for s in steps]  # the steps in the order they ran
def ran(paths, name):
    return sorted(paths, key=lambda p: order.index(name(p)) if name(p) in order else len(order))
def f(x, spec):
    return "-" if x is None else format(x, spec)
def load(p):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
print("\n## Figures (markdown tables, for the README)\n")
rows = [(p.stem, s) for p in ran([*work.glob("bench_*.json"), *work.glob("busy_*.json")],
                                  lambda p: p.stem)
        for s in load(p).get("steps", [])]
if rows:
    r0 = rows[0][1]
    print(f"Training step, synthetic batches ({r0['img_size']} px, "
          f"{r0['warmup']} warm-up + {r0['steps']} timed steps; benchmark.py; {r0['timer']}):\n")
    print("| step | variant | precision | dtype / fp32 math | channels_last | compiled | batch "
          "| step ms | images/s | x fp32 | peak MB | TFLOP/s | util | GPU busy | status |")
    print("|---|---|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|")
    for step, s in rows:
        util = "-" if s.get("utilisation") is None else f"{100 * s['utilisation']:.1f}%"
        busy = "-" if s.get("gpu_busy") is None else f"{100 * s['gpu_busy']:.0f}%"
        print(f"| {step} | {s['variant']} | {s['precision']} | {s['amp_dtype'] or s['fp32_math'] or '-'} "
              f"| {'yes' if s['channels_last'] else 'no'} | {s['compiled'] or 'no'} | {s['batch_size']} "
              f"| {f(s['step_ms'], '.1f')} | {f(s['images_per_s'], '.0f')} | {f(s.get('speedup'), '.2f')} "
              f"| {f(s['peak_mem_mb'], '.0f')} | {f(s['achieved_tflops'], '.1f')} | {util} | {busy} "
              f"| {s['status']} {s.get('reason') or ''}|")
    print("\n(x fp32: images/s over the fp32 row of the same parallel mode and settings, in the "
          "same step; util: of the precision's dense peak)")
pipes = load(work / "pipeline.json").get("pipeline", [])
if pipes:
    print(f"\nInput pipeline alone ({pipes[0]['img_size']} px, batch {pipes[0]['batch_size']}):\n")
    print("| path | dataset | workers | images/s |\n|---|---|--:|--:|")
    for p in pipes:
        print(f"| {p['path']} | {p['dataset']} | {p['num_workers']} | "
              f"{f(p['images_per_s'], '.0f') if p['status'] == 'ok' else p['status']} |")
logs = ran(work.glob("*.log.jsonl"), lambda p: p.name[:-len(".log.jsonl")])
if logs:
    print("\nTraining runs (their log.jsonl, one row per epoch; a resumed run continues its log):\n")
    print("| step | epoch | train loss | val acc | images/s | train s | epoch s | peak MB | skipped steps |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for p in logs:
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            print(f"| {p.name[:-len('.log.jsonl')]} | {r.get('epoch')} | {f(r.get('train_loss'), '.4f')} "
                  f"| {f(r.get('val_acc'), '.4f')} | {f(r.get('images_per_s'), '.0f')} "
                  f"| {f(r.get('train_time'), '.1f')} | {f(r.get('epoch_time'), '.1f')} "
                  f"| {f(r.get('peak_mem_mb'), '.0f')} | {r.get('skipped_steps', '-')} |")
evals = [(p.stem, m.group(0)) for p in ran(work.glob("eval_*.txt"), lambda p: p.stem)
         for m in [re.search(r"top-1 accuracy.*", p.read_text())] if m]
if evals:
    print("\nEvaluations:\n\n| step | result |\n|---|---|")
    for name, line in evals:
        print(f"| {name} | {line} |")
print("\nSteps:\n\n| step | exit status | seconds |\n|---|--:|--:|")
for s in steps:
    print("| " + " | ".join(s) + " |")
print()
PY

finish
