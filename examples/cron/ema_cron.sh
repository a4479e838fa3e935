#!/usr/bin/env bash
# Fold a training run's new checkpoints into its EMA; meant to run from cron, logging one line per run.
#
#   */30 * * * * EMA_DECAY=0.9999 /opt/ema/ema_cron.sh /data/run1/ckpts >> /data/run1/ema-cron.log 2>&1
#
# Usage: ema_cron.sh CKPTS [EMA_DIR]      (EMA_DIR defaults to CKPTS/ema)
# Environment:
#   EMA_DECAY  decay per optimizer step (default 0.9999)
#   EMA_WAIT   seconds to wait for another run that holds the EMA's lock (default 60)
#   EMA_CKPT   the ema-ckpt command (default: ema-ckpt on PATH; cron's PATH is short, so give a full path)
#   PYTHON     a Python 3 to read ema-ckpt's JSON with (default: python3)
# Exit codes: 0 folded, or nothing new; 75 another run still held the lock (the next run catches
# up); anything else is ema-ckpt's error code (docs/cli.md), the old EMA left intact.
#
# Safe to run again and again while training saves and deletes checkpoints: checkpoints still being
# written are skipped until complete, each run folds only the checkpoints newer than the EMA (those
# retention deleted were folded earlier), and the new EMA replaces the old one atomically.
set -uo pipefail

ckpts=${1:?usage: ema_cron.sh CKPTS [EMA_DIR]}
ema_dir=${2:-$ckpts/ema}
decay=${EMA_DECAY:-0.9999}
wait_s=${EMA_WAIT:-60}
ema_ckpt=${EMA_CKPT:-ema-ckpt}
python=${PYTHON:-python3}

errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
log() { echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) ema-cron $ema_dir: $*"; }

json=$("$ema_ckpt" accumulate "$ckpts" --out "$ema_dir" --decay "$decay" --wait "$wait_s" --json 2>"$errors")
rc=$?
case $rc in
    0)
        summary=$(printf '%s' "$json" | "$python" -c '
import json, sys
r = json.load(sys.stdin)
if r["up_to_date"]:
    line = "up to date at step %d" % r["step"]
else:
    steps = ",".join(str(c["step"]) for c in r["folded"])
    word = "step" if len(r["folded"]) == 1 else "steps"
    line = "folded %s %s; EMA at step %d (%.1f s)" % (word, steps, r["step"], r["seconds"])
notes = " | ".join(" ".join(n.split()) for n in r["notes"])  # e.g. a checkpoint still being written
print(line + (" [%s]" % notes if notes else ""))
') || summary="done (its JSON summary was unreadable)"
        log "ok: $summary" ;;
    75)
        log "busy: another run holds the lock (waited ${wait_s} s); the next run catches up" ;;
    *)
        log "error (exit $rc): $(grep -v '^[[:space:]]*$' "$errors" | tail -n 1)" ;;
esac
exit "$rc"
