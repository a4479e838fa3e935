"""Launch ``fsdp_train.py`` under torchrun (gloo, CPU) to make real FSDP checkpoint sequences."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

TRAIN_SCRIPT = Path(__file__).resolve().parent / "fsdp_train.py"

_ADDR_IN_USE_MARKERS = ("address already in use", "eaddrinuse", "errno 98")
# Rare gloo teardown abort seen on a loaded 2-core machine after all checkpoints were saved.
_TEARDOWN_ABORT_MARKERS = ("terminate called without an active exception",)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def make_fsdp_sequence(
    out: Path,
    *,
    kind: str,
    world_size: int,
    steps: list[int],
    dtype: str = "float32",
    with_optim: bool = False,
    name_format: str = "step_{step}",
    seed: int = 0,
    timeout: float = 300,
    optim: str = "adamw",
    rank_local_metadata: bool = False,
) -> list[Path]:
    """Train a tiny model with FSDP1/FSDP2 on ``world_size`` CPU ranks and save DCP
    checkpoints after each optimizer step in ``steps`` into ``out / name_format.format(step=N)``.

    Returns the checkpoint directories sorted by step. Raises RuntimeError (with the
    tail of the captured output) if torchrun fails or a checkpoint is missing.
    """
    if kind not in ("fsdp1", "fsdp2"):
        raise ValueError(f"kind must be 'fsdp1' or 'fsdp2', not {kind!r}")
    if not steps:
        raise ValueError("steps must not be empty")
    out = Path(out)
    uniq = sorted({int(s) for s in steps})
    script_args = [
        str(TRAIN_SCRIPT),
        "--out", str(out),
        "--kind", kind,
        "--steps", ",".join(map(str, uniq)),
        "--dtype", dtype,
        "--name-format", name_format,
        "--seed", str(seed),
        "--optim", optim,
    ]  # fmt: skip
    if with_optim:
        script_args.append("--with-optim")
    if rank_local_metadata:
        script_args.append("--rank-local-metadata")

    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore")
    # Don't let an outer torchrun's rendezvous variables leak into this launch.
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):  # fmt: skip
        env.pop(var, None)

    for attempt in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc-per-node", str(world_size),
            "--nnodes", "1",
            "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()),
            *script_args,
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise RuntimeError(f"torchrun timed out after {timeout}s: {' '.join(cmd)}\n{_tail(err)}") from e
        if proc.returncode == 0:
            break
        combined = proc.stdout + proc.stderr
        if attempt == 0 and any(m in combined.lower() for m in _ADDR_IN_USE_MARKERS):
            continue  # port raced away between free_port() and torchrun's bind: retry once
        if attempt == 0 and any(m in combined for m in _TEARDOWN_ABORT_MARKERS):
            continue  # known rare shutdown flake: rerun the whole sequence once
        raise RuntimeError(
            f"torchrun failed with exit code {proc.returncode}: {' '.join(cmd)}\n"
            f"--- stderr tail ---\n{_tail(proc.stderr)}\n--- stdout tail ---\n{_tail(proc.stdout, 2000)}"
        )

    dirs = [out / name_format.format(step=s) for s in uniq]
    meta_name = "__0.metadata" if rank_local_metadata else ".metadata"
    missing = [str(d) for d in dirs if not (d / meta_name).is_file()]
    if missing:
        raise RuntimeError(
            f"torchrun succeeded but checkpoints are missing: {missing}\n{_tail(proc.stdout, 2000)}"
        )
    return dirs
