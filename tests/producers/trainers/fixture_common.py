"""What both trainer-fixture producers share."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""DeepSpeed copies its own converter scripts into every save folder; they are code, not data,
and are not kept in the fixtures (nothing reads them)."""


def drop_deepspeed_scripts(set_dir: Path) -> list[str]:
    """Remove DeepSpeed's converter-script copies from a set; the note that says so."""
    removed = [p for name in DEEPSPEED_SCRIPTS for p in set_dir.rglob(name)]
    for path in removed:
        path.unlink()
    if not removed:
        return []
    return [f"removed {len(removed)} copies of DeepSpeed's {'/'.join(DEEPSPEED_SCRIPTS)} (code, not data)"]


TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip
"""An outer launcher's variables, kept out of the producers' own torchrun launches."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_producer(description: str, sets: Sequence[str], workers: Mapping[str, Callable[[str, Path], None]],
                 produce: Callable[[str, Path], Path], argv: list[str] | None = None) -> int:
    """A producer script's command line: ``--set all|a,b --out DIR``, each set produced in turn
    (a failure reported and the others produced), or one ``--worker`` run (under torchrun)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--set", default="all", help=f"'all' or comma-separated names of: {', '.join(sets)}")
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/trainers"))
    parser.add_argument("--worker", choices=sorted(workers), help=argparse.SUPPRESS)
    parser.add_argument("--set-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        workers[args.worker](args.set, args.set_dir)
        return 0
    names = list(sets) if args.set == "all" else [s.strip() for s in args.set.split(",") if s.strip()]
    unknown = [n for n in names if n not in sets]
    if unknown:
        parser.error(f"unknown set(s) {unknown}; choose from {list(sets)} or 'all'")
    failures = []
    for name in names:
        print(f"[{name}] producing ...", flush=True)
        try:
            set_dir = produce(name, args.out)
        except Exception as exc:  # report and go on with the other sets
            failures.append(name)
            print(f"[{name}] FAILED: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"[{name}] done: {set_dir}", flush=True)
    if failures:
        print(f"failed sets: {failures}", file=sys.stderr)
        return 1
    return 0


def package_versions(names: Sequence[str]) -> dict[str, str | None]:
    """Python's, torch's and each named distribution's version (None when not installed), safetensors'
    included: what a set's ``producer.json`` records."""
    import importlib.metadata as md
    import platform

    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in [*names, "safetensors"]:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out
