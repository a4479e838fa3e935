#!/usr/bin/env bash
# Train a tiny FSDP2 model on CPU (2 ranks, gloo) saving DCP checkpoints at irregular
# steps, then look at one checkpoint and fold them all into an EMA.
set -euo pipefail
PY="${1:-python}"
DIR="${2:-demo}"
rm -rf "$DIR"
mkdir -p "$DIR"
echo "== training a tiny FSDP2 model on 2 CPU ranks, checkpoints in $DIR/ckpts"
"$PY" - "$DIR/ckpts" <<'PYEOF'
import sys
from pathlib import Path
from tests.producers.launch import make_fsdp_sequence
paths = make_fsdp_sequence(Path(sys.argv[1]), kind="fsdp2", world_size=2, steps=[10, 25, 40, 41, 80])
print("\n".join(str(p) for p in paths))
PYEOF
EMA="$(dirname "$PY")/ema-ckpt"
echo; echo "== ema-ckpt inspect $DIR/ckpts/step_80"
"$EMA" inspect "$DIR/ckpts/step_80"
echo; echo "== ema-ckpt accumulate $DIR/ckpts --decay 0.98   (an EMA of the first four checkpoints)"
mkdir -p "$DIR/live"
for s in 10 25 40 41; do cp -r "$DIR/ckpts/step_$s" "$DIR/live/"; done
"$EMA" accumulate "$DIR/live" --decay 0.98
echo; echo "== a new checkpoint lands and retention deletes the oldest; the next cron run folds it in"
cp -r "$DIR/ckpts/step_80" "$DIR/live/"; rm -rf "$DIR/live/step_10"
"$EMA" accumulate "$DIR/live" --decay 0.98
echo; echo "== nothing new: exits 0 and changes no byte"
"$EMA" accumulate "$DIR/live" --decay 0.98
echo; echo "== the EMA ($DIR/live/ema), a DCP checkpoint torch's dcp.load reads"
"$EMA" inspect "$DIR/live/ema"
