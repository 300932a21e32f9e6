#!/usr/bin/env bash
# One call on a GPU machine: the GPU figures of the README, then the CUDA tests.
#   bash bench/gpu_check.sh              # on the GPU (device tool: timeout_s 600)
#   bash bench/gpu_check.sh --dry-run    # the same steps on the CPU at toy sizes (~2 min):
#                                        # checks the script itself before GPU time is spent
# $OUT (default ./gpu_out) receives two files, as the device tool brings back at most 8:
# summary.txt (every step's command, result lines, exit status, or why it was skipped) and
# details.tar.gz (each step's whole output and JSON), repacked after every step.
# Steps run in order of importance, each under a timeout capped by what is left of
# BUDGET seconds (default 500), so a slow step cannot cost the ones after it the call;
# no process of a step outlives it (bench/steps.sh).
#   1. step benchmark at 227, batch 256: fp32 / fp16 / fp16+GradScaler (NCHW, channels_last),
#      bf16 / bf16+GradScaler (channels_last), DP over the visible GPUs; fp32 without TF32;
#   2. a real run of the fastest single-device configuration of step 1: 2 epochs of 50,000
#      generated (learnable) CIFAR-format images at 227, fast input path;
#   3. the input pipeline alone (article PIL path, classic DataLoader with workers, fast);
#   4. pytest -m cuda;  5. torch.compile benchmark of the fastest configuration.
# Uses whatever python3 has torch (the device machine: torch 2.11, no network).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; rm -f "$OUT/summary.txt" "$OUT/details.tar.gz"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
BUDGET=${BUDGET:-500}
export PYTHONUNBUFFERED=1
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
if [ $DRY = 1 ]; then
  DEV=--no-cuda; IMG=64; BS=8; STEPS="--steps 2 --warmup 1"; NTRAIN=64; NTEST=16
  PIPE_B=2; WORKERS=1; PEAK="--peak_tflops 1 --peak_tflops_fp32 1"; PEAK_IEEE=1
else
  # H200 datasheet, dense: fp16/bf16 989 TFLOP/s, TF32 495, fp32 67.
  DEV=--cuda; IMG=227; BS=256; STEPS="--steps 30 --warmup 10"; NTRAIN=50000; NTEST=10000
  PIPE_B=30; WORKERS=8; PEAK="--peak_tflops 989 --peak_tflops_fp32 495"; PEAK_IEEE=67
fi
source bench/steps.sh

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true; } | head -3 >> "$OUT/summary.txt"
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" 2>&1 | tee -a "$OUT/summary.txt"

B="python3 AMP/benchmark.py $DEV --img_size $IMG --batch_size $BS $STEPS --pipeline none"
run bench_fp16 90 $B $PEAK --variants train_without,train_autocast,train_GradScaler,train_DP,train_DP_autocast \
  --json "$WORK/bench_fp16.json"; keep "$WORK/bench_fp16.txt" 12
run bench_fp16_cl 60 $B $PEAK --channels_last --variants train_without,train_autocast,train_GradScaler \
  --json "$WORK/bench_fp16_cl.json"; keep "$WORK/bench_fp16_cl.txt" 8
run bench_bf16_cl 60 $B $PEAK --channels_last --amp_dtype bfloat16 --variants train_autocast,train_GradScaler \
  --json "$WORK/bench_bf16_cl.json"; keep "$WORK/bench_bf16_cl.txt" 7
run bench_fp32_ieee 45 $B --no-tf32 --peak_tflops_fp32 $PEAK_IEEE --channels_last --variants train_without \
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

python3 - "$NTRAIN" "$NTEST" <<'PY'
import sys; sys.path.insert(0, "AMP")
from pathlib import Path
from ampkit.machinery.measure import write_cifar10
write_cifar10(Path("/tmp/gpu_check_cifar"), int(sys.argv[1]), int(sys.argv[2]), learnable=True)
PY
run real_run 150 python3 AMP/$VARIANT.py $DEV $BEST_FLAGS --dataset CIFAR10 --dataset_root /tmp/gpu_check_cifar \
  --img_size $IMG --epochs 2 --batch_size $BS --lr 1e-4 --no-tensorboard --checkpoint "$WORK/ckpt"
keep "$WORK/real_run.txt" 6
cp "$WORK/ckpt/$VARIANT/log.jsonl" "$WORK/real_run.log.jsonl" 2>/dev/null; rm -rf "$WORK/ckpt"; pack

run pipeline 60 python3 AMP/benchmark.py $DEV --variants none --pipeline all --img_size $IMG \
  --num_workers $WORKERS --batch_size $BS --pipeline_batches $PIPE_B
keep "$WORK/pipeline.txt" 6

run pytest_cuda 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests
keep "$WORK/pytest_cuda.txt" 15

run bench_compile 120 $B $PEAK --compile $BEST_FLAGS --variants $VARIANT \
  --json "$WORK/bench_compile.json"; keep "$WORK/bench_compile.txt" 5

# What comes back: at most 8 files, none more than 2 folders down.
files=$(find "$OUT" -type f | wc -l); deep=$(find "$OUT" -mindepth 3 -type f | wc -l)
log "done: $files files under \$OUT ($(ls "$OUT" | tr '\n' ' ')), $deep deeper than 2 folders"
rm -rf "$WORK"
[ "$files" -le 8 ] && [ "$deep" -eq 0 ]
