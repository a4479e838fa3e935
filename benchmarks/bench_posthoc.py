"""A post-hoc sweep of K = 4 σ_rel values against K = 1, side by side (each input read once per run).

Usage: python benchmarks/bench_posthoc.py [--data bench-data/dcp-1g] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import EMA, PY, Measurement, machine_description, run_timed, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/dcp-1g"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    subprocess.run([PY, str(Path(__file__).parent / "make_dcp_sequence.py"), str(args.data), "--count", "4"],
                   check=True, stdout=subprocess.DEVNULL)
    out = args.data.parent / "bench-posthoc"
    runs = {
        "posthoc K=1 (σ_rel 0.10)": ["--sigma-rel", "0.10"],
        "posthoc K=4 (σ_rel 0.05,0.10,0.15,0.20)": ["--sigma-rel", "0.05,0.10,0.15,0.20"],
    }
    results = {name: Measurement(name, [], []) for name in runs}
    for _ in range(args.repeat):
        for name, extra in runs.items():
            shutil.rmtree(out, ignore_errors=True)
            wall, rss = run_timed([EMA, "posthoc", str(args.data), *extra, "--out", str(out), "--quiet"])
            results[name].wall.append(wall)
            results[name].rss_mib.append(rss)
    shutil.rmtree(out, ignore_errors=True)
    one, four = results.values()
    print(f"Machine: {machine_description()}")
    print(f"Input: 4 × 1 GiB fp32 DCP checkpoints; medians of {args.repeat} runs, hot page cache\n")
    print(table([(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()],
                ("command", "wall s", "peak RSS MiB")))
    print(f"\nK=4 / K=1 time = {four.wall_median / one.wall_median:.2f}")


if __name__ == "__main__":
    main()
