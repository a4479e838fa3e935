#!/usr/bin/env bash
# Run every benchmark; data is generated under bench-data/ (git-ignored) on first use.
set -euo pipefail
PY="${1:-python}"
cd "$(dirname "$0")/.."
for script in benchmarks/bench_*.py; do
  echo "## $script"
  "$PY" "$script"
  echo
done
