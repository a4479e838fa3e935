"""How accumulate grows with the checkpoint: time and peak RSS at 1, 2, 4 and 8 GiB, and the
cost per tensor on a checkpoint of 100k small tensors beside ``dcp.load``'s.

- **Size**: one fp32 DCP checkpoint of each size (benchmarks/make_dcp_sequence.py: the same
  mix of 30+ tensors, scaled) folded into a fresh EMA: every byte read once, converted, written
  and fsynced once. Time should grow linearly (seconds per GiB within 10% of each other) and
  peak RSS stay flat (within 10%). Beside each run, its floor: ``cat`` of the checkpoint, starting
  torch, and ``dd conv=fsync`` of the output's size. Each size is generated, measured and deleted in
  turn, so the disk holds one size at a time (8 GiB in, 8 GiB out).
- **Many tensors**: a checkpoint of 100k fp32 tensors of 4 KiB (400 MiB). accumulate's time
  per tensor (less starting torch) against ``dcp.load``'s into a state dict of the same
  tensors, and against unpickling its ``.metadata`` alone.

Usage: python benchmarks/bench_growth.py [--sizes 1,2,4,8] [--tensors 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (
    EMA,
    PY,
    Measurement,
    dir_bytes,
    durable_writes,
    machine_description,
    measure_in_turn,
    run_timed,
    table,
    write_floor,
)

_DCP_LOAD = """
import sys, time, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
path = sys.argv[1]
started = time.perf_counter()
metadata = FileSystemReader(path).read_metadata()
unpickled = time.perf_counter() - started
state = {"model": {}}
for fqn, meta in metadata.state_dict_metadata.items():
    if hasattr(meta, "size"):
        state["model"][fqn.split(".", 1)[1]] = torch.empty(meta.size, dtype=meta.properties.dtype)
started = time.perf_counter()
dcp.load(state, checkpoint_id=path, no_dist=True)
print(unpickled, time.perf_counter() - started, len(state["model"]))
"""


def _many_tensors(path: Path, count: int) -> None:
    if (path / "step_100" / ".metadata").exists():
        return
    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    model = {f"blocks.{j}.norm.weight": torch.randn(1024, generator=g) for j in range(count)}
    dcp.save({"model": model}, checkpoint_id=str(path / "step_100"), no_dist=True)


def size_case(root: Path, sizes: list[float], repeat: int) -> None:
    rows, per_gib, rss, points, floor_points = [], [], [], [], []
    for size in sizes:
        data = root / f"growth-{size:g}g"
        out = root / "bench-growth-out"
        subprocess.run([PY, str(Path(__file__).parent / "make_dcp_sequence.py"), str(data), "--size-gib", str(size),
                        "--count", "1"], check=True, stdout=subprocess.DEVNULL)
        files = " ".join(str(f) for f in sorted(data.rglob("*")) if f.is_file())
        mib = max(1, dir_bytes(data) >> 20)
        runs = {
            "cat": dict(cmd=f"cat {files} > /dev/null", shell=True),
            "torch": dict(cmd=[PY, "-c", "import torch"]),
            "dd": dict(cmd=durable_writes(out, 1, mib, direct=False), shell=True),
            "dd direct": dict(cmd=durable_writes(out, 1, mib, direct=True), shell=True),
            "accumulate": dict(cmd=[EMA, "accumulate", str(data), "--decay", "0.999", "--out", str(out), "--quiet",
                                    "--restart"]),
        }
        results = measure_in_turn(runs, out, repeat)
        shutil.rmtree(data, ignore_errors=True)
        acc = results["accumulate"]
        floor = sum(results[name].wall_median for name in ("cat", "torch")) + write_floor(results, "dd", "dd direct")[0]
        gib = mib / 1024
        per_gib.append(acc.wall_median / gib)
        points.append((gib, acc.wall_median))
        floor_points.append((gib, floor))
        rss.append(acc.rss_median)
        rows.append((f"{gib:.2f}", f"{acc.wall_median:.2f}", f"{acc.wall_median / gib:.2f}", f"{floor:.2f}",
                     f"{acc.wall_median / floor:.2f}", f"{acc.rss_median:.0f}"))
    print("\n### Growth with checkpoint size (accumulate, one checkpoint into a fresh EMA)\n")
    print(table(rows, ("GiB", "accumulate s", "s per GiB", "floor s (cat + import torch + faster dd)", "× floor",
                       "peak RSS MiB")))
    fixed, slope, worst = linear_fit(points)
    print(f"\n- linear fit: {fixed:.2f} s + {slope:.2f} s per GiB; the furthest point is {worst:.1%} from it")
    fixed, slope, worst = linear_fit(floor_points)
    print(f"- the floor's own linear fit, for scale: {fixed:.2f} s + {slope:.2f} s per GiB; its furthest point is "
          f"{worst:.1%} from it")
    print(f"- seconds per GiB: spread {max(per_gib) / min(per_gib) - 1:.1%} (largest / smallest - 1; the fixed "
          "cost, starting torch, weighs most on the smallest)")
    print(f"- peak RSS: spread {max(rss) / min(rss) - 1:.1%}")


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares ``time = fixed + slope · size``, and the largest relative distance of a point from it."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx if sxx else 0.0
    fixed = mean_y - slope * mean_x
    worst = max(abs(y - (fixed + slope * x)) / (fixed + slope * x) for x, y in points)
    return fixed, slope, worst


def tensors_case(root: Path, count: int, repeat: int) -> None:
    data = root / f"many-{count // 1000}k"
    _many_tensors(data, count)
    ckpt = data / "step_100"
    out = root / "bench-growth-many"
    acc = Measurement("accumulate", [], [])
    start = Measurement("import torch", [], [])
    loads = []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        wall, peak = run_timed([EMA, "accumulate", str(ckpt), "--decay", "0.999", "--out", str(out), "--quiet",
                                "--restart"])
        acc.wall.append(wall)
        acc.rss_mib.append(peak)
        wall, peak = run_timed([PY, "-c", "import torch"])
        start.wall.append(wall)
        start.rss_mib.append(peak)
        proc = subprocess.run([PY, "-c", _DCP_LOAD, str(ckpt)], capture_output=True, text=True, check=True)
        unpickled, loaded, _count = proc.stdout.split()
        loads.append((float(unpickled), float(loaded)))
    shutil.rmtree(out, ignore_errors=True)
    unpickle = sorted(u for u, _ in loads)[len(loads) // 2]
    load = sorted(v for _, v in loads)[len(loads) // 2]
    ours = acc.wall_median - start.wall_median
    print(f"\n### {count:,} tensors of 4 KiB (one checkpoint, {dir_bytes(ckpt) / 2**20:.0f} MiB)\n")
    print(table([
        ("accumulate (less starting torch)", f"{ours:.2f}", f"{ours / count * 1e6:.1f}", f"{acc.rss_median:.0f}"),
        ("dcp.load into the same state dict", f"{load:.2f}", f"{load / count * 1e6:.1f}", ""),
        ("unpickling .metadata alone", f"{unpickle:.2f}", f"{unpickle / count * 1e6:.1f}", ""),
    ], ("", "s", "µs per tensor", "peak RSS MiB")))
    print(f"\n- accumulate per tensor = {ours / load:.2f}× dcp.load's (reading, folding and writing each "
          "tensor, against loading it)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=Path("bench-data"))
    parser.add_argument("--sizes", default="1,2,4,8", help="GiB, comma-separated")
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"Machine: {machine_description()}; medians of {args.repeat} runs")
    if args.sizes:
        size_case(args.root, [float(s) for s in args.sizes.split(",")], args.repeat)
    if args.tensors:
        tensors_case(args.root, args.tensors, args.repeat)


if __name__ == "__main__":
    main()
