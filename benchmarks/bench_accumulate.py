"""accumulate over N fp32 DCP checkpoints: wall time and peak RSS beside cat and the hand-written loop.

Usage: python benchmarks/bench_accumulate.py [--data bench-data/dcp-1g] [--repeat 3]
Generates the sequence first if missing (benchmarks/make_dcp_sequence.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (
    EMA,
    PY,
    Measurement,
    baseline_ratios,
    dcp_sequence,
    dir_bytes,
    durable_writes,
    in_turn,
    machine_description,
    run_timed,
    table,
    with_baseline,
    write_floor,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/dcp-1g"))
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-handwritten", action="store_true")
    args = parser.parse_args()
    here = Path(__file__).parent
    ckpts = dcp_sequence(args.data, args.size_gib, args.count)
    input_bytes = sum(dir_bytes(c) for c in ckpts)
    out_root = args.data.parent / "bench-out"
    shutil.rmtree(out_root, ignore_errors=True)
    out_root.mkdir()
    files = " ".join(str(f) for c in ckpts for f in sorted(c.iterdir()))
    out_mib = max(1, sum(int(p.stat().st_size) for p in ckpts[-1].iterdir()) >> 20)
    runs = {
        "cat inputs > /dev/null": dict(cmd=f"cat {files} > /dev/null", shell=True),
        "python -c 'import torch'": dict(cmd=[PY, "-c", "import torch"]),
        "write the output bytes once (dd, fsync)": dict(
            cmd=durable_writes(out_root / "dd", 1, out_mib, direct=False), shell=True),
        "write the output bytes once (dd, O_DIRECT, fsync)": dict(
            cmd=durable_writes(out_root / "dd", 1, out_mib, direct=True), shell=True),
        "ema-ckpt accumulate": dict(cmd=[EMA, "accumulate", *map(str, ckpts), "--decay", "0.999",
                                         "--out", str(out_root / "ema"), "--quiet", "--restart"]),
    }
    if not args.skip_handwritten:
        runs["hand-written loop (full loads + lerp_ + dcp.save)"] = dict(
            cmd=[PY, str(here / "handwritten_ema.py"), str(out_root / "hand"), "0.999", *map(str, ckpts)])
    runs = with_baseline(runs)
    results = {name: Measurement(name, [], []) for name in runs}
    for repeat in range(args.repeat):
        for name, spec in in_turn(runs, repeat):
            for target in ("ema", "hand", "dd"):
                if not (target == "ema" and name.startswith("hand")):
                    shutil.rmtree(out_root / target, ignore_errors=True)
            wall, rss = run_timed(spec["cmd"], shell=spec.get("shell", False), env=spec.get("env"))
            results[name].wall.append(wall)
            results[name].rss_mib.append(rss)
    output_bytes = dir_bytes(out_root / "ema") if (out_root / "ema").exists() else 0
    write, _ = write_floor(results, "write the output bytes once (dd, fsync)",
                           "write the output bytes once (dd, O_DIRECT, fsync)")
    floor = results["cat inputs > /dev/null"].wall_median + results["python -c 'import torch'"].wall_median + write
    ema = results["ema-ckpt accumulate"]
    rows = [(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()]
    print(f"Machine: {machine_description()}")
    print(f"Input: {len(ckpts)} checkpoints, {input_bytes / 2**30:.2f} GiB in all; medians of {args.repeat} runs,"
          " hot page cache\n")
    print(table(rows, ("command", "wall s", "peak RSS MiB")))
    print(f"\nfloor (cat + import torch + the faster durable write of the output) = {floor:.2f} s; "
          f"accumulate / floor = {ema.wall_median / floor:.2f}")
    if "hand-written loop (full loads + lerp_ + dcp.save)" in results:
        hand = results["hand-written loop (full loads + lerp_ + dcp.save)"]
        print(f"accumulate / hand-written: time {ema.wall_median / hand.wall_median:.2f}, "
              f"peak RSS {ema.rss_median / hand.rss_median:.2f}")
    print(f"output: {output_bytes / 2**30:.2f} GiB")

    if baseline_ratios(results):
        print("\n" + baseline_ratios(results))


if __name__ == "__main__":
    main()
