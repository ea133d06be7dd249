#!/usr/bin/env bash
# The speed matrix: every script of leanrl/ for each seed, each *_torchcompile.py in four modes (no flags,
# --compile, --cudagraphs, both). The plan (one run name a line) goes to DIR/plan.txt before the first run,
# each run's log to DIR/logs/, its speed record to DIR/records.jsonl; then leanrl/tools/speed_report.py
# renders DIR/speed.md (which names failed, interrupted and missing runs), DIR/fps.png and DIR/returns.png.
#
#   ./run.sh [--scripts a,b] [--seeds 1,2,3] [--quick] [--gpus N] [--out DIR] [-- extra script args]
#
#   --scripts  script names without .py (default: all of leanrl/*.py)
#   --seeds    comma-separated seeds (default: 1)
#   --quick    short horizons that still pass warm-up and measure a steady window
#   --gpus     N runs at a time, each on a GPU of its own (default 1: one after another, CUDA_VISIBLE_DEVICES
#              left as it is): slot k (0 to N-1) runs with CUDA_VISIBLE_DEVICES=k, or with the k-th entry of
#              CUDA_VISIBLE_DEVICES where it is set; a slot takes the plan's next run when its run ends
#   --out      output directory (default: runs/<date-time>); rerunning with the same DIR resumes: runs
#              recorded there with status ok are skipped, failed and interrupted ones run again
#   -- ARGS    passed to every script after the run.sh arguments, so they override --quick's
#
# While a run goes, a line every HEARTBEAT seconds (default 10) shows its latest progress line and, once a
# run has finished, the time the matrix has left after it: each run left at the mean time of the finished runs
# of its mode; while a mode has none, its runs count at the slowest mode's mean and the time is "at least".
# With --gpus N, the progress lines name each run's GPU ("[3/55 gpu 1]") and the time left is that sum
# divided by N (by the runs left, when fewer), the runs in flight counted whole.
# Ctrl-C, or SIGTERM to run.sh (which passes it on), stops the runs in flight (their records say interrupted),
# records them as interrupted, renders the report and says how to resume. PYTHON picks the interpreter (default:
# python). Exit code: 0 when every run succeeded, 1 when one failed, 2 for bad options, 130 when interrupted.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPORT="$ROOT/leanrl/tools/speed_report.py"
PYTHON="${PYTHON:-python}"
HEARTBEAT="${HEARTBEAT:-10}"
SCRIPTS="" SCRIPTS_GIVEN=0 SEEDS="1" QUICK=0 GPUS=1 OUT="$ROOT/runs/$(date +%Y%m%d-%H%M%S)" OUT_GIVEN=0
EXTRA=()
ARGV=("$@")

fail() {
  echo "error: $*" >&2
  exit 2
}

while [ $# -gt 0 ]; do
  case "$1" in
    --scripts | --seeds | --gpus | --out)
      [ $# -ge 2 ] || fail "$1 needs a value"
      case "$1" in
        --scripts) SCRIPTS="$2" SCRIPTS_GIVEN=1 ;;
        --seeds) SEEDS="$2" ;;
        --gpus) GPUS="$2" ;;
        --out) OUT="$2" OUT_GIVEN=1 ;;
      esac
      shift 2
      ;;
    --quick) QUICK=1 && shift ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" && exit 0 ;;
    --) shift && EXTRA=("$@") && break ;;
    *) fail "unknown option $1 (see ./run.sh --help)" ;;
  esac
done

[[ "$SEEDS" =~ ^[0-9]+(,[0-9]+)*$ ]] || fail "--seeds must be comma-separated non-negative integers, got '$SEEDS'"
SEEN_SEEDS=","
for seed in ${SEEDS//,/ }; do
  [ "${#seed}" -le 10 ] && [ "$((10#$seed))" -le 2147483647 ] || fail "--seeds: $seed is over 2147483647"
  [[ "$SEEN_SEEDS" != *",$((10#$seed)),"* ]] || fail "--seeds: seed $((10#$seed)) is given twice"
  SEEN_SEEDS+="$((10#$seed)),"
done
SEEDS="${SEEN_SEEDS:1:-1}"  # as the scripts read them: 01 is 1
[ "$SCRIPTS_GIVEN" = 0 ] || [ -n "$SCRIPTS" ] || fail "--scripts '': no script named (leave it out for all of them)"
for arg in "${EXTRA[@]}"; do
  [[ "$arg" != --seed && "$arg" != --seed=* ]] || fail "--seed after --: give the seeds with --seeds, which name the runs"
done
[[ "$GPUS" =~ ^[0-9]+$ ]] && [ "$((10#$GPUS))" -ge 1 ] || fail "--gpus must be a positive integer, got '$GPUS'"
[ "${#GPUS}" -le 4 ] && [ "$((10#$GPUS))" -le 1024 ] || fail "--gpus $GPUS: at most 1024, a slot per GPU of this machine"
GPUS=$((10#$GPUS))
[[ "$HEARTBEAT" =~ ^[0-9]*\.?[0-9]+$ && ! "$HEARTBEAT" =~ ^[0.]+$ ]] ||
  fail "HEARTBEAT must be a positive number of seconds, got '$HEARTBEAT'"
command -v "$PYTHON" >/dev/null || fail "PYTHON=$PYTHON: no such interpreter"
if [ -z "$SCRIPTS" ]; then
  # Discovered at run time, so scripts added later join the matrix: a script has an entry point, the env modules
  # beside them have none.
  SCRIPTS="$(grep -l '^if __name__ == "__main__":' "$ROOT"/leanrl/*.py | xargs -n1 basename | sed 's/\.py$//' \
    | paste -sd, -)"
fi
IFS=, read -ra SCRIPT_LIST <<<"$SCRIPTS"
IFS=, read -ra SEED_LIST <<<"$SEEDS"
SEEN_SCRIPTS=","
for s in "${SCRIPT_LIST[@]}"; do
  [[ "$SEEN_SCRIPTS" != *",$s,"* ]] || fail "--scripts: $s is named twice"
  SEEN_SCRIPTS+="$s,"
  [ -f "$ROOT/leanrl/$s.py" ] || fail "no script leanrl/$s.py"
  [[ "$s" != */* ]] && grep -q '^if __name__ == "__main__":' "$ROOT/leanrl/$s.py" ||
    fail "--scripts: leanrl/$s.py is not a training script (the scripts are leanrl/*.py with an entry point)"
done

# The GPU of each slot, with --gpus N > 1 (with 1, none: the runs see CUDA_VISIBLE_DEVICES as it is): GPU k, or
# the k-th GPU that CUDA_VISIBLE_DEVICES lists where it is set (ids or UUIDs).
DEVICES=()
if [ "$GPUS" -gt 1 ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    IFS=, read -ra DEVICES <<<"$CUDA_VISIBLE_DEVICES"
    [ "${#DEVICES[@]}" -ge "$GPUS" ] ||
      fail "--gpus $GPUS needs $GPUS GPUs, but CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' lists ${#DEVICES[@]}"
    DEVICES=("${DEVICES[@]:0:GPUS}")
  else
    for ((k = 0; k < GPUS; k++)); do DEVICES+=("$k"); done
  fi
fi

# Short horizons per algorithm: off-policy scripts learn from step 500 and measure the 1800 steps (SAC, TD3) or
# 12500 (DQN, a tenth of them updates) after their WARMUP_STEPS; PPO runs 10 (continuous, 2048 steps) or 20
# (Atari, 8 envs x 128 steps) iterations; PQN 20 (Atari, 8 envs x 128 steps) or 40 (classic control, 4 envs x 128
# steps); PPO on MuJoCo Warp 10 (16384 envs x 32 steps); TD3 and SAC on MuJoCo Warp 490 vector steps of 1024 envs
# after their learning starts.
quick_args() {
  case "$1" in
    td3_gpu_mujoco* | sac_gpu_mujoco*) echo "--total-timesteps 512000 --learning-starts 10240" ;;
    sac_* | td3_*) echo "--total-timesteps 2500 --learning-starts 500" ;;
    dqn | dqn_*) echo "--total-timesteps 15000 --learning-starts 500" ;;
    ppo_continuous_action_gpu_mujoco*) echo "--total-timesteps 5242880" ;;
    ppo_*) echo "--total-timesteps 20480" ;;
    pqn_*) echo "--total-timesteps 20480" ;;
    *) echo "--total-timesteps 10000" ;;
  esac
}

modes() {
  case "$1" in
    *_torchcompile) echo "eager compile cudagraphs compile+cudagraphs" ;;
    *) echo "baseline" ;;
  esac
}

mode_flags() {
  case "$1" in
    compile) echo "--compile" ;;
    cudagraphs) echo "--cudagraphs" ;;
    compile+cudagraphs) echo "--compile --cudagraphs" ;;
  esac
}

# Whether the newline-separated list $2 holds the line $1.
in_list() {
  case $'\n'"$2"$'\n' in
    *$'\n'"$1"$'\n'*) return 0 ;;
  esac
  return 1
}

# The arguments as one shell command line: words of plain characters as they are, others quoted.
shell_words() {
  local a q out=""
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./,:=+@%-]+$ ]]; then out+=" $a"; else printf -v q '%q' "$a" && out+=" $q"; fi
  done
  echo "${out# }"
}

# Seconds as 42s, 7m05s or 1h02m.
duration() {
  local s=$1
  if [ "$s" -ge 3600 ]; then
    printf '%dh%02dm' $((s / 3600)) $((s % 3600 / 60))
  elif [ "$s" -ge 60 ]; then
    printf '%dm%02ds' $((s / 60)) $((s % 60))
  else
    printf '%ds' "$s"
  fi
}

# Run in the background while a run goes: every HEARTBEAT seconds, the run's position and time so far, its
# log's latest progress line ("<script>: 12000/1000000 steps, fps ..., eta ... min") and the time the runs after
# it will take ($3, from eta_after; empty before any run has finished).
heartbeat() {
  local label=$1 log=$2 after=$3 start=$SECONDS nap="" line
  trap '[ -n "$nap" ] && kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    sleep "$HEARTBEAT" &
    nap=$!
    wait "$nap"
    line="$(tail -c 65536 "$log" 2>/dev/null | tr '\r' '\n' | grep -aE '^[^ ]+: [0-9]+/[0-9]+ steps' | tail -n 1)"
    echo "  $label, $(duration $((SECONDS - start))): ${line:-no progress line yet}${after:+; matrix after it: $after}"
  done
}

mkdir -p "$OUT/logs" 2>/dev/null || fail "cannot create $OUT/logs"
OUT="$(cd "$OUT" && pwd)"
PLAN="$OUT/plan.txt"

# The plan, in order: seed, script, mode. A run's name is its log's name and its line in plan.txt.
NAMES=() RUN_SCRIPT=() RUN_MODE=() RUN_SEED=()
for seed in "${SEED_LIST[@]}"; do
  seed=$((10#$seed))
  for s in "${SCRIPT_LIST[@]}"; do
    for mode in $(modes "$s"); do
      NAMES+=("${s}__${mode}__s${seed}") RUN_SCRIPT+=("$s") RUN_MODE+=("$mode") RUN_SEED+=("$seed")
    done
  done
done
total=${#NAMES[@]}

# The runs recorded ok before, read once; a records.jsonl that cannot be read is one error line.
DONE="$("$PYTHON" "$REPORT" done "$OUT")" || exit 2

# plan.txt keeps the runs of earlier calls with this DIR too: the report names those never recorded.
planned=""
[ ! -f "$PLAN" ] || planned="$(cat "$PLAN" 2>/dev/null)" || fail "cannot read $PLAN"
for name in "${NAMES[@]}"; do
  in_list "$name" "$planned" && continue
  { echo "$name" >>"$PLAN"; } 2>/dev/null || fail "cannot write $PLAN"
  planned+=$'\n'"$name"
done

todo=0
for name in "${NAMES[@]}"; do in_list "$name" "$DONE" || todo=$((todo + 1)); done

# Seconds and runs finished per mode, for the time left: a compiled twin's run takes far longer than a baseline's.
declare -A MODE_SPENT=() MODE_RAN=()
# The runs of the plan finished in this call (FINISHED[i]=1), and the run each busy slot holds (SLOT_RUN[k]=i).
FINISHED=() SLOT_RUN=()
# The time the runs left but run $1 will take ("" when none has finished yet or none is left): the runs neither
# recorded ok before nor finished in this call, those in flight counted whole, spread over the GPUs.
eta_after() {
  local i=$1 j m mean slowest=0 seconds=0 untimed=0 left=0 slots on=""
  [ "${#MODE_RAN[@]}" -gt 0 ] || return 0
  for m in "${!MODE_RAN[@]}"; do
    mean=$((MODE_SPENT[$m] / MODE_RAN[$m]))
    [ "$mean" -gt "$slowest" ] && slowest=$mean
  done
  for ((j = 0; j < total; j++)); do
    [ "$j" != "$i" ] && [ -z "${FINISHED[j]:-}" ] || continue
    in_list "${NAMES[j]}" "$DONE" && continue
    m="${RUN_MODE[j]}" left=$((left + 1))
    if [ -n "${MODE_RAN[$m]:-}" ]; then
      seconds=$((seconds + MODE_SPENT[$m] / MODE_RAN[$m]))
    else
      seconds=$((seconds + slowest)) untimed=$((untimed + 1))
    fi
  done
  [ "$left" -gt 0 ] || return 0
  # A run goes on one GPU: fewer runs left than GPUs share out their time over as many GPUs as runs.
  slots=$((left < GPUS ? left : GPUS))
  [ "$GPUS" = 1 ] || on=" on $GPUS GPUs"
  echo "$([ "$untimed" -gt 0 ] && echo "at least ")about $(duration $((seconds / slots))) left$on"
}

# Run $1's place in the plan and, with --gpus N > 1, the GPU of slot $2: "[3/55]" or "[3/55 gpu 1]".
tag() {
  echo "[$(($1 + 1))/$total${DEVICES[$2]:+ gpu ${DEVICES[$2]}}]"
}

# Moves $next past the runs recorded ok before, saying so; fails when no run is left to start or Ctrl-C stopped
# the matrix.
next_todo() {
  while [ "$INTERRUPTED" = 0 ] && [ "$next" -lt "$total" ]; do
    in_list "${NAMES[next]}" "$DONE" || return 0
    echo "[$((next + 1))/$total] ${NAMES[next]}: done before, skipped"
    next=$((next + 1))
  done
  return 1
}

# Starts run $next in slot $1, in the background, and moves $next on. When the script ends, the line
# "<slot> <exit code> <seconds>" on fd 3 says so.
start_run() {
  local k=$1 i=$next label args side log
  local name="${NAMES[i]}" s="${RUN_SCRIPT[i]}" mode="${RUN_MODE[i]}" seed="${RUN_SEED[i]}"
  args=($(mode_flags "$mode") --seed "$seed")
  [ "$QUICK" = 1 ] && args+=($(quick_args "$s"))
  side="$OUT/logs/$name.record" log="logs/$name.log" label="$(tag "$i" "$k") $name"
  rm -f "$side"
  echo "$label: running, log in $log"
  (
    # This shell lives through Ctrl-C to report the end of its script, which gets the Ctrl-C itself (a command
    # started in the background would ignore it).
    trap : INT TERM
    heartbeat "$label" "$OUT/$log" "$(eta_after "$i")" &
    beat=$!
    [ "$GPUS" = 1 ] || export CUDA_VISIBLE_DEVICES="${DEVICES[k]}"
    started=$SECONDS
    # The script's process id, for a stop signal that reaches run.sh alone (below)
    (echo "$BASHPID" >"$OUT/logs/$name.pid" && exec "$PYTHON" "$ROOT/leanrl/$s.py" "${args[@]}" \
      ${EXTRA[@]+"${EXTRA[@]}"} --speed-log "$side" >"$OUT/$log" 2>&1)
    code=$?
    took=$((SECONDS - started))
    kill "$beat" 2>/dev/null
    wait "$beat" 2>/dev/null
    echo "$k $code $took" >&3
  ) &
  SLOT_RUN[k]=$i next=$((next + 1))
}

# Records the run of slot $1, which ended with exit code $2 after $3 seconds, and frees the slot.
finish_run() {
  local k=$1 code=$2 took=$3 i="${SLOT_RUN[$1]}" result left eta="" stopped=()
  local name="${NAMES[i]}" s="${RUN_SCRIPT[i]}" mode="${RUN_MODE[i]}" seed="${RUN_SEED[i]}"
  local side="$OUT/logs/${NAMES[i]}.record" log="logs/${NAMES[i]}.log"
  unset 'SLOT_RUN[k]'
  FINISHED[i]=1 ran=$((ran + 1))
  MODE_SPENT[$mode]=$((${MODE_SPENT[$mode]:-0} + took)) MODE_RAN[$mode]=$((${MODE_RAN[$mode]:-0} + 1))
  [ "$INTERRUPTED" = 0 ] || stopped=(--stopped) # a script stopped while Python imports exits 1
  result="$("$PYTHON" "$REPORT" append "$OUT" --side "$side" --script "$s" --mode "$mode" --seed "$seed" \
    --log "$log" --exit-code "$code" ${stopped[@]+"${stopped[@]}"})"
  case $? in
    0) ;;
    2) wait; exit 2 ;; # records.jsonl cannot be written: the error line is out, the runs in flight end unrecorded
    *) failed=$((failed + 1)) ;;
  esac
  rm -f "$side" "$OUT/logs/${NAMES[i]}.pid"
  left=$((todo - ran))
  [ "$left" -gt 0 ] && [ "$INTERRUPTED" = 0 ] && eta="; $left to run, $(eta_after "$i")"
  echo "$(tag "$i" "$k") $name: ${result:-not recorded}, took $(duration "$took")$eta"
}

# Ctrl-C or SIGTERM: no further run starts, and the scripts in flight end with a record marked interrupted. A
# terminal's Ctrl-C reaches them itself; SIGTERM is passed on, since `kill <run.sh's pid>` reaches run.sh alone (a
# script takes a second signal within 3 s for the same stop).
INTERRUPTED=0
pass_on_term() {
  INTERRUPTED=1
  local k
  for k in "${!SLOT_RUN[@]}"; do
    kill -s TERM "$(cat "$OUT/logs/${NAMES[SLOT_RUN[k]]}.pid" 2>/dev/null)" 2>/dev/null
  done
}
trap 'INTERRUPTED=1' INT
trap pass_on_term TERM

# The runs report their end through a pipe (fd 3); unlinked once open, it leaves nothing behind.
pipe="$(mktemp -d)" && mkfifo "$pipe/ends" && exec 3<>"$pipe/ends" && rm -r "$pipe" ||
  fail "cannot make a pipe in ${TMPDIR:-/tmp}"

on=""
[ "$GPUS" = 1 ] || on=", $GPUS at a time on GPUs $(IFS=, && echo "${DEVICES[*]}")"
echo "run.sh: $total runs into $OUT ($((total - todo)) done before, $todo to run$on; plan in plan.txt)"
ran=0 failed=0 next=0
# Each free slot takes the next run to do; then the loop waits for a run to end.
while :; do
  for ((k = 0; k < GPUS; k++)); do
    if [ -z "${SLOT_RUN[k]:-}" ] && next_todo; then start_run "$k"; fi
  done
  [ "${#SLOT_RUN[@]}" -gt 0 ] || break
  read -r k code took <&3
  finish_run "$k" "$code" "$took"
done

if [ "$INTERRUPTED" = 1 ]; then
  "$PYTHON" "$REPORT" "$OUT"
  [ "$OUT_GIVEN" = 1 ] && resume=("$0") || resume=("$0" --out "$OUT")
  echo "interrupted: rerun with --out $OUT to resume: $(shell_words "${resume[@]}" ${ARGV[@]+"${ARGV[@]}"})" >&2
  exit 130
fi
"$PYTHON" "$REPORT" "$OUT" || exit 1
[ "$failed" = 0 ] || {
  echo "run.sh: $failed of $total runs failed" >&2
  exit 1
}
