"""Peak memory of ``select`` against an evaluation that prints a few hundred MB before its score.

The evaluation's output is streamed to the candidate's log and only a bounded tail is kept in
memory, so ``select``'s peak RSS should not grow with what the command prints. Compares the
same selection with an evaluation printing one line.

    python benchmarks/bench_select_output.py [--mib 300]

Peak RSS: GNU ``/usr/bin/time -v`` when present (the largest process of the run: ``select``
itself; the evaluations are small), else ``resource.getrusage(RUSAGE_CHILDREN)``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

PRINTER = """\
import sys
line = b"x" * 1023 + b"\\n"
out = sys.stdout.buffer
for _ in range(int(sys.argv[1]) * 1024):
    out.write(line)
out.flush()
print(0.25)
"""


def _checkpoints(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for step in (100, 200, 300, 400):
        (root / f"step_{step}").mkdir(parents=True)
        weights = {"w": rng.standard_normal(1 << 16).astype(np.float32)}
        save_file(weights, str(root / f"step_{step}" / "model.safetensors"))
    return root


def _run(args: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one command."""
    start = time.monotonic()
    if shutil.which("time") and Path("/usr/bin/time").exists():
        proc = subprocess.run(["/usr/bin/time", "-v", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        assert found is not None
        return time.monotonic() - start, int(found.group(1)) / 1024
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far
    if peak <= before:
        print("note: getrusage's peak is an earlier child's; the figure is an upper bound", file=sys.stderr)
    return time.monotonic() - start, peak / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=300, help="MiB the noisy evaluation prints (default 300)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpts = _checkpoints(root / "ckpts")
        printer = root / "printer.py"
        printer.write_text(PRINTER)
        rows = []
        for label, mib in (("prints one line", 0), (f"prints {options.mib} MiB", options.mib)):
            out = root / f"best-{mib}"
            args = [sys.executable, "-m", "ema_ckpt", "select", str(ckpts), "--last", "2",
                    "--eval", f"{sys.executable} {printer} {mib} # {{path}}", "--out", str(out)]
            wall, rss = _run(args)
            log = out.parent / f"{out.name}.select" / "logs" / "last_2.log"
            rows.append((label, wall, rss, log.stat().st_size / 2**20))
        print(f"| evaluation | wall s | peak RSS MiB | log MiB |   (Python {sys.version.split()[0]}, "
              f"{os.cpu_count()} cores)")
        print("|---|---|---|---|")
        for label, wall, rss, log_mib in rows:
            print(f"| {label} | {wall:.1f} | {rss:.0f} | {log_mib:.0f} |")


if __name__ == "__main__":
    main()
