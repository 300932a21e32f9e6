# Step helpers of checks/gpu_check.sh, sourced by it (and by the tests).
# Needs: OUT (what comes back: summary.txt and details.tar.gz only), WORK (each step's full
# output; only its small files are packed), BUDGET (seconds for all steps, counted by bash's
# SECONDS). Optional: MIN_STEP (default 15): a step with fewer seconds left is skipped;
# PACK_MAX_KB (default 1024): bigger files under WORK stay out of details.tar.gz (named in
# the summary); OUT_MAX_KB (default 8192, half of what the device tool brings back per file):
# finish fails if a file under OUT is bigger.
# Every step's outcome is recorded: finish ends the summary with the failed and skipped
# steps and returns non-zero if there are any.

FAILED=""   # "name(rc=N)" or "name(skipped: why)" of each step that did not pass
PASSED=0
LEFT_OUT="" # files under WORK already named as left out of the archive

log() { echo "== [${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }

# Every process a step started, however it detached (a new session, a reparented child),
# carries the step's token in its environment: kill them all when the step ends.
kill_step() {
  local token=$1 pids="" f pid
  for f in /proc/[0-9]*/environ; do
    grep -qsxzF "GPU_CHECK_STEP=$token" "$f" || continue
    pid=${f#/proc/}; pid=${pid%/environ}
    pids="$pids $pid"
  done
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  return 0
}

# Pack WORK's files of at most PACK_MAX_KB into OUT/details.tar.gz (written beside, then
# renamed: never half a file). Bigger ones (a checkpoint, a trace) are named in the summary.
pack() {
  local max=${PACK_MAX_KB:-1024} f
  while IFS= read -r f; do
    case " $LEFT_OUT " in *" $f "*) continue ;; esac
    LEFT_OUT="$LEFT_OUT $f"
    log "left out of details.tar.gz (over ${max} KiB): $f ($(du -k "$WORK/$f" | cut -f1) KiB)"
  done < <(cd "$WORK" && find . -type f -size +"${max}"k | sort)
  (cd "$WORK" && find . -type f ! -size +"${max}"k -print0 | sort -z |
     tar --null --no-recursion -T - -czf "$WORK.tar.gz") 2>/dev/null &&
    mv -f "$WORK.tar.gz" "$OUT/details.tar.gz"
}

# cut_output FILE: a step's output over PACK_MAX_KB keeps its first 64 KiB and its end, so
# that it is still packed.
cut_output() {
  local max=$(( ${PACK_MAX_KB:-1024} * 1024 )) size
  size=$(stat -c %s "$1")
  [ "$size" -gt "$max" ] || return 0
  { head -c 65536 "$1"; printf '\n[... %s bytes cut ...]\n' "$((size - max + 4096))"
    tail -c $((max - 65536 - 4096)) "$1"; } > "$1.cut" && mv -f "$1.cut" "$1"
}

# A step that cannot run (budget spent, an input missing): logged and counted as failed.
skip() {
  local name=$1; shift
  log "$name: skipped ($*)"
  FAILED="$FAILED $name(skipped: $*)"
  printf '%s\tskipped\t0\n' "$name" >> "$WORK/steps.tsv"
  return 124
}

# needs FILE NAME: true if FILE exists, else step NAME is skipped.
needs() { [ -e "$1" ] && return 0; skip "$2" "no ${1##*/}: the step that makes it failed"; }

# run NAME MAX_SECONDS CMD...: output to WORK/NAME.txt, under a timeout of min(MAX, time left
# of BUDGET); then no process of the step is left running, and the details are packed.
run() {
  local name=$1 max=$2; shift 2
  local left=$((BUDGET - SECONDS)); [ "$left" -lt "$max" ] && max=$left
  if [ "$max" -lt "${MIN_STEP:-15}" ]; then skip "$name" "budget spent"; return 124; fi
  log "$name (timeout ${max}s): $*"
  local token="$name-$$-$RANDOM" t0=$SECONDS
  timeout -k 5 "$max" env GPU_CHECK_STEP="$token" "$@" > "$WORK/$name.txt" 2>&1
  local rc=$?
  kill_step "$token"
  cut_output "$WORK/$name.txt"
  echo "rc=$rc" >> "$WORK/$name.txt"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$WORK/steps.tsv"
  if [ "$rc" -eq 0 ]; then
    PASSED=$((PASSED + 1))
  else
    case $rc in 124) FAILED="$FAILED $name(rc=124: timeout)" ;;
      137) FAILED="$FAILED $name(rc=137: killed)" ;; *) FAILED="$FAILED $name(rc=$rc)" ;; esac
    log "$name: FAILED rc=$rc after $((SECONDS - t0))s"
  fi
  pack
  return $rc
}

# keep FILE [N]: the last N lines of a step's output in the summary (tqdm redraws dropped);
# at least 12 of a step that failed (its output ends with rc=N), to show why.
keep() {
  local n=${2:-30}
  [ -f "$1" ] || return 0
  tail -n 1 "$1" 2>/dev/null | grep -qx 'rc=0' || [ "$n" -ge 12 ] || n=12
  tr '\r' '\n' < "$1" | grep -vE "it/s\]|s/it\]|^ *$" | tail -n "$n" >> "$OUT/summary.txt"
}

# finish: the last lines of the summary: what comes back (at most 8 files, none more than
# 2 folders down, none over OUT_MAX_KB) and the steps that failed or were skipped. Returns
# non-zero if any step did not pass or OUT does not fit.
finish() {
  local max=${OUT_MAX_KB:-8192} files deep big sizes ok=0 f
  pack
  files=$(find "$OUT" -type f | wc -l); deep=$(find "$OUT" -mindepth 3 -type f | wc -l)
  big=$(find "$OUT" -type f -size +"${max}"k | wc -l)
  sizes=$(cd "$OUT" && for f in $(find . -type f | sort); do
            printf '%s %s KiB, ' "${f#./}" "$(du -k "$f" | cut -f1)"; done)
  [ "$files" -le 8 ] && [ "$deep" -eq 0 ] && [ "$big" -eq 0 ] || ok=1
  [ -n "$FAILED" ] && ok=1
  local verdict
  verdict="$([ -n "$FAILED" ] && echo "FAILED:$FAILED" || echo "no step failed")"
  log "done: $files files under \$OUT (${sizes%, }), $deep deeper than 2 folders," \
      "$big over ${max} KiB; $PASSED steps passed; $verdict"
  # The verdict first too, where a reader starts.
  { echo "$PASSED steps passed; $verdict"; cat "$OUT/summary.txt"; } > "$OUT/summary.txt.new" &&
    mv -f "$OUT/summary.txt.new" "$OUT/summary.txt"
  return $ok
}
