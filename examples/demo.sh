#!/usr/bin/env bash
# `make demo`: why EMA matters, on a real FSDP2 run.
#   bash examples/demo.sh PYTHON DIR      (default: python, demo)
# Trains a tiny transformer with FSDP2 on 2 CPU ranks at a deliberately noisy learning rate,
# saving DCP checkpoints to DIR/ckpts/step_<N>; then inspects one, folds them into an EMA,
# sweeps post-hoc EMAs over sigma_rel, scores every variant on the same held-out data
# (table + DIR/demo.png), and ships the best one as safetensors and as a 4-rank DCP checkpoint.
# Settings: DEMO_STEPS (400) and DEMO_SAVE_EVERY (10) for the training, DEMO_HALF_LIFE (20 steps)
# for the EMA, DEMO_SIGMAS (a comma-separated list) for the post-hoc sweep.
set -euo pipefail
PY="${1:-python}"
DIR="${2:-demo}"
STEPS="${DEMO_STEPS:-400}"
SAVE_EVERY="${DEMO_SAVE_EVERY:-10}"
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

rm -rf "$DIR"
mkdir -p "$DIR"
START=$SECONDS

section "training a tiny transformer with FSDP2 on 2 CPU ranks (gloo): $STEPS steps at a noisy learning rate, a DCP checkpoint every $SAVE_EVERY steps"
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    "$HERE/demo/train.py" --out "$DIR/ckpts" --steps "$STEPS" --save-every "$SAVE_EVERY"
LAST="$DIR/ckpts/step_$STEPS"  # the last step is always saved

section "what FSDP2 wrote: one file per rank, the model and the optimizer state"
ema_ckpt inspect "$LAST"

section "an EMA of every checkpoint (the weights each one gets depend on the steps between them)"
ema_ckpt accumulate "$DIR/ckpts" --half-life "$HALF_LIFE" --out "$DIR/ema"

section "post-hoc EMAs (EDM2): choose the EMA length after training, here a sweep over sigma_rel"
ema_ckpt posthoc "$DIR/ckpts" --sigma-rel "$SIGMAS" --out "$DIR/posthoc"

section "held-out loss of each variant: the same model code, the same held-out data"
"$PY" "$HERE/demo/evaluate.py" "$DIR"
BEST="$(cat "$DIR/best")"

section "shipping the best weights: one safetensors file for model.load_state_dict, and a 4-rank DCP checkpoint"
ema_ckpt consolidate "$BEST" --out "$DIR/best.safetensors"
ema_ckpt reshard "$BEST" --world-size 4 --out "$DIR/best-4ranks"
"$PY" "$HERE/demo/evaluate.py" "$DIR" --check "$DIR/best.safetensors" "$DIR/best-4ranks"

section "done in $((SECONDS - START)) s; outputs in $DIR/"
echo "ckpts/ raw checkpoints, ema/ the EMA, posthoc/ the post-hoc EMAs, results.json, best.safetensors, best-4ranks/"
if [[ -f "$DIR/demo.png" ]]; then echo "plot: $DIR/demo.png"; fi
