"""Shared fixtures: real FSDP checkpoint sequences, produced once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.ds_fixtures import ds_run, zero_to_fp32  # noqa: F401  (session fixtures)

STEPS = [3, 7, 20, 21, 30]


@pytest.fixture(scope="session")
def fsdp_sequence(tmp_path_factory) -> Callable[..., list[Path]]:
    """``fsdp_sequence(kind, world_size, dtype="float32", with_optim=False)`` → checkpoint dirs.

    Real FSDP1/FSDP2 training under torchrun + gloo on CPU, saving DCP checkpoints at the
    irregular steps in ``STEPS``; each configuration is produced once per session.
    """
    from tests.producers.launch import make_fsdp_sequence

    cache: dict[tuple, list[Path]] = {}

    def make(kind: str, world_size: int, dtype: str = "float32", with_optim: bool = False) -> list[Path]:
        key = (kind, world_size, dtype, with_optim)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{kind}-w{world_size}-{dtype}{'-optim' if with_optim else ''}")
            cache[key] = make_fsdp_sequence(
                out, kind=kind, world_size=world_size, steps=STEPS, dtype=dtype, with_optim=with_optim
            )
        return cache[key]

    return make
