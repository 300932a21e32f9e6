#!/usr/bin/env bash
# "As fast as the fastest peer": the same training job with the project's scripts, with HF
# accelerate (checks/peers/accelerate_digits.py) and with PyTorch Lightning
# (checks/peers/lightning_digits.py), each timed as a whole process (wall seconds: start-up,
# imports, data, 3 epochs of training and validation, a checkpoint every epoch, exit), at 1
# process and at 2 CPU processes (gloo), ROUNDS rounds, interleaved: the order of the three
# rotates from round to round. Prints each round's walls and CPU seconds, and a table of
# the medians of each: the peers' median and smallest ratio to the project's figure of the
# same round. On a shared machine whose speed drifts from minute to minute the CPU seconds
# (user + system, GNU time's, every process of the job) move less than the walls.
#
#   bash checks/peers.sh                       # ROUNDS=3; about 5 minutes a round on 2 cores
#   ROUNDS=1 OUT=/tmp/peers bash checks/peers.sh
#
# Needs: the project's requirements, scikit-learn (AMP/tools/digits.py writes the data set)
# and the peers: pip install -r checks/requirements-peers.txt; GNU time at /usr/bin/time
# (Debian's package time). A CPU; no network.
# PRECISION (default bf16): fp32 runs the job without autocast (train_without.py and
# train_DDP.py, accelerate's mixed_precision="no", Lightning's "32-true"), for a CPU without
# bf16 instructions (AVX2 only: there oneDNN's bf16 backward of AlexNet takes ~40 s a step
# against 0.7 s in fp32, measured on an AMD EPYC with torch 2.14.1).
# Optional: OUT (default a new folder under /tmp): times.csv (round,job,processes,position,
# wall_s,cpu_s), versions.txt and each job's log, round by round; DATA (default OUT/digits, written
# once if absent); EPOCHS (default 3: the job; fewer only to try the script); KEEP=1 keeps
# the checkpoints (otherwise each job's is checked, then deleted: ~0.7-0.9 GB a job).
# The 2-process jobs run with OMP_NUM_THREADS=1 (torchrun sets it for the project's workers;
# the peers get it too); the 1-process jobs without it (PyTorch's default: every core).
# Exit status non-zero, with the job's last lines, if a job fails.
#
# The job (the same in all three): the digits ImageFolder (1,438 train / 359 val), Resize 64,
# ToTensor, Normalize, a horizontal flip for training; batch 64 per process, num_workers=0;
# torchvision's AlexNet (10 classes) after torch.manual_seed(0); CrossEntropyLoss, AdamW
# lr 1e-4 (fused=True in all three), ReduceLROnPlateau(mode="max", patience=3) stepped once an
# epoch on the validation top-1; bf16 autocast on the CPU; 3 epochs, each validated and saved.
# Differences that remain (none removable without leaving the libraries' plain usage):
# - accelerate at 2 processes trains 768 images per process an epoch, not 719: its sharding
#   (even_batches, the default) deals whole batches of 64 to the processes and completes the
#   last ones from the epoch's start (24 batches of 64 in all, against 2 x 12 with a last
#   batch of 15); it validates 384 images (its padding, left out of the accuracy by
#   gather_for_metrics) where the project forwards 359. Lightning's DistributedSampler
#   validates 360 (one image twice, counted). At 1 process all three see the same images.
# - The flip: the project's sampler draws each image's flip (seeded) and mirrors the
#   normalised tensor; the peers' RandomHorizontalFlip mirrors the 64 px PIL image.
# - The project does more per run: the gradient norm every step (it is logged), a FLOP
#   count (on the meta device: nothing computed), a progress bar, log.jsonl, an
#   fsync of every checkpoint before it replaces the previous one, and best.pth (a second
#   name for the best epoch's last.pth: no bytes more); last.pth (weights, AdamW, schedule,
#   random streams, ~690 MB) is written in the background while the next epoch trains.
#   accelerate: save_state (~690 MB, overwritten every epoch, in the loop). Lightning: one
#   full .ckpt an epoch (~690 MB, the previous removed) and last.ckpt a link to it
#   (save_last="link"; save_last=True writes the same state twice); no progress bar, no
#   logger, num_sanity_val_steps=0 (its default validates 2 batches before training); it
#   prints its model summary.
# - Processes at 2: the project is torchrun plus 2 workers; accelerate is `accelerate
#   launch --multi_gpu` (torchrun inside it, on a machine without CUDA) plus 2 workers;
#   Lightning is the script itself as rank 0, which starts rank 1 (Trainer(devices=2,
#   strategy="ddp")): one interpreter fewer.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x /usr/bin/time ] || { echo "peers.sh: needs GNU time at /usr/bin/time (Debian: apt-get install time)"; exit 2; }
ROUNDS=${ROUNDS:-3}
EPOCHS=${EPOCHS:-3}
PRECISION=${PRECISION:-bf16}
OUT=${OUT:-$(mktemp -d /tmp/peers.XXXXXX)}
mkdir -p "$OUT"
DATA=${DATA:-$OUT/digits}
CSV=$OUT/times.csv

[ -d "$DATA/train" ] || python AMP/tools/digits.py "$DATA" >/dev/null
python - > "$OUT/versions.txt" <<'EOF'
import platform, torch, torchvision, accelerate, lightning
print(f"python {platform.python_version()} torch {torch.__version__} torchvision "
      f"{torchvision.__version__} accelerate {accelerate.__version__} lightning "
      f"{lightning.__version__}; {torch.get_num_threads()} threads")
EOF
echo "peers.sh: $ROUNDS round(s) of $EPOCHS epoch(s), $PRECISION, into $OUT; $(cat "$OUT/versions.txt")"
echo "round,job,processes,position,wall_s,cpu_s" > "$CSV"

COMMON=(--dataset ImageFolder --dataset_root "$DATA" --img_size 64 --arch alexnet
        --epochs "$EPOCHS" --batch_size 64 --no-tensorboard --no-cuda --seed 0)
PEER=(--data "$DATA" --epochs "$EPOCHS" --batch_size 64 --precision "$PRECISION")
case $PRECISION in
  bf16) ONE=AMP/train_autocast.py DDP=AMP/train_DDP_autocast.py ACC=bf16 ;;
  fp32) ONE=AMP/train_without.py DDP=AMP/train_DDP.py ACC=no ;;
  *) echo "peers.sh: PRECISION is bf16 or fp32, not $PRECISION"; exit 2 ;;
esac

# job IMPL PROCS DIR: the command line of a job (one word an argument, in JOB[@]).
job() {
  local impl=$1 n=$2 dir=$3
  local threads=(env -u OMP_NUM_THREADS)
  if [ "$n" -gt 1 ]; then threads=(env OMP_NUM_THREADS=1); fi
  case $impl:$n in
    project:1) JOB=("${threads[@]}" python "$ONE" "${COMMON[@]}" --checkpoint "$dir") ;;
    project:*) JOB=("${threads[@]}" python -m torch.distributed.run --standalone
                    --nproc_per_node="$n" "$DDP" "${COMMON[@]}" --checkpoint "$dir") ;;
    accelerate:1) JOB=("${threads[@]}" python checks/peers/accelerate_digits.py "${PEER[@]}"
                       --out "$dir" --processes 1) ;;
    accelerate:*) JOB=("${threads[@]}" accelerate launch --multi_gpu --num_processes "$n"
                       --num_machines 1 --mixed_precision "$ACC" --dynamo_backend no
                       checks/peers/accelerate_digits.py "${PEER[@]}" --out "$dir" --processes "$n") ;;
    lightning:*) JOB=("${threads[@]}" python checks/peers/lightning_digits.py "${PEER[@]}"
                      --out "$dir" --processes "$n") ;;
  esac
}

# The checkpoint each job leaves, which must be there.
saved() {
  case $1 in
    project) ls "$2"/*/last.pth ;;
    accelerate) ls "$2"/optimizer.bin "$2"/model.safetensors ;;
    lightning) ls "$2"/last.ckpt ;;
  esac >/dev/null 2>&1
}

IMPLS=(project accelerate lightning)
for ((r = 1; r <= ROUNDS; r++)); do
  dir=$OUT/round$r
  mkdir -p "$dir"
  line="round $r:"
  for n in 1 2; do
    for ((k = 0; k < 3; k++)); do
      impl=${IMPLS[$(( (k + r - 1) % 3 ))]}  # round 1: project first; round 2: accelerate...
      name=$impl$n
      job "$impl" "$n" "$dir/$name"
      echo "${JOB[*]}" > "$dir/$name.cmd"
      rc=0
      /usr/bin/time -f "%e %U %S" -o "$dir/$name.time" "${JOB[@]}" > "$dir/$name.log" 2>&1 || rc=$?
      read -r wall user sys < <(tail -n 1 "$dir/$name.time")
      cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.2f", u + s }')
      if [ "$rc" -ne 0 ] || ! grep -q '^done' "$dir/$name.log" || ! saved "$impl" "$dir/$name"; then
        echo "peers.sh: round $r, $name failed (exit status $rc, or no done: line or checkpoint):"
        echo "  ${JOB[*]}"
        tail -n 25 "$dir/$name.log"
        exit 1
      fi
      [ "${KEEP:-0}" = 1 ] || rm -rf "$dir/$name"
      echo "$r,$impl,$n,$((k + 1)),$wall,$cpu" >> "$CSV"
      line="$line $name ${wall}s (cpu ${cpu}s)"
    done
  done
  echo "$line"
done

python - "$CSV" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
rounds = sorted({int(r["round"]) for r in rows})
for column, what in (("wall_s", "whole-process wall seconds"),
                     ("cpu_s", "CPU seconds (user + system, every process of the job)")):
    t = {(int(r["round"]), r["job"], int(r["processes"])): float(r[column]) for r in rows}
    print(f"\n{what}, median of {len(rounds)} round(s); peer/project: the median and the "
          "smallest of the rounds' ratios")
    print(f"{'job':<12} | {'project':>8} | {'accelerate':>27} | {'Lightning':>27}")
    for n in (1, 2):
        cells = [f"{statistics.median(t[r, 'project', n] for r in rounds):7.1f}s"]
        for peer in ("accelerate", "lightning"):
            ratios = [t[r, peer, n] / t[r, "project", n] for r in rounds]
            med = statistics.median(t[r, peer, n] for r in rounds)
            cells.append(f"{med:7.1f}s (x{statistics.median(ratios):.2f}, min x{min(ratios):.2f})")
        print(f"{f'{n} process' + ('es' if n > 1 else ''):<12} | {cells[0]:>8} | {cells[1]:>27} | "
              f"{cells[2]:>27}")
EOF
echo "raw times: $CSV"
