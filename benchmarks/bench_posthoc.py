"""Post-hoc sweeps against their own floors, side by side in one run.

Two cases (``--case raw``, ``--case edm2``, or both):

- **raw**: 4 × 1 GiB fp32 DCP checkpoints, ``posthoc`` with K = 1 and K = 4 σ_rel values.
- **edm2**: 8 raw checkpoints of 256 MiB → ``accumulate --sigma-rel 0.05 --sigma-rel 0.10
  --snapshot-every`` → 16 power-EMA snapshots (setup, not timed); then ``posthoc`` from those
  snapshots with K = 8 σ_rel values (0.04 … 0.20) and with K = 1.

The floor of a run reads every input once (``cat``), starts torch, and writes its K outputs
durably (``dd conv=fsync``, one file per output, written concurrently: this disk takes several
streams faster than one after another), through the page cache or past it (``oflag=direct``),
whichever is faster. Each run is reported as a ratio of its own floor;
medians of ``--repeat`` runs, hot page cache, rows interleaved.

Usage: python benchmarks/bench_posthoc.py [--case raw|edm2|all] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
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
    durable_writes,
    machine_description,
    measure_in_turn,
    table,
    with_baseline,
    write_floor,
)

EDM2_SIGMAS = "0.04,0.0629,0.0857,0.1086,0.1314,0.1543,0.1771,0.20"  # K = 8, evenly spaced


def _files(folders: list[Path]) -> str:
    return " ".join(str(f) for c in folders for f in sorted(c.rglob("*")) if f.is_file())


def _write_rows(out: Path, counts: tuple[int, ...], mib: int) -> dict[str, dict]:
    rows = {}
    for count in counts:
        for direct in (False, True):
            rows[_write_name(count, direct)] = dict(cmd=durable_writes(out, count, mib, direct=direct), shell=True)
    return rows


def _write_name(count: int, direct: bool) -> str:
    return f"write {count} output{'s' if count > 1 else ''} durably{' (O_DIRECT)' if direct else ''}"


def _measure(runs: dict[str, dict], out: Path, repeat: int) -> dict[str, Measurement]:
    return measure_in_turn(with_baseline(runs), out, repeat)


def _report(title: str, results: dict[str, Measurement], floors: dict[str, tuple[str, ...]],
            pair: tuple[str, str] | None = None) -> None:
    """``floors``: ema-ckpt row → the rows whose medians add up to its floor (a row name that is
    a write count, ``"write 4"``, stands for the faster of its buffered and direct rows)."""
    print(f"\n### {title}\n")
    print(table([(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()],
                ("command", "wall s", "peak RSS MiB")))
    print()
    for name, counted in floors.items():
        parts = tuple(write_floor(results, _write_name(int(p.split()[1]), False),
                                  _write_name(int(p.split()[1]), True))[1] if p.startswith("write ") else p
                      for p in counted)
        floor = sum(results[p].wall_median for p in parts)
        print(f"- {name}: {results[name].wall_median:.2f} s against a floor of {floor:.2f} s "
              f"({' + '.join(parts)}) = **{results[name].wall_median / floor:.2f}× its floor**")
    if pair is not None:
        many, one = results[pair[0]], results[pair[1]]
        print(f"- {pair[0]} / {pair[1]}: {many.wall_median / one.wall_median:.2f}× the time")
    if baseline_ratios(results):
        print("\n" + baseline_ratios(results))


def raw_case(data: Path, repeat: int) -> None:
    subprocess.run([PY, str(Path(__file__).parent / "make_dcp_sequence.py"), str(data), "--count", "4"],
                   check=True, stdout=subprocess.DEVNULL)
    out = data.parent / "bench-posthoc"
    ckpts = sorted(p for p in data.iterdir() if p.name.startswith("step_"))
    mib = max(1, dir_bytes(ckpts[-1]) >> 20)  # an fp32 output is the size of an fp32 input
    one, four = "posthoc K=1 (σ_rel 0.10)", "posthoc K=4 (σ_rel 0.05,0.10,0.15,0.20)"
    runs = {
        "cat inputs > /dev/null": dict(cmd=f"cat {_files(ckpts)} > /dev/null", shell=True),
        "python -c 'import torch'": dict(cmd=[PY, "-c", "import torch"]),
        **_write_rows(out, (1, 4), mib),
        one: dict(cmd=[EMA, "posthoc", str(data), "--sigma-rel", "0.10", "--out", str(out), "--quiet"]),
        four: dict(cmd=[EMA, "posthoc", str(data), "--sigma-rel", "0.05,0.10,0.15,0.20", "--out", str(out),
                        "--quiet"]),
    }
    results = _measure(runs, out, repeat)
    base = ("cat inputs > /dev/null", "python -c 'import torch'")
    _report("Raw sweep: 4 × 1 GiB fp32 DCP checkpoints", results,
            {one: (*base, "write 1"), four: (*base, "write 4")}, (four, one))
    _with_compute(results, {one: (1, "write 1"), four: (4, "write 4")}, base, len(ckpts), mib, repeat)


def _with_compute(results: dict[str, Measurement], runs: dict[str, tuple[int, str]], base: tuple[str, ...],
                  inputs: int, mib: int, repeat: int) -> dict[str, tuple[float, float]]:
    """Each run against its floor plus the arithmetic its outputs need, timed alone
    (``sweep_compute_floor.py``: the block products and the CRC-32 of every output byte).

    Returns each run's (durable writes, arithmetic) in seconds."""
    from sweep_compute_floor import compute_floor

    parts = {}
    for name, (outputs, write) in runs.items():
        count = int(write.split()[1])
        writes = write_floor(results, _write_name(count, False), _write_name(count, True))[1]
        floor = sum(results[p].wall_median for p in (*base, writes))
        arithmetic = statistics.median(compute_floor(inputs, outputs, mib << 20) for _ in range(repeat))
        parts[name] = (results[writes].wall_median, arithmetic)
        print(f"- {name}: the arithmetic alone {arithmetic:.2f} s; against floor + arithmetic "
              f"({floor + arithmetic:.2f} s) **{results[name].wall_median / (floor + arithmetic):.2f}×**")
    return parts


def _least_ratio(results: dict[str, Measurement], parts: dict[str, tuple[float, float]], many: str,
                 one: str) -> None:
    """The least ``many`` / ``one`` could be: ``one``'s time plus the writes and the arithmetic
    that ``many`` does beyond it, if none of that overlapped."""
    extra = sum(parts[many]) - sum(parts[one])
    least = (results[one].wall_median + extra) / results[one].wall_median
    print(f"- {many} / {one}: {results[many].wall_median / results[one].wall_median:.2f}× the time; its extra "
          f"writes and arithmetic alone ({extra:.2f} s) make it at least {least:.2f}× without overlap")


def edm2_case(root: Path, repeat: int) -> None:
    raw = root / "dcp-256m-x8"
    subprocess.run([PY, str(Path(__file__).parent / "make_dcp_sequence.py"), str(raw), "--size-gib", "0.25",
                    "--count", "8"], check=True, stdout=subprocess.DEVNULL)
    power = root / "power-ema-256m"
    if not (power / "ema-ckpt.json").exists():
        subprocess.run([EMA, "accumulate", str(raw), "--sigma-rel", "0.05,0.10", "--snapshot-every", "1000",
                        "--out", str(power), "--quiet", "--restart"], check=True)
    snapshot_root = power / "snapshots"
    snapshots = sorted(p for p in snapshot_root.rglob(".metadata"))
    if len(snapshots) != 16:
        raise SystemExit(f"{snapshot_root}: expected 16 snapshots, found {len(snapshots)}")
    folders = [p.parent for p in snapshots]
    mib = max(1, dir_bytes(folders[0]) >> 20)
    out = root / "bench-posthoc-edm2"
    one, eight = "posthoc K=1 (σ_rel 0.10)", "posthoc K=8 (σ_rel 0.04 … 0.20)"
    runs = {
        "cat snapshots > /dev/null": dict(cmd=f"cat {_files(folders)} > /dev/null", shell=True),
        "python -c 'import torch'": dict(cmd=[PY, "-c", "import torch"]),
        **_write_rows(out, (1, 8), mib),
        one: dict(cmd=[EMA, "posthoc", str(snapshot_root), "--sigma-rel", "0.10", "--out", str(out), "--quiet"]),
        eight: dict(cmd=[EMA, "posthoc", str(snapshot_root), "--sigma-rel", EDM2_SIGMAS, "--out", str(out),
                         "--quiet"]),
    }
    results = _measure(runs, out, repeat)
    base = ("cat snapshots > /dev/null", "python -c 'import torch'")
    _report("EDM2-shaped sweep: 16 power-EMA snapshots of 256 MiB (σ_rel 0.05 and 0.10, 8 steps)", results,
            {one: (*base, "write 1"), eight: (*base, "write 8")}, (eight, one))
    parts = _with_compute(results, {one: (1, "write 1"), eight: (8, "write 8")}, base, len(folders), mib, repeat)
    _least_ratio(results, parts, eight, one)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("raw", "edm2", "all"), default="all")
    parser.add_argument("--data", type=Path, default=Path("bench-data/dcp-1g"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"Machine: {machine_description()}; medians of {args.repeat} runs, hot page cache")
    if args.case in ("raw", "all"):
        raw_case(args.data, args.repeat)
    if args.case in ("edm2", "all"):
        edm2_case(args.data.parent, args.repeat)


if __name__ == "__main__":
    main()
