#!/usr/bin/env bash
# Check --device DEV against --device cpu on fp32 DCP checkpoints generated here: the bits of
# accumulate (lerp folds; two power EMAs, whose weights take both of lerp's branches), of an EMA
# started on the CPU and continued on DEV, and of a posthoc K = 8 sweep (weighted sums), then
# their times against the CPU's and the read floor (cat of the inputs). Expected: bit-identical
# (benchmarks/gpu_compare.py says why). Every step runs under timeout, all within --deadline
# seconds; the summary (a table, and OUT/gpu_check.json) gets 30 s more.
#
# Usage: bash benchmarks/gpu_check.sh [--device cuda] [--out DIR] [--size-gib 1] [--count 4]
#            [--python python3] [--work DIR] [--dtype float32] [--max-ulps 0] [--repeat 1]
#            [--deadline 260] [--keep]
# Exit: 0 every output within --max-ulps of the CPU's; 1 one is not; 2 usage or setup; 3 a step
# failed or ran out of time (its log is in OUT/logs).
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEV=cuda OUT="$ROOT/bench-data/gpu-check-out" WORK="$ROOT/bench-data/gpu-check" SIZE=1 COUNT=4
PY="${PYTHON:-python3}" DTYPE=float32 MAX_ULPS=0 REPEAT=1 DEADLINE=260 KEEP=0

usage() { sed -n '9,11p' "$0" | sed 's/^# //' >&2; exit 2; }
while (($#)); do
  case "$1" in
    --device) DEV="${2:?}"; shift 2 ;;
    --out) OUT="${2:?}"; shift 2 ;;
    --size-gib) SIZE="${2:?}"; shift 2 ;;
    --count) COUNT="${2:?}"; shift 2 ;;
    --python) PY="${2:?}"; shift 2 ;;
    --work) WORK="${2:?}"; shift 2 ;;
    --dtype) DTYPE="${2:?}"; shift 2 ;;
    --max-ulps) MAX_ULPS="${2:?}"; shift 2 ;;
    --repeat) REPEAT="${2:?}"; shift 2 ;;
    --deadline) DEADLINE="${2:?}"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage ;;
    *) echo "error: unknown argument '$1'" >&2; usage ;;
  esac
done
[[ "$COUNT" =~ ^[0-9]+$ ]] && ((COUNT >= 2)) || { echo "error: --count must be an integer ≥ 2, got '$COUNT'" >&2; exit 2; }
for flag in "repeat $REPEAT" "deadline $DEADLINE" "max-ulps $MAX_ULPS"; do
  set -- $flag
  [[ "${2-}" =~ ^[0-9]+$ ]] || { echo "error: --$1 must be a whole number, got '${2-}'" >&2; exit 2; }
done
[[ "$SIZE" =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "error: --size-gib must be a number, got '$SIZE'" >&2; exit 2; }

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this tree's ema_ckpt, installed or not
mkdir -p "$OUT/logs" "$WORK" || exit 2
OUT="$(cd "$OUT" && pwd)" WORK="$(cd "$WORK" && pwd)"
TIMES="$OUT/timings.tsv" CKPTS="$WORK/ckpts-${SIZE}g-$COUNT"
: >"$TIMES"
rm -f "$OUT"/logs/*.log "$OUT"/compare-*.json "$OUT/gpu_check.json"
STARTED=$(date +%s)
DEADLINE_AT=$((STARTED + DEADLINE))
FAILED=""
EMA=("$PY" -m ema_ckpt)

# step NAME DEVICE LIMIT CMD...: CMD under timeout (at most LIMIT s, never past the deadline),
# its output in OUT/logs, its time in OUT/timings.tsv (DEVICE "-": a step that is not compared
# across devices, listed apart). A failure is noted
# (FAILED) and its log's tail shown, unless QUIET_FAILURE is set (the caller says it instead).
step() {
  local name=$1 device=$2 limit=$3 rc t0 t1 log
  shift 3
  log="$OUT/logs/$(tr -c 'A-Za-z0-9.=\n-' '_' <<<"$name-$device" | head -c 80).log"
  local left=$((DEADLINE_AT - $(date +%s)))
  if ((left < 2)); then
    FAILED="$name ($device): no time left before the deadline"
    return 124
  fi
  ((limit > left)) && limit=$left
  timeout 60 sync  # dirty pages of the previous step are written back, untimed (bounded: a slow disk)
  t0=$(date +%s.%N)
  timeout --kill-after=5 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  printf '%s\t%s\t%s\t%s\n' "$name" "$device" "$(awk "BEGIN { printf \"%.3f\", $t1 - $t0 }")" "$rc" >>"$TIMES"
  if ((rc != 0)) && [[ -z "${QUIET_FAILURE:-}" ]]; then
    [[ -n "$FAILED" ]] || FAILED="$name ($device): exit $rc$( ((rc == 124)) && echo ", timed out after ${limit} s")"
    echo "step failed: $name ($device), exit $rc; last lines of $log:" >&2
    tail -n 5 "$log" >&2
  fi
  return "$rc"
}

finish() {
  local rc=$1
  timeout --kill-after=5 30 "$PY" "$ROOT/benchmarks/gpu_compare.py" summary --timings "$TIMES" --json-dir "$OUT" \
    --device "$DEV" --count "$COUNT" --size-gib "$SIZE" --dtype "$DTYPE" --repeat "$REPEAT" \
    --elapsed-s $(($(date +%s) - STARTED)) ${FAILED:+--failed-step "$FAILED"}
  local summary_rc=$?
  ((KEEP)) || rm -rf "$WORK"/accumulate-{ref,dev} "$WORK"/posthoc-{ref,dev} "$WORK/continued"
  [[ -z "$FAILED" ]] || exit 3
  ((rc == 0)) || exit "$rc"
  exit "$summary_rc"
}

# 1. what this machine has (the CPU needs no check: starting torch is timed below)
if [[ "$DEV" != cpu ]] && ! QUIET_FAILURE=1 step "preflight" - 60 "$PY" -c "
import sys, torch, ema_ckpt.cli
dev = sys.argv[1]
if not dev.startswith('cuda') or not torch.cuda.is_available():
    sys.exit(f'{dev}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no such device')
torch.zeros(1, device=dev)
print(torch.cuda.get_device_name(torch.device(dev)), 'torch', torch.__version__, 'CUDA', torch.version.cuda)
" "$DEV"; then
  echo "error: --device $DEV with $PY: $(tail -n 1 "$OUT/logs/preflight--.log")" >&2
  exit 2
fi

# 2. the inputs: COUNT checkpoints of about SIZE GiB each (kept in WORK between runs)
step "generate inputs" - 150 "$PY" "$ROOT/benchmarks/make_dcp_sequence.py" "$CKPTS" --size-gib "$SIZE" \
  --count "$COUNT" || finish 3
mapfile -t INPUTS < <(find "$CKPTS" -type f | sort)
FIRST_HALF=()  # make_dcp_sequence.py's steps: 1000, 2000, ...
for ((n = 1; n <= COUNT / 2; n++)); do FIRST_HALF+=("$CKPTS/step_$((1000 * n))"); done

# 3. floors: reading the inputs (the page cache is warmed first), starting torch (and the device)
timeout 60 cat "${INPUTS[@]}" >/dev/null
for ((r = 0; r < REPEAT; r++)); do
  step "cat inputs (read floor)" cpu 60 bash -c 'cat "$@" >/dev/null' _ "${INPUTS[@]}" || finish 3
  step "start torch" cpu 60 "$PY" -c "import torch" || finish 3
  if [[ "$DEV" != cpu ]]; then
    step "start torch" "$DEV" 60 "$PY" -c "import torch, sys; torch.zeros(1, device=sys.argv[1]).cpu()" "$DEV" ||
      finish 3
  fi
done

# 4. the runs, CPU and DEV in turn, each pair's bits compared at once (exit 1 of a comparison, a
# difference over --max-ulps, is a result, not a failed step)
status=0
compare() {  # compare NAME REF OTHER
  local saved=$FAILED rc
  step "compare $1" - 120 "$PY" "$ROOT/benchmarks/gpu_compare.py" compare --json-dir "$OUT" --max-ulps "$MAX_ULPS" \
    --pair "$1" "$2" "$3"
  rc=$?
  cat "$OUT/logs/compare_$1--.log"
  if ((rc == 1)); then status=1 FAILED=$saved; elif ((rc != 0)); then finish 3; fi
}
pairs() {  # pairs NAME DIR LIMIT ARGS...: ema-ckpt ARGS on the CPU (WORK/DIR-ref) and on DEV (WORK/DIR-dev)
  local name=$1 dir=$2 limit=$3 r i device side
  shift 3
  for ((r = 0; r < REPEAT; r++)); do
    order=(0 1)
    ((r % 2)) && order=(1 0)  # neither side always runs first
    for i in "${order[@]}"; do
      device=$DEV side=dev
      ((i == 0)) && device=cpu side=ref
      rm -rf "$WORK/$dir-$side"
      step "$name" "$device" "$limit" "${EMA[@]}" "$@" --out "$WORK/$dir-$side" --device "$device" || finish 3
    done
  done
}
KINDS=(--sigma-rel 0.05,0.25 --dtype "$DTYPE" --quiet)
pairs "accumulate (2 EMAs)" accumulate 120 accumulate "$CKPTS" "${KINDS[@]}"
compare accumulate "$WORK/accumulate-ref" "$WORK/accumulate-dev"
pairs "posthoc K=8" posthoc 180 posthoc "$CKPTS" --sigma-rel 0.05:0.19:0.02 --dtype "$DTYPE" --quiet
compare posthoc "$WORK/posthoc-ref" "$WORK/posthoc-dev"

# 5. an EMA started on the CPU (first half of the checkpoints) and continued on DEV
rm -rf "$WORK/continued"
step "start an EMA on the CPU" - 120 "${EMA[@]}" accumulate "${FIRST_HALF[@]}" "${KINDS[@]}" --out "$WORK/continued" \
  --device cpu || finish 3
step "continue it on $DEV" - 120 "${EMA[@]}" accumulate "$CKPTS" "${KINDS[@]}" --out "$WORK/continued" \
  --device "$DEV" || finish 3
compare accumulate-continued "$WORK/accumulate-ref" "$WORK/continued"
finish "$status"
