"""Shared benchmark plumbing: run a command under /usr/bin/time -v, parse wall time and peak RSS."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
EMA = str(Path(sys.executable).with_name("ema-ckpt"))
BASELINE = os.environ.get("EMA_CKPT_BENCH_BASELINE")
"""A source tree of another ema-ckpt version: each ema-ckpt row is run again with it, side by side."""


def with_baseline(runs: dict[str, dict]) -> dict[str, dict]:
    """``runs`` plus, when ``EMA_CKPT_BENCH_BASELINE`` names a source tree, each ema-ckpt run
    again with that tree first on ``PYTHONPATH`` (row "… [baseline]")."""
    if not BASELINE:
        return runs
    out = dict(runs)
    for name, spec in runs.items():
        cmd = spec["cmd"]
        if isinstance(cmd, list) and cmd and cmd[0] == EMA:
            env = {**(spec.get("env") or {}), "PYTHONPATH": BASELINE}
            out[f"{name} [baseline]"] = {**spec, "env": env}
    return out


@dataclass
class Measurement:
    name: str
    wall: list[float]
    rss_mib: list[float]

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)

    @property
    def rss_median(self) -> float:
        return statistics.median(self.rss_mib)


def run_timed(cmd: list[str] | str, *, shell: bool = False, env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one run, measured by GNU time.

    Dirty pages a previous run left are written back first (not timed), so no run pays for
    another's writes.
    """
    os.sync()
    full = ["/usr/bin/time", "-v", *(["bash", "-c", cmd] if shell else cmd)]
    proc = subprocess.run(full, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024
    wall_text = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr).group(1)
    parts = [float(p) for p in wall_text.split(":")]
    wall = sum(p * 60**i for i, p in enumerate(reversed(parts)))
    return wall, rss


def in_turn(runs: dict[str, dict], repeat: int) -> list[tuple[str, dict]]:
    """The runs of repeat ``repeat``: in order, then reversed on every other repeat, so no
    row always follows the same one (page-cache and write-back state)."""
    items = list(runs.items())
    return items if repeat % 2 == 0 else items[::-1]


def baseline_ratios(results: dict[str, Measurement]) -> str:
    """Lines "name: time and peak RSS of this tree / the baseline's", for each ema-ckpt run."""
    lines = []
    for name, m in results.items():
        base = results.get(f"{name} [baseline]")
        if base is not None:
            lines.append(f"{name}: time {m.wall_median / base.wall_median:.2f}×, "
                         f"peak RSS {m.rss_median / base.rss_median:.2f}× the baseline's")
    return "\n".join(lines)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    python = sys.version.split()[0]
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {python}, torch {torch.__version__}"


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def durable_writes(out: Path, count: int, mib: int, *, direct: bool) -> str:
    """A shell command writing ``count`` files of ``mib`` MiB durably under ``out``, concurrently.

    ``direct``: past the page cache (``oflag=direct``, as ema-ckpt writes DCP outputs), else
    through it. A floor takes the faster of the two: the cheapest way this disk takes the bytes.
    """
    flag = " oflag=direct" if direct else ""
    return (f"mkdir -p {out} && " + " ".join(
        f"dd if=/dev/zero of={out}/dd{i}.bin bs=8M count={max(1, mib // 8)}{flag} conv=fsync status=none &"
        for i in range(count)) + " wait")


def write_floor(results: dict[str, Measurement], buffered: str, direct: str) -> tuple[float, str]:
    """The faster durable write of the two rows, and its name."""
    best = min((buffered, direct), key=lambda name: results[name].wall_median)
    return results[best].wall_median, best


def measure_in_turn(runs: dict[str, dict], out: Path, repeat: int) -> dict[str, Measurement]:
    """Run every row ``repeat`` times, interleaved (:func:`in_turn`), ``out`` removed before each
    run (not timed): the rows' wall times and peak RSS."""
    import shutil

    results = {name: Measurement(name, [], []) for name in runs}
    for r in range(repeat):
        for name, spec in in_turn(runs, r):
            shutil.rmtree(out, ignore_errors=True)
            wall, rss = run_timed(spec["cmd"], shell=spec.get("shell", False), env=spec.get("env"))
            results[name].wall.append(wall)
            results[name].rss_mib.append(rss)
    shutil.rmtree(out, ignore_errors=True)
    return results
