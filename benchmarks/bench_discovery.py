"""Finding checkpoints in a folder of many: the time ``discover`` takes over N DCP checkpoint
folders (their step from each name), and how many times a format's markers were looked at per
folder (each checkpoint is found, located and detected once).

Run it against another source tree with ``PYTHONPATH=that/tree`` for a side-by-side figure.

Usage: python benchmarks/bench_discovery.py [--checkpoints 2000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    from ema_ckpt.discovery import discover
    from ema_ckpt.formats import base

    root = Path(tempfile.mkdtemp(prefix="bench-discovery-"))
    try:
        dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(root / "step_1"))
        for i in range(2, args.checkpoints + 1):
            shutil.copytree(root / "step_1", root / f"step_{i}")
        detections = [0]
        for fmt in base.registered_formats().values():
            detect = fmt.detect

            def counted(path: object, detect: object = detect) -> bool:
                detections[0] += 1
                return detect(path)  # type: ignore[operator]

            object.__setattr__(fmt, "detect", counted)
        times = []
        for _ in range(args.repeat):
            detections[0] = 0
            started = time.perf_counter()
            found = discover([root])
            times.append(time.perf_counter() - started)
        assert len(found.checkpoints) == args.checkpoints
        print(f"discover over {args.checkpoints} checkpoint folders: median {statistics.median(times):.3f} s "
              f"of {args.repeat} (min {min(times):.3f} s); format detections per folder: "
              f"{detections[0] / args.checkpoints:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
