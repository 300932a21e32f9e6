# Step helpers of bench/gpu_check.sh, sourced by it (and by the tests).
# Needs: OUT (what comes back: summary.txt and details.tar.gz only), WORK (each step's full
# output), BUDGET (seconds for all steps, counted by bash's SECONDS); MIN_STEP (default 15):
# a step with fewer seconds left is skipped.

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

# Pack WORK into OUT/details.tar.gz (written beside, then renamed: never half a file).
pack() {
  tar -czf "$WORK.tar.gz" -C "$WORK" . 2>/dev/null && mv -f "$WORK.tar.gz" "$OUT/details.tar.gz"
}

# run NAME MAX_SECONDS CMD...: output to WORK/NAME.txt, under a timeout of min(MAX, time left
# of BUDGET); then no process of the step is left running, and the details are packed.
run() {
  local name=$1 max=$2; shift 2
  local left=$((BUDGET - SECONDS)); [ "$left" -lt "$max" ] && max=$left
  if [ "$max" -lt "${MIN_STEP:-15}" ]; then log "$name: skipped (budget spent)"; return 124; fi
  log "$name (timeout ${max}s): $*"
  local token="$name-$$-$RANDOM"
  timeout -k 5 "$max" env GPU_CHECK_STEP="$token" "$@" > "$WORK/$name.txt" 2>&1
  local rc=$?
  kill_step "$token"
  echo "rc=$rc" >> "$WORK/$name.txt"; [ "$rc" -ne 0 ] && log "$name: rc=$rc"
  pack
  return $rc
}

# keep FILE [N]: the last N lines of a step's output in the summary (tqdm redraws dropped).
keep() { tr '\r' '\n' < "$1" | grep -vE "it/s\]|s/it\]|^ *$" | tail -n "${2:-30}" >> "$OUT/summary.txt"; }
