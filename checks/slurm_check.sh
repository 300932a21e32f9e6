#!/usr/bin/env bash
# The SLURM preemption round trip, for real: a requeueable sbatch job runs train_DDP.py as
# two gloo processes on the CPU (srun -> torchrun -> 2 workers), this script sends it the
# stop signal once its first last.pth exists (scancel --signal=USR1 JOBID), the step saves
# and exits, the batch script tells the stop from a crash by the run's stop line and
# requeues itself (scontrol requeue), and the requeued start (SLURM_RESTART_COUNT=1)
# continues with --resume to the end. Verdict: the stop line, the resumed line, the done:
# line, the job's restart count, PASS or FAIL.
#   bash checks/slurm_check.sh               # 35-50 s on this 2-core machine (2026-12-02)
#   SIG=TERM bash checks/slurm_check.sh      # the same round trip with SIGTERM
# Needs: slurm (sbatch, srun, scontrol, scancel) and python with torch. Where no SLURM
# answers, as root with Debian's slurm-wlm + munge installed
# (apt-get install -y slurm-wlm munge), it stands up a one-node cluster in place, without
# systemd, and leaves its daemons running for the next call: munged, slurmctld, slurmd,
# with /etc/slurm/slurm.conf written only if there is none (proctrack/linuxproc,
# task/none: no cgroups needed; AuthInfo=cred_expire=10 and short scheduler intervals, so
# that a requeued job may start again ~10 s after its requeue instead of ~2-3 min). An
# existing slurm.conf (a real cluster) is used as it is: then set SLURM_CHECK_DIR to a
# folder the compute node sees, and SBATCH_PARTITION etc. as sbatch reads them.
# Environment: SIG (USR1, or TERM), EPOCHS (8),
# TIMEOUT (300 s for the whole job), NUDGE (1: once the requeued job is pending, set its
# StartTime=now, as its owner may, instead of waiting out the requeue delay; 0: measure
# the cluster's own delay), SLURM_CHECK_DIR (work folder; default a new /tmp folder),
# KEEP (1: keep the work folder; it is also kept on FAIL), PYTHON (python).
# Exit status: 0 PASS; 1 FAIL (the reason is printed); 0 with one line "SKIP: ..." where
# no SLURM can be used here (SKIP_STATUS=77 makes that 77 instead).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
SIG=${SIG:-USR1}; SIG=${SIG#SIG}
EPOCHS=${EPOCHS:-8}
TIMEOUT=${TIMEOUT:-300}
NUDGE=${NUDGE:-1}
SKIP_STATUS=${SKIP_STATUS:-0}
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
MARK="# written by checks/slurm_check.sh"
CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}

skip() { echo "SKIP: $*"; exit "$SKIP_STATUS"; }
fail() { echo "FAIL: $*"; exit 1; }
say() { echo "[$(date +%T)] $*"; }

for c in sbatch srun scontrol scancel squeue; do
  command -v "$c" >/dev/null || skip "slurm is not installed ($c not found)"
done
"$PYTHON" -c 'import torch' 2>/dev/null || skip "$PYTHON has no torch"

# ---------------------------------------------------------------- the local cluster
ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
node_state() { sinfo -h -N -o '%t' 2>/dev/null | head -n 1; }
write_conf() {
  local host cpus; host=$(hostname); cpus=$(nproc); [ "$cpus" -lt 2 ] && cpus=2
  mkdir -p "$(dirname "$CONF")"
  cat > "$CONF" <<EOF
$MARK: a one-node cluster in a container, without systemd or cgroups
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}
start_local() {
  [ "$(id -u)" = 0 ] || skip "no SLURM answers and only root can start a local one"
  for d in munged slurmctld slurmd; do
    command -v "$d" >/dev/null || [ -x "/usr/sbin/$d" ] || \
      skip "no SLURM answers and $d is not installed (apt-get install -y slurm-wlm munge)"
  done
  if [ ! -f "$CONF" ]; then say "writing $CONF"; write_conf; fi
  grep -q "^$MARK" "$CONF" || skip "no SLURM answers, and $CONF is not this script's to start"
  mkdir -p /run/munge /var/log/munge /var/lib/munge /var/spool/slurmctld /var/spool/slurmd \
    /var/log/slurm
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chmod 400 /etc/munge/munge.key
  fi
  if id munge >/dev/null 2>&1; then
    chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
  fi
  if ! pgrep -x munged >/dev/null; then
    say "starting munged"
    if id munge >/dev/null 2>&1; then runuser -u munge -- /usr/sbin/munged
    else /usr/sbin/munged --force; fi
  fi
  if ! pgrep -x slurmctld >/dev/null; then say "starting slurmctld"; /usr/sbin/slurmctld; fi
  if ! pgrep -x slurmd >/dev/null; then say "starting slurmd"; /usr/sbin/slurmd; fi
}
# Our own cluster: start whichever of its daemons is not running; another: it must answer.
if { grep -q "^$MARK" "$CONF" 2>/dev/null && [ "$(id -u)" = 0 ]; } || ! ctld_up; then
  start_local
fi
for _ in $(seq 30); do ctld_up && break; sleep 1; done
ctld_up || fail "slurmctld does not answer: $(scontrol ping 2>&1 | tail -n 1); see /var/log/slurm/"
for _ in $(seq 30); do
  case "$(node_state)" in
    idle*|mix*|alloc*) break ;;
    down*|drain*|drng*)
      grep -q "^$MARK" "$CONF" 2>/dev/null && \
        scontrol update NodeName="$(hostname)" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
case "$(node_state)" in idle*|mix*|alloc*) ;; *)
  fail "no usable node: sinfo says '$(node_state)'; $(sinfo -h -R 2>/dev/null | head -n 1)" ;;
esac
say "slurm: $(scontrol ping | head -n 1); node $(node_state)"

# ---------------------------------------------------------------- the job
WORK=${SLURM_CHECK_DIR:-$(mktemp -d /tmp/slurm_check.XXXXXX)}
mkdir -p "$WORK"
JOBID=""; RESULT=FAIL
cleanup() {
  if [ -n "$JOBID" ] && squeue -h -j "$JOBID" 2>/dev/null | grep -q .; then
    scancel "$JOBID" 2>/dev/null || true
  fi
  if [ "${KEEP:-0}" = 1 ] || [ "$RESULT" != PASS ]; then echo "work folder kept: $WORK"
  else rm -rf "$WORK"; fi
}
trap cleanup EXIT

"$PYTHON" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; import conftest; \
conftest._write_imagefolder(Path('$WORK/data'), 16, 7)"

cat > "$WORK/job.sbatch" <<EOF
#!/bin/bash
#SBATCH --job-name=amp-slurm-check
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:15:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=$WORK/job-%j.out
# One task per node: torchrun starts the node's processes. The step's stop signal comes from
# scancel --signal=USR1 JOBID here; on a cluster add  #SBATCH --signal=USR1@120  (no B:).
set -uo pipefail
cd "$REPO"
CKPT="$WORK/ckpt"
LAST="\$CKPT/train_DDP/last.pth"
RESTART=\${SLURM_RESTART_COUNT:-0}
MAX_REQUEUES=\${MAX_REQUEUES:-5}
LOG="$WORK/attempt-\$RESTART.log"
# A signal to the batch shell itself (scancel --full or --batch, --signal=B:..., the
# requeue's SIGTERM) must not end it before it has decided: bash runs these traps once
# the foreground srun has returned.
trap 'echo "batch shell: got SIGUSR1"' USR1
trap 'echo "batch shell: got SIGTERM"' TERM
RESUME=()
if [ "\$RESTART" -gt 0 ] && [ -f "\$LAST" ]; then RESUME=(--resume); fi
echo "attempt \$RESTART: SLURM_RESTART_COUNT=\${SLURM_RESTART_COUNT:-unset} on \$(hostname) at \$(date +%T) \${RESUME[*]:-}"
srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 \\
  --nproc_per_node=2 --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \\
  --shutdown-timeout=120 \\
  AMP/train_DDP.py --dataset ImageFolder --dataset_root "$WORK/data" --img_size 64 \\
  --arch shufflenet_v2_x0_5 --no-cuda --no-tensorboard --checkpoint "\$CKPT" \\
  --batch_size 2 --epochs $EPOCHS --num_workers 2 "\${RESUME[@]}" > "\$LOG" 2>&1
rc=\$?
# torchrun exits 1 (SignalException) when it forwarded a stop signal: the status cannot
# tell a stop from a crash, the run's last line can.
grep -aoE 'resumed from .*|stopped by .*|done: .*' "\$LOG" || true
echo "attempt \$RESTART: step exit status \$rc at \$(date +%T)"
if grep -aqE 'stopped by SIG[A-Z0-9]+.*Continue with --resume' "\$LOG"; then
  if [ "\$RESTART" -ge "\$MAX_REQUEUES" ]; then
    echo "stopped, but already requeued \$RESTART times: not again"; exit 3
  fi
  echo "stopped by a signal: requeue"
  scontrol requeue "\$SLURM_JOB_ID"   # ends this script (SIGTERM, then SIGKILL)
  exit 0
fi
# The run's end (its done: line, or a stop after its last epoch) is a success whatever
# torchrun says: a signal to torchrun after it (in its teardown) makes it exit 1 as well.
if grep -aqE 'done: |stopped by .*The run is complete' "\$LOG"; then exit 0; fi
echo "the step failed without a stop line: not requeued; its log's end:"
tail -n 20 "\$LOG" | tr '\r' '\n' | grep -v '^\s*$' | tail -n 20
exit \$(( rc ? rc : 1 ))
EOF

T0=$(date +%s)
left() { echo $(( TIMEOUT - ($(date +%s) - T0) )); }
job_field() {
  { scontrol show job -o "$JOBID" 2>/dev/null || true; } | grep -oE "(^| )$1=[^ ]*" | head -n 1 | cut -d= -f2- || true
}
JOBID=$(sbatch --parsable "$WORK/job.sbatch"); JOBID=${JOBID%%;*}
say "submitted job $JOBID (SIG=$SIG, $EPOCHS epochs); work folder $WORK"

LAST=$WORK/ckpt/train_DDP/last.pth
while [ ! -f "$LAST" ]; do
  [ "$(left)" -gt 0 ] || fail "no $LAST after ${TIMEOUT}s (job state $(job_field JobState))"
  case "$(job_field JobState)" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)
    cat "$WORK"/job-"$JOBID".out 2>/dev/null | tail -n 20
    fail "job $JOBID ended ($(job_field JobState)) before its first checkpoint" ;;
  esac
  sleep 1
done
sleep 1
say "first checkpoint: scancel --signal=$SIG $JOBID"
scancel --signal="$SIG" "$JOBID"

REQUEUED_AT=""; NUDGED=0
while :; do
  [ "$(left)" -gt 0 ] || fail "job $JOBID not done after ${TIMEOUT}s (state $(job_field JobState), restarts $(job_field Restarts))"
  state=$(job_field JobState); restarts=$(job_field Restarts)
  if [ -z "$REQUEUED_AT" ] && [ "${restarts:-0}" -ge 1 ]; then
    REQUEUED_AT=$(date +%s); say "requeued (state $state, eligible at $(job_field EligibleTime | cut -dT -f2))"
  fi
  if [ "$state" = PENDING ] && [ "${restarts:-0}" -ge 1 ] && [ "$NUDGE" = 1 ] && [ "$NUDGED" = 0 ]; then
    scontrol update JobId="$JOBID" StartTime=now && NUDGED=1 && say "pending: StartTime=now"
  fi
  case "$state" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) break ;; esac
  sleep 1
done
say "job $JOBID: $state, restarts ${restarts:-?}, exit $(job_field ExitCode)"

# ---------------------------------------------------------------- verdict
clean() { [ -f "$1" ] && tr '\r' '\n' < "$1" | grep -aoE "$2" | tail -n 1 || true; }
STOP=$(clean "$WORK/attempt-0.log" 'stopped by .*')
RESUMED=$(clean "$WORK/attempt-1.log" 'resumed from .*')
DONE=$(clean "$WORK/attempt-1.log" 'done: .*')
SEEN=$(grep -aoE 'attempt 1: SLURM_RESTART_COUNT=[^ ]*' "$WORK/job-$JOBID.out" 2>/dev/null | cut -d= -f2 || true)
at() { grep -aoE "$1 at [0-9:]{8}" "$WORK/job-$JOBID.out" 2>/dev/null | grep -oE '[0-9:]{8}$' | head -n 1 || true; }
END0=$(at 'attempt 0: step exit status [0-9]+'); START1=$(at 'attempt 1: SLURM_RESTART_COUNT=.*')
GAP="?"
if [ -n "$END0" ] && [ -n "$START1" ]; then
  GAP=$(( $(date -d "$START1" +%s) - $(date -d "$END0" +%s) ))
fi
echo "stop:     ${STOP:-(none)}"
echo "resumed:  ${RESUMED:-(none)}"
echo "done:     ${DONE#done: }"
echo "restarts: ${restarts:-?} (SLURM_RESTART_COUNT on the requeued start: ${SEEN:-?})"
echo "requeue:  first step ended ${END0:-?}, requeued start ${START1:-?} (${GAP} s; NUDGE=$NUDGE)"
why=()
[ "$state" = COMPLETED ] || why+=("job state $state")
[ "${restarts:-0}" = 1 ] || why+=("restarts ${restarts:-?}, not 1")
[ "$SEEN" = 1 ] || why+=("SLURM_RESTART_COUNT on the second start: ${SEEN:-?}")
[[ "$STOP" == "stopped by SIG$SIG "*"Continue with --resume" ]] || why+=("no SIG$SIG stop line in the first attempt")
[ -n "$RESUMED" ] || why+=("no resumed line in the second attempt")
[ -n "$DONE" ] || why+=("no done: line in the second attempt")
# Where it stopped is where it resumed: "at epoch E, step S" -> "epoch E, step S";
# "after epoch E" -> "epoch E+1, step 0".
if [[ "$STOP" =~ at\ epoch\ ([0-9]+),\ step\ ([0-9]+) ]]; then want="epoch ${BASH_REMATCH[1]}, step ${BASH_REMATCH[2]}"
elif [[ "$STOP" =~ after\ epoch\ ([0-9]+) ]]; then want="epoch $(( BASH_REMATCH[1] + 1 )), step 0"
else want=""; fi
[ -z "$want" ] || [[ "$RESUMED" == *": $want"* ]] || why+=("stopped at '$want', resumed at '${RESUMED##*: }'")
if [ ${#why[@]} -gt 0 ]; then
  echo "--- job output:"; tail -n 30 "$WORK/job-$JOBID.out" 2>/dev/null || true
  fail "$(IFS=';'; echo "${why[*]}")"
fi
RESULT=PASS
echo "PASS: SIG$SIG stop, requeue, --resume and done in $(( $(date +%s) - T0 )) s (job $JOBID)"
