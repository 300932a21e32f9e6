#!/usr/bin/env bash
# "As fast as the fastest peer": one training job with the project's scripts, with HF
# accelerate and with PyTorch Lightning, each timed as a whole process (wall seconds: start-up,
# imports, data, the epochs' training and validation, a checkpoint every epoch, exit), ROUNDS
# rounds, interleaved: the order of the three rotates from round to round. Two jobs: JOB=digits
# (the default; checks/peers/accelerate_digits.py and lightning_digits.py) at 1 and 2 CPU
# processes (gloo), and JOB=fashion (checks/peers/accelerate_fashion.py and
# lightning_fashion.py) at 1, which also times how soon each reaches a test accuracy, TARGET.
# Prints each round's walls and CPU seconds, and a table of the medians of each: the peers'
# median and smallest ratio to the project's figure of the same round. On a shared machine
# whose speed drifts from minute to minute the CPU seconds (user + system, GNU time's, every
# process of the job) move less than the walls.
#
#   bash checks/peers.sh                       # ROUNDS=3; about 5 minutes a round on 2 cores
#   ROUNDS=1 OUT=/tmp/peers bash checks/peers.sh
#   JOB=fashion bash checks/peers.sh           # 2 epochs of 94 steps, 10,000 test images each
#   JOB=fashion PROJECT_FLAGS="--channels_last --batch_size 128" bash checks/peers.sh
#
# Needs: the project's requirements, scikit-learn (AMP/tools/digits.py writes the digits) or
# Fashion-MNIST's idx files (Debian: apt-get install dataset-fashion-mnist), and the peers:
# pip install -r checks/requirements-peers.txt; GNU time at /usr/bin/time (Debian's package
# time). A CPU; no network.
# PRECISION (default bf16): fp32 runs the job without autocast (train_without.py and
# train_DDP.py, accelerate's mixed_precision="no", Lightning's "32-true"), for a CPU without
# bf16 instructions (AVX2 only: there oneDNN's bf16 backward of AlexNet takes ~40 s a step
# against 0.7 s in fp32, measured on an AMD EPYC with torch 2.14.1).
# Optional: OUT (default a new folder under /tmp): times.csv (round,job,processes,position,
# wall_s,cpu_s, and for JOB=fashion val_acc,target_epoch,train_to_target_s,wall_to_target_s),
# versions.txt and each job's log, round by round; DATA (default OUT/digits, written once if
# absent; OUT/fashion for JOB=fashion); EPOCHS (default 3 for digits, 2 for fashion: the job;
# fewer, or a smaller SUBSET, only to try the script); PROCESSES (default "1 2" for digits,
# "1" for fashion: the process counts, each a job of its own); KEEP=1 keeps the checkpoints
# (otherwise each job's is checked, then deleted: ~0.7-0.9 GB a job); PROJECT_FLAGS: more
# flags for the project's scripts, a configuration to compare (words split at spaces): a
# --batch_size there is the peers' too (per process), and the flags of the job itself (data,
# size, network, epochs, seed, learning rate, precision, checkpoint) are refused: peers.sh
# sets them for all three.
# The 2-process jobs run with OMP_NUM_THREADS=1 (torchrun sets it for the project's workers;
# the peers get it too); the 1-process jobs without it (PyTorch's default: every core).
# Exit status non-zero, with the job's last lines, if a job fails.
#
# The digits job (the same in all three): the digits ImageFolder (1,438 train / 359 val),
# Resize 64, ToTensor, Normalize, a horizontal flip for training; batch 64 per process,
# num_workers=0; torchvision's AlexNet (10 classes) after torch.manual_seed(0);
# CrossEntropyLoss, AdamW lr 1e-4 (fused=True in all three), ReduceLROnPlateau(mode="max",
# patience=3) stepped once an epoch on the validation top-1; bf16 autocast on the CPU; 3
# epochs, each validated and saved.
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
#   strategy="ddp")): one interpreter fewer. Lightning's rank 1 is in the CPU seconds only
#   where rank 0 reaped it before exiting (its observer thread polls the child every 5 s):
#   at 2 processes Lightning's CPU column can miss a process.
#
# The fashion job: Fashion-MNIST's idx files, from FASHION (default
# /usr/share/datasets/fashion-mnist, gzipped or not) into DATA/FashionMNIST/raw/ once, ungzipped
# (torchvision's layout, which all three read); SUBSET (default 6000) training images, the
# project's --train_subset (as many of each class, the same for every seed), whose indices
# peers.sh writes to OUT/subset_N.txt with the project's balanced_subset for the peers'
# torch.utils.data.Subset; the 10,000 test images validated after each epoch; 64 px, grey to 3
# channels, Fashion-MNIST's mean and std (0.2860, 0.3530), a horizontal flip for training;
# the network, optimizer, schedule, precision and checkpoints as the digits job's; 2 epochs.
# Each job leaves OUT/roundR/NAME.jsonl, a row an epoch: epoch, val_acc,
# train_seconds_cumulative (the epochs' training loops: the project's log.jsonl train_time,
# the peers' --log rows), wall_seconds_since_start (from the job's launch to the moment its
# epoch line, which carries the accuracy, reached peers.sh). TARGET (default 0.70, which each
# of the three passed at its second epoch and none at its first, in a trial): the
# tables add each one's median test accuracy after the last epoch and the median time to
# TARGET: the training seconds, and the whole-process seconds, to the end of the first epoch
# at or above it (a round that never reaches it counts apart). The differences beside the
# digits job's:
# - The input: the project takes its fast path (the default for FashionMNIST: both splits read
#   once into uint8 tensors; a batch is flipped at 28 px, resized (bilinear, antialiased, on
#   uint8) and normalised as one tensor, no DataLoader); the peers read torchvision's
#   FashionMNIST through a DataLoader, image by image in PIL (Resize(64), Grayscale(3),
#   RandomHorizontalFlip at 64 px, ToTensor, Normalize). PROJECT_FLAGS="--loader classic"
#   gives the project a DataLoader and PIL too (its flip still the tensor's).
# - The draw: the three shuffle, flip and drop out from different random streams (the
#   project's from --seed 0 and the epoch, the peers' from torch's global generator after
#   manual_seed(0)), so their accuracies after an epoch differ by chance too, and the time to
#   TARGET counts whole epochs: where one reaches TARGET an epoch later than another, that is
#   the draw as much as the speed. The seeds are fixed: the rounds time the same draws again.
# - The clocks: the project's training seconds run from before its epoch's first batch to its
#   last step's figures read on the host; accelerate's from model.train() to the loop's end;
#   Lightning's from on_train_epoch_start to on_validation_epoch_start (its loop's own work
#   inside). The project prints its epoch line once its checkpoint is handed to the background
#   writer (its snapshot: 0.4 s in a trial); the peers print theirs before they save.
# - At 2 processes (PROCESSES="1 2"): accelerate trains 3,008 images a process (47 whole
#   batches each, the last completed from the epoch's start) and forwards 10,112 test images
#   (its padding, left out by gather_for_metrics); the project and Lightning 3,000 and 5,000.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "peers.sh: $*"; exit 2; }
[ -x /usr/bin/time ] || fail "needs GNU time at /usr/bin/time (Debian: apt-get install time)"
JOB=${JOB:-digits}
case $JOB in
  digits) EPOCHS=${EPOCHS:-3} PROCESSES=${PROCESSES:-1 2}
          [ -z "${SUBSET:-}${TARGET:-}${FASHION:-}" ] ||
            fail "SUBSET, TARGET and FASHION are JOB=fashion's" ;;
  fashion) EPOCHS=${EPOCHS:-2} PROCESSES=${PROCESSES:-1} SUBSET=${SUBSET:-6000}
           TARGET=${TARGET:-0.70} FASHION=${FASHION:-/usr/share/datasets/fashion-mnist}
           [[ $SUBSET =~ ^[1-9][0-9]*$ && $SUBSET -ge 10 && $SUBSET -le 60000 ]] ||
             fail "SUBSET is a number of training images, 10 to 60000, not '$SUBSET'"
           [[ $TARGET =~ ^(0?\.[0-9]+|1(\.0*)?)$ ]] ||
             fail "TARGET is a test accuracy, 0 to 1, not '$TARGET'" ;;
  *) fail "JOB is digits or fashion, not $JOB" ;;
esac
ROUNDS=${ROUNDS:-3}
PRECISION=${PRECISION:-bf16}
case $PRECISION in
  bf16) ONE=AMP/train_autocast.py DDP=AMP/train_DDP_autocast.py ACC=bf16 ;;
  fp32) ONE=AMP/train_without.py DDP=AMP/train_DDP.py ACC=no ;;
  *) fail "PRECISION is bf16 or fp32, not $PRECISION" ;;
esac
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || fail "ROUNDS is a positive whole number, not '$ROUNDS'"
[[ $EPOCHS =~ ^[1-9][0-9]*$ ]] || fail "EPOCHS is a positive whole number, not '$EPOCHS'"
read -r -a NS <<< "$PROCESSES"
for n in "${NS[@]}"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || fail "PROCESSES: process counts, not '$n'"
done
[ "${#NS[@]}" -gt 0 ] || fail "PROCESSES is empty"

# PROJECT_FLAGS: the project's configuration; its --batch_size (argparse takes the last one
# given, and any unambiguous prefix) is the peers' too.
read -r -a PFLAGS <<< "${PROJECT_FLAGS:-}"
BATCH=64
for ((i = 0; i < ${#PFLAGS[@]}; i++)); do
  word=${PFLAGS[i]} name=${PFLAGS[i]%%=*}
  [[ $name == --?* ]] || continue
  for own in --dataset --dataset_root --train_subset --img_size --arch --epochs --seed --lr \
             --amp_dtype --device --no-cuda --checkpoint; do
    [[ $own != "$name"* ]] ||
      fail "PROJECT_FLAGS: $word sets the job itself, which peers.sh sets alike for all three"
  done
  if [[ --batch_size == "$name"* ]]; then
    if [[ $word == *=* ]]; then BATCH=${word#*=}; else BATCH=${PFLAGS[i + 1]:-}; fi
  fi
done
[[ $BATCH =~ ^[1-9][0-9]*$ ]] ||
  fail "PROJECT_FLAGS: --batch_size takes a positive whole number, not '$BATCH'"

OUT=${OUT:-$(mktemp -d /tmp/peers.XXXXXX)}
mkdir -p "$OUT"
DATA=${DATA:-$OUT/$JOB}
CSV=$OUT/times.csv

if [ "$JOB" = digits ]; then
  [ -d "$DATA/train" ] || python AMP/tools/digits.py "$DATA" >/dev/null
else
  # torchvision's FashionMNIST reads ROOT/FashionMNIST/raw/, its files ungzipped.
  raw=$DATA/FashionMNIST/raw
  mkdir -p "$raw"
  for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte \
           t10k-labels-idx1-ubyte; do
    if [ -f "$raw/$f" ]; then continue
    elif [ -f "$FASHION/$f.gz" ]; then
      gunzip -c "$FASHION/$f.gz" > "$raw/$f.part" && mv "$raw/$f.part" "$raw/$f"
    elif [ -f "$FASHION/$f" ]; then ln -s "$(realpath "$FASHION/$f")" "$raw/$f"
    else fail "no $f(.gz) in $FASHION: apt-get install dataset-fashion-mnist, or FASHION=DIR"
    fi
  done
  # The project's --train_subset, as indices for the peers (which do not import the project).
  SUBSET_FILE=$OUT/subset_$SUBSET.txt
  PYTHONPATH=AMP python - "$DATA" "$SUBSET" > "$SUBSET_FILE" <<'EOF'
import sys
from ampkit.data.datasets import FASHION_CLASSES, load_fashion_mnist
from ampkit.data.order import balanced_subset
_, labels = load_fashion_mnist(sys.argv[1], True, download=False)
print("\n".join(map(str, balanced_subset(labels, int(sys.argv[2]), FASHION_CLASSES))))
EOF
fi
python - > "$OUT/versions.txt" <<'EOF'
import platform, torch, torchvision, accelerate, lightning
print(f"python {platform.python_version()} torch {torch.__version__} torchvision "
      f"{torchvision.__version__} accelerate {accelerate.__version__} lightning "
      f"{lightning.__version__}; {torch.get_num_threads()} threads")
EOF
echo "peers.sh: the $JOB job, $ROUNDS round(s) of $EPOCHS epoch(s), $PRECISION, batch $BATCH," \
     "${PFLAGS[*]:+project flags ${PFLAGS[*]}, }${TARGET:+target $TARGET, }into $OUT;" \
     "$(cat "$OUT/versions.txt")"
echo "round,job,processes,position,wall_s,cpu_s,val_acc,target_epoch,train_to_target_s,"\
"wall_to_target_s" > "$CSV"

if [ "$JOB" = digits ]; then
  COMMON=(--dataset ImageFolder --dataset_root "$DATA")
  PEER=(--data "$DATA")
else
  COMMON=(--dataset FashionMNIST --dataset_root "$DATA" --train_subset "$SUBSET")
  PEER=(--data "$DATA" --subset "$SUBSET_FILE")
fi
COMMON+=(--img_size 64 --arch alexnet --epochs "$EPOCHS" --batch_size 64 --no-tensorboard
         --no-cuda --seed 0 "${PFLAGS[@]}")
PEER+=(--epochs "$EPOCHS" --batch_size "$BATCH" --precision "$PRECISION")

# job IMPL PROCS DIR: the command line of a job (one word an argument, in CMD[@]).
job() {
  local impl=$1 n=$2 dir=$3
  local threads=(env -u OMP_NUM_THREADS) log=()
  if [ "$n" -gt 1 ]; then threads=(env OMP_NUM_THREADS=1); fi
  if [ "$JOB" = fashion ]; then log=(--log "$dir.epochs.jsonl"); fi
  case $impl:$n in
    project:1) CMD=("${threads[@]}" python "$ONE" "${COMMON[@]}" --checkpoint "$dir") ;;
    project:*) CMD=("${threads[@]}" python -m torch.distributed.run --standalone
                    --nproc_per_node="$n" "$DDP" "${COMMON[@]}" --checkpoint "$dir") ;;
    accelerate:1) CMD=("${threads[@]}" python "checks/peers/accelerate_$JOB.py" "${PEER[@]}"
                       "${log[@]}" --out "$dir" --processes 1) ;;
    accelerate:*) CMD=("${threads[@]}" accelerate launch --multi_gpu --num_processes "$n"
                       --num_machines 1 --mixed_precision "$ACC" --dynamo_backend no
                       "checks/peers/accelerate_$JOB.py" "${PEER[@]}" "${log[@]}" --out "$dir"
                       --processes "$n") ;;
    lightning:*) CMD=("${threads[@]}" python "checks/peers/lightning_$JOB.py" "${PEER[@]}"
                      "${log[@]}" --out "$dir" --processes "$n") ;;
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

# stamp FILE: copies its input through, and appends to FILE each epoch line's epoch and the
# clock ($EPOCHREALTIME) as the line arrives: the three print "epoch N/M ... val_acc".
stamp() {
  local line re='epoch ([0-9]+)/[0-9]+ [^|]*val_acc '
  while IFS= read -r line || [ -n "$line" ]; do
    local now=$EPOCHREALTIME
    printf '%s\n' "$line"
    if [[ $line =~ $re ]]; then echo "${BASH_REMATCH[1]} $now" >> "$1"; fi
  done
}

# epochs IMPL JOBDIR T0: the fashion job's JOBDIR.jsonl (a row an epoch) from its own rows
# and JOBDIR.stamps; prints val_acc,target_epoch,train_to_target_s,wall_to_target_s.
epochs() {
  local rows=$2.epochs.jsonl
  if [ "$1" = project ]; then rows=$(ls "$2"/*/log.jsonl); fi
  python - "$rows" "$2.stamps" "$3" "$TARGET" "$EPOCHS" "$2.jsonl" <<'EOF'
import json, sys
rows_path, stamps_path, t0, target, epochs, out = sys.argv[1:]
rows = [json.loads(line) for line in open(rows_path)]
stamps = {int(e): float(t.replace(",", ".")) for e, t in (l.split() for l in open(stamps_path))}
numbers = [r["epoch"] for r in rows]
if numbers != list(range(1, int(epochs) + 1)) or sorted(stamps) != numbers:
    sys.exit(f"{rows_path}: epochs {numbers}, epoch lines {sorted(stamps)}; "
             f"want 1 to {epochs} in each")
train, reached = 0.0, None
with open(out, "w") as f:
    for r in rows:
        train += r["train_time"]
        wall = stamps[r["epoch"]] - float(t0.replace(",", "."))
        f.write(json.dumps({"epoch": r["epoch"], "val_acc": r["val_acc"],
                            "train_seconds_cumulative": round(train, 3),
                            "wall_seconds_since_start": round(wall, 3)}) + "\n")
        if reached is None and r["val_acc"] >= float(target):
            reached = f"{r['epoch']},{train:.2f},{wall:.2f}"
print(f"{rows[-1]['val_acc']:.4f},{reached or ',,'}")
EOF
}

IMPLS=(project accelerate lightning)
for ((r = 1; r <= ROUNDS; r++)); do
  dir=$OUT/round$r
  mkdir -p "$dir"
  line="round $r:"
  for n in "${NS[@]}"; do
    for ((k = 0; k < 3; k++)); do
      impl=${IMPLS[$(( (k + r - 1) % 3 ))]}  # round 1: project first; round 2: accelerate...
      name=$impl$n
      job "$impl" "$n" "$dir/$name"
      echo "${CMD[*]}" > "$dir/$name.cmd"
      rm -f "$dir/$name.epochs.jsonl"
      : > "$dir/$name.stamps"
      rc=0
      t0=$EPOCHREALTIME
      /usr/bin/time -f "%e %U %S" -o "$dir/$name.time" "${CMD[@]}" 2>&1 |
        stamp "$dir/$name.stamps" > "$dir/$name.log" || rc=$?
      read -r wall user sys < <(tail -n 1 "$dir/$name.time")
      cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.2f", u + s }')
      fields=",,,"
      if [ "$rc" -eq 0 ] && [ "$JOB" = fashion ]; then
        fields=$(epochs "$impl" "$dir/$name" "$t0" 2>&1) || rc=1
      fi
      if [ "$rc" -ne 0 ] || ! grep -q '^done' "$dir/$name.log" || ! saved "$impl" "$dir/$name"; then
        echo "peers.sh: round $r, $name failed (exit status $rc, or no done: line or checkpoint):"
        echo "  ${CMD[*]}"
        tail -n 25 "$dir/$name.log"
        [ "$fields" = ",,," ] || echo "$fields"
        exit 1
      fi
      [ "${KEEP:-0}" = 1 ] || rm -rf "$dir/$name"
      echo "$r,$impl,$n,$((k + 1)),$wall,$cpu,$fields" >> "$CSV"
      line="$line $name ${wall}s (cpu ${cpu}s${TARGET:+, acc ${fields%%,*}})"
    done
  done
  echo "$line"
done

python - "$CSV" "${TARGET:-}" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
target = sys.argv[2]
rounds = sorted({int(r["round"]) for r in rows})
procs = sorted({int(r["processes"]) for r in rows})
peers = ("accelerate", "lightning")


def table(column, what, ratios=True):
    t = {(int(r["round"]), r["job"], int(r["processes"])): r[column] for r in rows}
    print(f"\n{what}, median of {len(rounds)} round(s)"
          + ("; peer/project: the median and the smallest of the rounds' ratios" if ratios else ""))
    print(f"{'job':<12} | {'project':>14} | {'accelerate':>30} | {'Lightning':>30}")
    for n in procs:
        cells = []
        for impl in ("project",) + peers:
            got = {r: float(t[r, impl, n]) for r in rounds if t[r, impl, n] != ""}
            if not got:
                cells.append("not reached")
                continue
            notes = [f"{len(got)} of {len(rounds)} rounds"] if len(got) < len(rounds) else []
            both = [got[r] / float(t[r, "project", n]) for r in got if t[r, "project", n] != ""]
            if ratios and impl != "project" and both:
                notes.append(f"x{statistics.median(both):.2f}, min x{min(both):.2f}")
            cells.append((f"{statistics.median(got.values()):.4f}" if not ratios
                          else f"{statistics.median(got.values()):7.1f}s")
                         + (f" ({'; '.join(notes)})" if notes else ""))
        label = f"{n} process" + ("es" if n > 1 else "")
        print(f"{label:<12} | {cells[0]:>14} | {cells[1]:>30} | {cells[2]:>30}")


table("wall_s", "whole-process wall seconds")
table("cpu_s", "CPU seconds (user + system, every process of the job)")
if target:
    table("val_acc", "test accuracy after the last epoch", ratios=False)
    table("train_to_target_s", f"training seconds to a test accuracy of {target} (the end of "
          "the first epoch at or above it)")
    table("wall_to_target_s",
          f"whole-process seconds to that epoch's line (test accuracy {target})")
EOF
echo "raw times: $CSV"
