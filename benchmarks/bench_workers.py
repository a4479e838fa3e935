"""--workers 2 against 1, on a CPU-bound case and on an I/O-bound one.

- **CPU-bound**: averaging 4 checkpoints of 20k small tensors. Per-chunk work (parsing a
  record, reading it, folding it, writing a record) is Python-bound, so a second worker halves it.
- **I/O-bound**: accumulate over 4 × 1 GiB checkpoints of large tensors (bench-data/dcp-1g).
  Each byte is copied from the page cache, folded and copied back into the page cache and to
  the disk; with 2 cores the kernel's copies and the disk's write-back already run beside the
  arithmetic, so the ceiling is the floor (cat + dd of the output), shown beside it.

Usage: python benchmarks/bench_workers.py [--repeat 3] [--large bench-data/dcp-1g]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (
    BASELINE,
    EMA,
    PY,
    dir_bytes,
    durable_writes,
    machine_description,
    measure_in_turn,
    table,
    with_baseline,
    write_floor,
)


def make(root: Path, count: int, tensors: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        path = root / f"step_{(i + 1) * 100}"
        if (path / ".metadata").exists():
            continue
        model = {f"blocks.{j}.norm.weight": torch.randn(1024, generator=g) for j in range(tensors)}
        dcp.save({"model": model}, checkpoint_id=str(path), no_dist=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/small-4x20k"))
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--tensors", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--large", default="bench-data/dcp-1g", help="the I/O-bound case's data ('' skips it)")
    args = parser.parse_args()
    make(args.data, args.count, args.tensors)
    out = args.data.parent / "bench-workers"
    runs = {f"average --workers {n}": dict(cmd=[EMA, "average", str(args.data), "--last", str(args.count),
                                                "--out", str(out), "--quiet", "--workers", str(n)]) for n in (1, 2)}
    inputs = sorted(str(p) for p in args.data.iterdir() if p.name.startswith("step_"))[-args.count:]
    parse = "from ema_ckpt.formats.dcp import DcpReader; import sys; [DcpReader(p) for p in sys.argv[1:]]"
    halves = [" ".join(inputs[r::2]) for r in (0, 1)]
    # the machine's own two-core scaling, measured beside the runs: the same Python-bound work
    # (parsing the inputs' metadata) in one process, then split over two at once
    runs["parse the inputs, 1 process"] = dict(cmd=[PY, "-c", parse, *inputs])
    runs["parse the inputs, 2 processes at once"] = dict(
        cmd=f"{PY} -c '{parse}' {halves[0]} & {PY} -c '{parse}' {halves[1]}; wait", shell=True)
    results = measure_in_turn(with_baseline(runs), out, args.repeat)
    one, two = results["average --workers 1"], results["average --workers 2"]
    alone, split = results["parse the inputs, 1 process"], results["parse the inputs, 2 processes at once"]
    print(f"Machine: {machine_description()}")
    print(f"Input: {args.count} DCP checkpoints of {args.tensors} fp32 tensors of 4 KiB; "
          f"medians of {args.repeat} runs\n")
    print(table([(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()],
                ("command", "wall s", "peak RSS MiB (largest process)")))
    print(f"\nspeed-up with 2 workers = {one.wall_median / two.wall_median:.2f}×")
    # each round runs both rows back to back: their ratio is steadier than the medians' on a
    # machine whose speed drifts
    rounds = [a / b for a, b in zip(one.wall, two.wall, strict=True)]
    print(f"per round: {', '.join(f'{r:.2f}×' for r in rounds)}; median {statistics.median(rounds):.2f}×")
    scaling = [a / b for a, b in zip(alone.wall, split.wall, strict=True)]
    print(f"this machine's two-core scaling of Python-bound work (the parse): "
          f"{alone.wall_median / split.wall_median:.2f}× (per round {', '.join(f'{r:.2f}×' for r in scaling)})")
    if BASELINE:
        base_one, base_two = (results[f"average --workers {n} [baseline]"] for n in (1, 2))
        print(f"baseline: speed-up {base_one.wall_median / base_two.wall_median:.2f}×; "
              f"this tree against it: {one.wall_median / base_one.wall_median:.2f}× (1 worker), "
              f"{two.wall_median / base_two.wall_median:.2f}× (2 workers)")
    if args.large:
        large_case(Path(args.large), args.repeat)


def large_case(data: Path, repeat: int) -> None:
    subprocess.run([PY, str(Path(__file__).parent / "make_dcp_sequence.py"), str(data), "--count", "4"],
                   check=True, stdout=subprocess.DEVNULL)
    out = data.parent / "bench-workers-large"
    ckpts = sorted(p for p in data.iterdir() if p.name.startswith("step_"))
    files = " ".join(str(f) for c in ckpts for f in sorted(c.iterdir()))
    mib = max(1, dir_bytes(ckpts[-1]) >> 20)
    runs: dict[str, dict] = {
        "cat inputs": dict(cmd=f"cat {files} > /dev/null", shell=True),
        "import torch": dict(cmd=[PY, "-c", "import torch"]),
        "write the output durably": dict(cmd=durable_writes(out, 1, mib, direct=False), shell=True),
        "write the output durably (O_DIRECT)": dict(cmd=durable_writes(out, 1, mib, direct=True), shell=True),
    }
    for n in (1, 2):
        runs[f"accumulate --workers {n}"] = dict(cmd=[EMA, "accumulate", str(data), "--decay", "0.999", "--out",
                                                      str(out), "--quiet", "--restart", "--workers", str(n)])
    results = measure_in_turn(runs, out, repeat)
    floor = (sum(results[name].wall_median for name in ("cat inputs", "import torch"))
             + write_floor(results, "write the output durably", "write the output durably (O_DIRECT)")[0])
    one, two = results["accumulate --workers 1"], results["accumulate --workers 2"]
    print("\n### I/O-bound: accumulate over 4 × 1 GiB checkpoints of large tensors\n")
    print(table([(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()],
                ("command", "wall s", "peak RSS MiB (largest process)")))
    print(f"\nspeed-up with 2 workers = {one.wall_median / two.wall_median:.2f}×; floor (cat + import torch + dd) "
          f"{floor:.2f} s: 1 worker at {one.wall_median / floor:.2f}×, 2 workers at {two.wall_median / floor:.2f}× "
          "the floor")


if __name__ == "__main__":
    main()
