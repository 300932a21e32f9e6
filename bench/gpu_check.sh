#!/usr/bin/env bash
# One call on a GPU machine: CUDA tests, step benchmark, input pipeline, and a real
# 2-epoch CIFAR-format run at 227 px. Results land in $OUT (default: ./gpu_out).
#   bash bench/gpu_check.sh            (device tool: run with timeout_s ~540)
# Uses whatever python3 has torch (the device machine: torch 2.11, no network).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, torchvision; print(torch.__version__, torchvision.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/summary.txt"

log "pytest -m cuda (and the fast-path CUDA test)"
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py tests/test_precision.py tests/test_fastdata.py \
  tests/test_resilience.py > "$OUT/pytest_cuda.txt" 2>&1; echo "rc=$?" >> "$OUT/pytest_cuda.txt"
tail -3 "$OUT/pytest_cuda.txt" | tee -a "$OUT/summary.txt"

log "step benchmark, fp16 (default) and bf16, 227 px, batch 256"
timeout 120 python3 AMP/benchmark.py --cuda --img_size 227 --batch_size 256 --steps 30 --warmup 10 \
  --variants train_without,train_autocast,train_GradScaler,train_DP,train_DP_autocast \
  --peak_tflops 989 --json "$OUT/bench_fp16.json" > "$OUT/bench_fp16.txt" 2>&1
timeout 60 python3 AMP/benchmark.py --cuda --img_size 227 --batch_size 256 --steps 30 --warmup 10 \
  --variants train_autocast --amp_dtype bfloat16 --pipeline none --peak_tflops 989 \
  --json "$OUT/bench_bf16.json" > "$OUT/bench_bf16.txt" 2>&1
tail -20 "$OUT/bench_fp16.txt" "$OUT/bench_bf16.txt" >> "$OUT/summary.txt"

log "input pipeline alone at 227 (article PIL path, classic DataLoader x8 workers, fast)"
timeout 90 python3 bench/input_pipeline.py --device cuda --num_workers 8 --n 8192 > "$OUT/pipeline.txt" 2>&1
tail -8 "$OUT/pipeline.txt" >> "$OUT/summary.txt"

log "real run: train_autocast, 50k generated CIFAR-format images, 227 px, 2 epochs, batch 256, channels_last"
python3 - <<'PY'
import sys; sys.path.insert(0, "AMP")
from pathlib import Path
from ampkit.pipeline_bench import write_cifar10
write_cifar10(Path("/tmp/cifar_gen"), 50000, 10000)
PY
timeout 150 python3 AMP/train_autocast.py --cuda --dataset CIFAR10 --dataset_root /tmp/cifar_gen \
  --epochs 2 --batch_size 256 --lr 1e-3 --channels_last --no-tensorboard --checkpoint /tmp/ck \
  > "$OUT/train_autocast.txt" 2>&1
grep -E "epoch [0-9]+/|done:" "$OUT/train_autocast.txt" | tr '\r' '\n' | grep -v "it/s" | tee -a "$OUT/summary.txt"
cp /tmp/ck/train_autocast/log.jsonl "$OUT/train_autocast.log.jsonl" 2>/dev/null
exit 0
