"""A cron tick with nothing new: the wall time of ``ema-ckpt accumulate`` over N small checkpoints
whose EMA is already up to date, each tick a fresh process (as cron runs it), and whether it
imported torch. Finding steps and components reads no tensor bytes.

Two layouts: ``files`` (one safetensors file per step, the step in its name) and ``records``
(kohya-style files whose step is only in their header's ``__metadata__``: every header is read).

Run it against another source tree with ``--tree PATH`` for a side-by-side figure (the same
checkpoints, one after the other, alternating).

Usage: python benchmarks/bench_cron_tick.py [--checkpoints 1000] [--repeat 5] [--tree OTHER_TREE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TICK = """
import sys, time
started = time.perf_counter()
from ema_ckpt import accumulate
result = accumulate(sys.argv[1], decay=0.999, out=sys.argv[2])
assert result.up_to_date, result
print(time.perf_counter() - started, "torch" in sys.modules)
"""


def make(root: Path, layout: str, n: int) -> None:
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    weights = {"w": torch.zeros(4), "b": torch.zeros(2)}
    for step in range(1, n + 1):
        if layout == "files":
            save_file(weights, str(root / f"step_{step:06d}.safetensors"))
        else:
            save_file(weights, str(root / f"run-{step:06d}x.safetensors"), metadata={"ss_steps": str(step)})


def tick(tree: Path, root: Path, out: Path) -> tuple[float, float, bool]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", TICK, str(root), str(out)], capture_output=True, text=True,
                          env=env, check=True)
    wall = time.perf_counter() - started
    inside, torch_loaded = done.stdout.split()
    return wall, float(inside), torch_loaded == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tree", type=Path, help="another source tree, measured side by side")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    trees = [("this tree", here)] + ([("other tree", args.tree.resolve())] if args.tree else [])
    work = Path(tempfile.mkdtemp(prefix="bench-cron-tick-"))
    try:
        for layout in ("files", "records"):
            root = work / layout
            make(root, layout, args.checkpoints)
            for name, tree in trees:
                out = work / f"ema-{layout}-{name.replace(' ', '-')}"
                env = {**os.environ, "PYTHONPATH": str(tree)}
                first = subprocess.run([sys.executable, "-c", "import sys; from ema_ckpt import accumulate; "
                                        "accumulate(sys.argv[1], decay=0.999, out=sys.argv[2])", str(root), str(out)],
                                       capture_output=True, text=True, env=env)
                if first.returncode != 0:
                    print(f"{layout:8} {name:10}: the first run failed: {first.stderr.strip().splitlines()[-1]}")
                    continue
            results: dict[str, list[tuple[float, float, bool]]] = {name: [] for name, _ in trees}
            for _ in range(args.repeat):
                for name, tree in trees:
                    out = work / f"ema-{layout}-{name.replace(' ', '-')}"
                    if out.exists():
                        results[name].append(tick(tree, root, out))
            for name, runs in results.items():
                if runs:
                    print(f"{layout:8} {name:10}: {args.checkpoints} checkpoints, nothing new: median wall "
                          f"{statistics.median(r[0] for r in runs):.3f} s (in-process "
                          f"{statistics.median(r[1] for r in runs):.3f} s) of {len(runs)}; torch imported: "
                          f"{any(r[2] for r in runs)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
