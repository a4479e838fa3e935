"""A post-hoc sweep of K = 4 σ_rel values against K = 1, side by side (each input read once per run).

Beside them, the floor of each: reading the inputs (cat), starting torch, and writing K outputs
of the same size durably (dd with fsync, one file per output, written concurrently). Their
ratio bounds what any tool that reads once and writes durably can reach for K = 4 against
K = 1 on this machine.

Usage: python benchmarks/bench_posthoc.py [--data bench-data/dcp-1g] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (
    EMA,
    PY,
    Measurement,
    baseline_ratios,
    dir_bytes,
    in_turn,
    machine_description,
    run_timed,
    table,
    with_baseline,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/dcp-1g"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    subprocess.run([PY, str(Path(__file__).parent / "make_dcp_sequence.py"), str(args.data), "--count", "4"],
                   check=True, stdout=subprocess.DEVNULL)
    out = args.data.parent / "bench-posthoc"
    ckpts = sorted(p for p in args.data.iterdir() if p.name.startswith("step_"))
    files = " ".join(str(f) for c in ckpts for f in sorted(c.iterdir()))
    out_mib = max(1, dir_bytes(ckpts[-1]) >> 20)  # an fp32 output is the size of an fp32 input

    def durable_writes(k: int) -> str:
        # concurrently: this disk takes four streams faster than four files one after another
        return " ".join(f"dd if=/dev/zero of={out}/dd{i}.bin bs=1M count={out_mib} conv=fsync status=none &"
                        for i in range(k)) + " wait"

    runs = {
        "cat inputs > /dev/null": dict(cmd=f"cat {files} > /dev/null", shell=True),
        "python -c 'import torch'": dict(cmd=[PY, "-c", "import torch"]),
        "write 1 output durably (dd, fsync)": dict(cmd=f"mkdir -p {out} && {durable_writes(1)}", shell=True),
        "write 4 outputs durably (dd, fsync)": dict(cmd=f"mkdir -p {out} && {durable_writes(4)}", shell=True),
        "posthoc K=1 (σ_rel 0.10)": dict(cmd=[EMA, "posthoc", str(args.data), "--sigma-rel", "0.10",
                                              "--out", str(out), "--quiet"]),
        "posthoc K=4 (σ_rel 0.05,0.10,0.15,0.20)": dict(cmd=[EMA, "posthoc", str(args.data), "--sigma-rel",
                                                             "0.05,0.10,0.15,0.20", "--out", str(out), "--quiet"]),
    }
    runs = with_baseline(runs)
    results = {name: Measurement(name, [], []) for name in runs}
    for repeat in range(args.repeat):
        for name, spec in in_turn(runs, repeat):
            shutil.rmtree(out, ignore_errors=True)
            wall, rss = run_timed(spec["cmd"], shell=spec.get("shell", False), env=spec.get("env"))
            results[name].wall.append(wall)
            results[name].rss_mib.append(rss)
    shutil.rmtree(out, ignore_errors=True)
    cat, torch_start, write1, write4, one, four = list(results.values())[:6]
    floor1 = cat.wall_median + torch_start.wall_median + write1.wall_median
    floor4 = cat.wall_median + torch_start.wall_median + write4.wall_median
    print(f"Machine: {machine_description()}")
    print(f"Input: 4 × 1 GiB fp32 DCP checkpoints; medians of {args.repeat} runs, hot page cache\n")
    print(table([(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()],
                ("command", "wall s", "peak RSS MiB")))
    print(f"\nfloor K=1 (cat + import torch + 1 durable output) = {floor1:.2f} s; posthoc K=1 / floor = "
          f"{one.wall_median / floor1:.2f}")
    print(f"floor K=4 (cat + import torch + 4 durable outputs) = {floor4:.2f} s; posthoc K=4 / floor = "
          f"{four.wall_median / floor4:.2f}")
    print(f"K=4 / K=1 time = {four.wall_median / one.wall_median:.2f} (floors: {floor4 / floor1:.2f})")

    if baseline_ratios(results):
        print("\n" + baseline_ratios(results))


if __name__ == "__main__":
    main()
