#!/usr/bin/env bash
# `make demo`: why EMA matters, on a real FSDP2 run kept up to date the way a cron job would.
#   bash examples/demo.sh PYTHON DIR      (default: python, demo)
# Trains a tiny transformer with FSDP2 on 2 CPU ranks at a deliberately noisy learning rate, in two
# jobs: the first stops at its time limit, the second resumes. DCP checkpoints land in DIR/ckpts/step_<N>
# at irregular steps, and the trainer's retention keeps only the newest few. `accumulate` runs after
# each job (cron runs 1 and 2; run 2 folds only the new checkpoints), and the EMA is checked against
# one run over every checkpoint ever saved. Then a post-hoc sweep over sigma_rel, every variant scored
# on the same held-out data (table + DIR/demo.png), and the best one shipped as safetensors and as a
# 4-rank DCP checkpoint. Last, `select` picks sigma_rel (or a latest-K average) by the same held-out
# loss (examples/demo/score.py), from its own candidates, and plots score against sigma_rel.
# Settings: DEMO_STEPS (400) in all, the first job stopping at DEMO_FIRST_JOB (215 of 400); DEMO_SAVE_EVERY
# (25,10: the first job's interval, the second's); DEMO_KEEP (20, the retention); DEMO_HALF_LIFE
# (20 steps) for the EMA; DEMO_SIGMAS (a comma-separated list) for the post-hoc sweep.
set -euo pipefail
PY="${1:-python}"
DIR="${2:-demo}"
STEPS="${DEMO_STEPS:-400}"
FIRST_JOB="${DEMO_FIRST_JOB:-$((STEPS * 215 / 400))}"
if ((FIRST_JOB < 1 || FIRST_JOB >= STEPS)); then
    echo "error: DEMO_FIRST_JOB ($FIRST_JOB), the first job's last step, must be above 0 and below DEMO_STEPS ($STEPS)" >&2
    exit 2
fi
IFS=, read -r SAVE_EVERY_1 SAVE_EVERY_2 <<<"${DEMO_SAVE_EVERY:-25,10}"
SAVE_EVERY_2="${SAVE_EVERY_2:-$SAVE_EVERY_1}"
KEEP="${DEMO_KEEP:-20}"
HALF_LIFE="${DEMO_HALF_LIFE:-20}"
SIGMAS="${DEMO_SIGMAS:-0.02,0.03,0.05,0.07,0.1,0.15,0.2,0.25}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ -x "$(dirname "$PY")/ema-ckpt" ]]; then
    CLI=("$(dirname "$PY")/ema-ckpt")
else
    CLI=("$PY" -m ema_ckpt)
fi
ema_ckpt() {
    echo "\$ ema-ckpt $*"
    "${CLI[@]}" "$@"
}
section() { printf '\n== %s\n' "$*"; }
train() {
    OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        "$HERE/demo/train.py" --out "$DIR/ckpts" --steps "$STEPS" --keep "$KEEP" "$@"
}
# Only for the check at the end: hard links to every checkpoint, taken before retention can delete it
# (a real job keeps no such copy; the EMA is what holds the deleted checkpoints).
keep_copy() {
    "$PY" - "$DIR/ckpts" "$DIR/every-checkpoint" <<'PY'
import os, shutil, sys
from pathlib import Path
src, dst = map(Path, sys.argv[1:])
for ckpt in src.glob("step_*"):
    if not (dst / ckpt.name).exists():
        shutil.copytree(ckpt, dst / ckpt.name, copy_function=os.link)
PY
}
listed() { (cd "$DIR/ckpts" && ls -d step_* | sort -t_ -k2 -n | tr '\n' ' '); }

rm -rf "$DIR"
mkdir -p "$DIR"
START=$SECONDS

section "training job 1: a tiny transformer, FSDP2 on 2 CPU ranks (gloo), noisy learning rate; a DCP checkpoint every $SAVE_EVERY_1 steps until the job's time limit stops it at step $FIRST_JOB (saved too)"
train --stop-after "$FIRST_JOB" --save-every "$SAVE_EVERY_1"
keep_copy

section "what FSDP2 wrote: one file per rank, the model and the optimizer state"
ema_ckpt inspect "$DIR/ckpts/step_$FIRST_JOB"

section "cron run 1: an EMA of the checkpoints there (each one's weight depends on the steps between them)"
ema_ckpt accumulate "$DIR/ckpts" --half-life "$HALF_LIFE" --out "$DIR/ema"

section "training job 2: resumes from step_$FIRST_JOB, a checkpoint every $SAVE_EVERY_2 steps; the trainer's retention keeps the newest $KEEP"
train --resume --save-every "$SAVE_EVERY_2"
keep_copy
echo "left in $DIR/ckpts: $(listed)"

section "cron run 2, its plan first (--dry-run): the EMA at step $FIRST_JOB stands in for every checkpoint folded so far, deleted or not; only newer ones are read"
ema_ckpt accumulate "$DIR/ckpts" --half-life "$HALF_LIFE" --out "$DIR/ema" --dry-run
ema_ckpt accumulate "$DIR/ckpts" --half-life "$HALF_LIFE" --out "$DIR/ema"

section "cron run 3: nothing new, so nothing written (exit 0)"
ema_ckpt accumulate "$DIR/ckpts" --half-life "$HALF_LIFE" --out "$DIR/ema"

section "post-hoc EMAs (EDM2): the EMA length chosen after training, a sweep over sigma_rel on the checkpoints retention kept"
ema_ckpt posthoc "$DIR/ckpts" --sigma-rel "$SIGMAS" --out "$DIR/posthoc"

section "held-out loss of each variant: the same model code, the same held-out data"
"$PY" "$HERE/demo/evaluate.py" "$DIR"
BEST="$(cat "$DIR/best")"

section "shipping the best weights: one safetensors file for model.load_state_dict, and a 4-rank DCP checkpoint"
ema_ckpt consolidate "$BEST" --out "$DIR/best.safetensors"
ema_ckpt reshard "$BEST" --world-size 4 --out "$DIR/best-4ranks"

section "checks: the shipped weights score as their source; the cron runs' EMA against one run over every checkpoint ever saved (the demo's copy) and a float64 EMA"
ema_ckpt accumulate "$DIR/every-checkpoint" --half-life "$HALF_LIFE" --out "$DIR/ema-one-shot" --quiet
"$PY" "$HERE/demo/evaluate.py" "$DIR" --check "$DIR/best.safetensors" "$DIR/best-4ranks" --cron

section "choosing by evaluation: select writes each candidate (every sigma_rel, the newest 4 and 8 averaged), scores it with the held-out loss (examples/demo/score.py) and keeps the best"
ema_ckpt select "$DIR/ckpts" --sigma-rel "$SIGMAS" --last 4,8 --eval "$PY $HERE/demo/score.py {path}" \
    --metric loss --out "$DIR/selected"

section "done in $((SECONDS - START)) s; outputs in $DIR/"
echo "ckpts/ what retention kept, ema/ the EMA, posthoc/ the post-hoc EMAs, results.json, best.safetensors, best-4ranks/"
echo "selected/ the candidate select chose; selected.select/ its score cache, logs and plot"
echo "every-checkpoint/ and ema-one-shot/: the copy and the one-shot EMA for the check"
if [[ -f "$DIR/demo.png" ]]; then echo "plot: $DIR/demo.png"; fi
if [[ -f "$DIR/selected.select/scores.png" ]]; then echo "plot: $DIR/selected.select/scores.png"; fi
