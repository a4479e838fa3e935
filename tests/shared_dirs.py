"""Directories that the tests build once per session and share between pytest-xdist workers.

A real producer's run (torchrun + FSDP or DeepSpeed) takes 10-40 s; each worker process would
otherwise make its own copy of every fixture its test files ask for. The first worker to ask
builds it under a file lock; the others wait for that build and reuse it. The directories are
inputs: tests read them and write their outputs elsewhere.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's temporary root seen by every worker (each xdist worker's own is
    ``<root>/popen-gwN``; without xdist it is the session's own)."""
    base = tmp_path_factory.getbasetemp()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return base.parent if worker and base.name == f"popen-{worker}" else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str,
               build: Callable[[Path], list[Path]]) -> list[Path]:
    """``build(directory)`` run once per session for ``name``; returns what it returned.

    ``build`` fills the empty ``directory`` and returns paths inside it, which every later caller
    (in this worker or another) gets back. A build that failed fails every later caller at once
    with its error, rather than running again in turn. Builds must not nest (two workers could
    wait on each other's locks).

    >>> built_once(factory, "fsdp2-w2", lambda d: make_fsdp_sequence(d, ...))  # doctest: +SKIP
    """
    root = shared_root(tmp_path_factory) / "shared-fixtures"
    root.mkdir(exist_ok=True)
    directory, done, failed = root / name, root / f"{name}.done.json", root / f"{name}.failed"
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if failed.exists():
            raise RuntimeError(f"building the fixture {name} failed earlier in this session:\n{failed.read_text()}")
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            try:
                paths = build(directory)
            except Exception as err:
                failed.write_text(f"{type(err).__name__}: {err}"[-5000:])
                raise
            partial = done.with_suffix(".partial")
            partial.write_text(json.dumps([str(Path(p).relative_to(directory)) for p in paths]))
            os.replace(partial, done)
        return [directory / rel for rel in json.loads(done.read_text())]
