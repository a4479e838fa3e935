"""Checks run in a child process, so the objects they build never add to a run's peak memory.

An output's own loader holds hundreds of bytes per tensor while it parses (more than the run
needs at 200,000 tensors). The child is this interpreter in isolated mode (``-I``: no working
directory on its path, no ``PYTHON*`` variables), with this copy of ema-ckpt first on its path.

Example:
    >>> run_apart("import sys; print('no'); sys.exit(1)")
    'no'
    >>> run_apart("pass") is None
    True
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
_TIMEOUT_S = 600


def run_apart(script: str, *args: str) -> str | None:
    """Run ``script`` (Python source; ``sys.argv[1:]`` is ``args``) in a child process; None when
    it exits 0, else the first line it printed (or its last line on stderr).

    Raises:
        OSError: the child could not be started, or ran past 10 minutes (``TimeoutError``).
    """
    try:
        child = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {_ROOT!r})\n{script}",
                                *args], capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"no answer within {_TIMEOUT_S} s") from None
    if child.returncode == 0:
        return None
    printed = child.stdout.strip().splitlines()
    return printed[0] if printed else (child.stderr.strip().splitlines() or ["no output"])[-1]
