"""Running a script under ``torchrun`` on this machine: one launcher for every test.

Example::

    proc = torchrun([str(script), "--out", str(out)], nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID",
)  # fmt: skip
"""An outer launcher's rendezvous variables: never leaked into a launch of our own."""

RETRY_MARKERS = (
    "address already in use", "eaddrinuse", "errno 98",
    "terminate called without an active exception",
)  # fmt: skip
"""A port taken between picking and binding it; gloo's rare abort at process exit on a loaded machine.
Either is retried once; any other failure is the test's to report."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, one thread per rank, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def torchrun(
    target: Sequence[str],
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
    before_retry: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node NPROC TARGET`` on a free loopback port, its output captured.

    Retried once (after ``before_retry``, which clears a failed attempt's outputs) when the output
    shows one of ``RETRY_MARKERS``. Returns the last attempt; the caller checks its exit code.
    """
    for attempt in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *target,
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env or launcher_env(), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
        output = (proc.stdout + proc.stderr).lower()
        if proc.returncode == 0 or attempt or not any(marker in output for marker in RETRY_MARKERS):
            return proc
        if before_retry is not None:
            before_retry()
    raise AssertionError("unreachable")
