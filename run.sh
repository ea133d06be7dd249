#!/usr/bin/env bash
# The speed matrix: every script of leanrl/ for each seed, each *_torchcompile.py in four modes (no flags,
# --compile, --cudagraphs, both). Each run's log goes to DIR/logs/, its speed record to DIR/records.jsonl;
# then leanrl/tools/speed_report.py renders DIR/speed.md, DIR/fps.png and DIR/returns.png.
#
#   ./run.sh [--scripts a,b] [--seeds 1,2,3] [--quick] [--out DIR] [-- extra script args]
#
#   --scripts  script names without .py (default: all of leanrl/*.py)
#   --seeds    comma-separated seeds (default: 1)
#   --quick    short horizons that still pass warm-up and measure a steady window
#   --out      output directory (default: runs/<date-time>); rerunning with the same DIR resumes: runs
#              recorded there with status ok are skipped, failed ones run again
#   -- ARGS    passed to every script after the run.sh arguments, so they override --quick's
#
# PYTHON picks the interpreter (default: python). Exit code: 0 when every run succeeded, 1 when one failed,
# 2 for bad options.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
SCRIPTS="" SEEDS="1" QUICK=0 OUT="$ROOT/runs/$(date +%Y%m%d-%H%M%S)"
EXTRA=()

fail() {
  echo "error: $*" >&2
  exit 2
}

while [ $# -gt 0 ]; do
  case "$1" in
    --scripts | --seeds | --out)
      [ $# -ge 2 ] || fail "$1 needs a value"
      case "$1" in
        --scripts) SCRIPTS="$2" ;;
        --seeds) SEEDS="$2" ;;
        --out) OUT="$2" ;;
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
if [ -z "$SCRIPTS" ]; then
  # Discovered at run time, so scripts added later join the matrix.
  SCRIPTS="$(for f in "$ROOT"/leanrl/*.py; do basename "$f" .py; done | paste -sd, -)"
fi
IFS=, read -ra SCRIPT_LIST <<<"$SCRIPTS"
IFS=, read -ra SEED_LIST <<<"$SEEDS"
for s in "${SCRIPT_LIST[@]}"; do
  [ -f "$ROOT/leanrl/$s.py" ] || fail "no script leanrl/$s.py"
done

# Short horizons per algorithm: off-policy scripts learn from step 500 and measure the 1800 steps after their
# WARMUP_STEPS; PPO runs 10 (continuous, 2048 steps) or 20 (Atari, 8 envs x 128 steps) iterations.
quick_args() {
  case "$1" in
    sac_* | td3_*) echo "--total-timesteps 2500 --learning-starts 500" ;;
    ppo_*) echo "--total-timesteps 20480" ;;
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

mkdir -p "$OUT/logs" || fail "cannot create $OUT/logs"
OUT="$(cd "$OUT" && pwd)"
RECORDS="$OUT/records.jsonl"
CPU_MODEL="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ *//')"
trap 'echo "interrupted: rerun with --out $OUT to resume" >&2; exit 130' INT TERM

# Whether RECORDS holds an ok record of this script, mode and seed.
recorded_ok() {
  "$PYTHON" - "$RECORDS" "$@" <<'EOF'
import json, sys

path, script, mode, seed = sys.argv[1:]
try:
    with open(path) as f:
        lines = f.read().splitlines()
except FileNotFoundError:
    sys.exit(1)
for line in lines:
    try:
        r = json.loads(line)
    except json.JSONDecodeError:
        continue
    if (r.get("script"), r.get("mode"), str(r.get("seed")), r.get("status")) == (script, mode, seed, "ok"):
        sys.exit(0)
sys.exit(1)
EOF
}

# Append the run's speed record (from its --speed-log side file) to RECORDS with mode, log, status, date and
# CPU model added; a run that exited non-zero or wrote no record goes in as failed with its exit code.
append_record() {
  "$PYTHON" - "$RECORDS" "$CPU_MODEL" "$@" <<'EOF'
import json, sys, time

path, cpu_model, side, script, mode, seed, log, code = sys.argv[1:]
try:
    with open(side) as f:
        record = json.loads(f.read().splitlines()[-1])
except (OSError, IndexError, json.JSONDecodeError):
    record = None
ok = code == "0" and record is not None
entry = record if ok else {"script": script, "seed": int(seed)}
entry.update(mode=mode, log=log, status="ok" if ok else "failed", exit_code=int(code), cpu_model=cpu_model,
             date=time.strftime("%Y-%m-%d %H:%M:%S"))
with open(path, "a") as f:
    f.write(json.dumps(entry) + "\n")
print(f"ok, {entry['fps']} fps" if ok else f"FAILED (exit code {code}), see {log}")
sys.exit(0 if ok else 1)
EOF
}

total=0
for seed in "${SEED_LIST[@]}"; do
  for s in "${SCRIPT_LIST[@]}"; do
    for mode in $(modes "$s"); do total=$((total + 1)); done
  done
done

echo "run.sh: $total runs into $OUT"
n=0 failed=0
for seed in "${SEED_LIST[@]}"; do
  for s in "${SCRIPT_LIST[@]}"; do
    for mode in $(modes "$s"); do
      n=$((n + 1))
      name="${s}__${mode}__s${seed}"
      if recorded_ok "$s" "$mode" "$seed"; then
        echo "[$n/$total] $name: done before, skipped"
        continue
      fi
      args=($(mode_flags "$mode") --seed "$seed")
      [ "$QUICK" = 1 ] && args+=($(quick_args "$s"))
      side="$OUT/logs/$name.record"
      rm -f "$side"
      echo -n "[$n/$total] $name: "
      "$PYTHON" "$ROOT/leanrl/$s.py" "${args[@]}" ${EXTRA[@]+"${EXTRA[@]}"} --speed-log "$side" \
        >"$OUT/logs/$name.log" 2>&1
      code=$?
      append_record "$side" "$s" "$mode" "$seed" "logs/$name.log" "$code" || failed=$((failed + 1))
      rm -f "$side"
    done
  done
done

"$PYTHON" "$ROOT/leanrl/tools/speed_report.py" "$OUT" || exit 1
[ "$failed" = 0 ] || {
  echo "run.sh: $failed of $total runs failed" >&2
  exit 1
}
