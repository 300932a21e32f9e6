#!/usr/bin/env bash
# One call on a GPU machine: the GPU figures of the README, then the CUDA tests.
#   bash bench/gpu_check.sh              # on the GPU (device tool: timeout_s 600)
#   bash bench/gpu_check.sh --dry-run    # the same steps on the CPU at toy sizes (~2 min):
#                                        # checks the script itself before GPU time is spent
# Results land in $OUT (default ./gpu_out): summary.txt first, one file per step beside it.
# Steps run in order of importance, each under a timeout capped by what is left of
# BUDGET seconds (default 500), so a slow step cannot cost the ones after it the call.
#   1. step benchmark at 227, batch 256: fp32 / fp16 / fp16+GradScaler (NCHW, channels_last),
#      bf16 / bf16+GradScaler (channels_last), DP over the visible GPUs;
#   2. a real run of the fastest single-device configuration of step 1: 2 epochs of 50,000
#      generated (learnable) CIFAR-format images at 227, fast input path;
#   3. the input pipeline alone (article PIL path, classic DataLoader with workers, fast);
#   4. pytest -m cuda;  5. torch.compile benchmark of the fastest configuration.
# Uses whatever python3 has torch (the device machine: torch 2.11, no network).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-500}
export PYTHONUNBUFFERED=1
if [ "${1:-}" = "--dry-run" ]; then
  DEV=--no-cuda; PDEV=cpu; IMG=64; BS=8; STEPS="--steps 2 --warmup 1"; NTRAIN=64; NTEST=16
  PIPE_B=2; WORKERS=1; PEAK=1
else
  DEV=--cuda; PDEV=cuda; IMG=227; BS=256; STEPS="--steps 30 --warmup 10"; NTRAIN=50000
  NTEST=10000; PIPE_B=30; WORKERS=8; PEAK=989  # H200 dense bf16/fp16 TFLOP/s (datasheet)
fi
log() { echo "== [${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
# run NAME MAX_SECONDS CMD...: stdout+stderr to $OUT/NAME.txt, timeout min(MAX, time left).
run() {
  local name=$1 max=$2; shift 2
  local left=$((BUDGET - SECONDS)); [ "$left" -lt "$max" ] && max=$left
  if [ "$max" -lt 15 ]; then log "$name: skipped (budget spent)"; return 124; fi
  log "$name (timeout ${max}s): $*"
  timeout "$max" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  echo "rc=$rc" >> "$OUT/$name.txt"; [ "$rc" -ne 0 ] && log "$name: rc=$rc"
  return $rc
}
# Tables and result lines only (tqdm redraws with \r are dropped).
keep() { tr '\r' '\n' < "$1" | grep -vE "it/s\]|s/it\]|^ *$" | tail -n "${2:-30}" >> "$OUT/summary.txt"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true; } > "$OUT/gpu.txt"
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" 2>&1 | tee -a "$OUT/summary.txt"

B="python3 AMP/benchmark.py $DEV --img_size $IMG --batch_size $BS $STEPS --peak_tflops $PEAK"
run bench_fp16 90 $B --variants train_without,train_autocast,train_GradScaler,train_DP,train_DP_autocast \
  --pipeline none --json "$OUT/bench_fp16.json"; keep "$OUT/bench_fp16.txt" 12
run bench_fp16_cl 60 $B --channels_last --variants train_without,train_autocast,train_GradScaler \
  --pipeline none --json "$OUT/bench_fp16_cl.json"; keep "$OUT/bench_fp16_cl.txt" 8
run bench_bf16_cl 60 $B --channels_last --amp_dtype bfloat16 --variants train_autocast,train_GradScaler \
  --pipeline none --json "$OUT/bench_bf16_cl.json"; keep "$OUT/bench_bf16_cl.txt" 7

# The fastest single-device configuration measured above -> its training script's flags.
BEST=$(python3 - "$OUT" <<'PY'
import json, pathlib, sys
best = None
for f in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.json")):
    for s in json.loads(f.read_text())["steps"]:
        if s["status"] == "ok" and s["parallel"] == "single" and (best is None or s["images_per_s"] > best["images_per_s"]):
            best = s
if best is None:
    print("train_autocast --channels_last")
else:
    flags = [best["variant"]] + (["--amp_dtype", best["amp_dtype"]] if best["amp_dtype"] else [])
    print(" ".join(flags + (["--channels_last"] if best["channels_last"] else [])))
PY
)
log "fastest single-device configuration: $BEST"
set -- $BEST; VARIANT=$1; shift; BEST_FLAGS="$*"

python3 - "$NTRAIN" "$NTEST" <<'PY'
import sys; sys.path.insert(0, "AMP")
from pathlib import Path
from ampkit.measure import write_cifar10
write_cifar10(Path("/tmp/gpu_check_cifar"), int(sys.argv[1]), int(sys.argv[2]), learnable=True)
PY
run real_run 150 python3 AMP/$VARIANT.py $DEV $BEST_FLAGS --dataset CIFAR10 --dataset_root /tmp/gpu_check_cifar \
  --img_size $IMG --epochs 2 --batch_size $BS --lr 1e-4 --no-tensorboard --checkpoint /tmp/gpu_check_ckpt
keep "$OUT/real_run.txt" 6
cp /tmp/gpu_check_ckpt/$VARIANT/log.jsonl "$OUT/real_run.log.jsonl" 2>/dev/null

run pipeline 60 python3 AMP/benchmark.py $DEV --variants none --pipeline all --img_size $IMG --num_workers $WORKERS --batch_size $BS --pipeline_batches $PIPE_B
keep "$OUT/pipeline.txt" 6

run pytest_cuda 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests
keep "$OUT/pytest_cuda.txt" 15

run bench_compile 120 $B --compile $BEST_FLAGS --variants $VARIANT --pipeline none \
  --json "$OUT/bench_compile.json"; keep "$OUT/bench_compile.txt" 5
log "done"
exit 0
