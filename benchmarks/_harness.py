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
    """(wall seconds, peak RSS MiB) of one run, measured by GNU time."""
    full = ["/usr/bin/time", "-v", *(["bash", "-c", cmd] if shell else cmd)]
    proc = subprocess.run(full, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024
    wall_text = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr).group(1)
    parts = [float(p) for p in wall_text.split(":")]
    wall = sum(p * 60**i for i, p in enumerate(reversed(parts)))
    return wall, rss


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

    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {sys.version.split()[0]}, torch {torch.__version__}"


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
