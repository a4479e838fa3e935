"""Shared fixtures: real FSDP checkpoint sequences, produced once per test session."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from ema_ckpt.storage.object_publish import STAGING_ENV
from tests.ds_fixtures import ds_run, zero_to_fp32  # noqa: F401  (session fixtures)
from tests.producers import sequences
from tests.shared_dirs import built_once

STEPS = sequences.FSDP_STEPS

FAST_FILES = frozenset({
    # in-process: pure layers, fakes, readers and writers on in-process dcp.save/torch.save files
    "test_planner.py", "test_schedules.py", "test_layout.py", "test_crc.py", "test_read_checks.py",
    "test_engine.py", "test_jobs.py", "test_errors.py", "test_exit_codes.py", "test_structure.py",
    "test_torch_records.py", "test_unpickler.py", "test_direct_io.py", "test_dcp_reader.py",
    "test_hf_safetensors.py", "test_key_names.py", "test_hostile_keys.py", "test_single_file_reading.py",
    "test_discovery.py", "test_select.py", "test_merge_weights.py", "test_moe.py",
    "test_out_paths.py", "test_verify_diff.py", "test_trust.py", "test_output_contract.py",
    # the boundaries, once each: both storage destinations (a real S3 server on loopback), a --workers 2
    # byte check (test_damaged_records), a SIGKILL (test_crash), the CLI in-process and as a subprocess
    "test_storage.py", "test_damaged_records.py", "test_crash.py", "test_cli.py", "test_cli_errors.py",
    "test_locks.py", "test_liveness.py",
    # every output kind's bytes against their committed digests; the package's docstring examples
    "test_golden_outputs.py", "test_doctests.py",
})
"""The fast tier (``make check``): every module and boundary once, in a few minutes on 2 cores.
``make test`` runs everything."""


FAST_EMULATOR = ("test_storage.py", "s3")
"""The one object-store emulator the fast tier starts: S3 (moto), for the storage conformance tests."""


SLOWEST_FILES = (
    "test_screens.py", "test_reliability.py", "test_workers.py", "test_screens_tables.py",
    "test_object_storage.py", "test_callback_strategies.py", "test_gpu_check.py", "test_multinode.py",
    "test_demo.py", "test_examples.py", "test_consolidate.py", "test_gcs.py", "test_callback_transformers.py",
    "test_s3.py", "test_reader_contract.py", "test_quickstart.py", "test_azure.py", "test_deepspeed.py",
    "test_changing_layouts.py", "test_callback_lightning.py", "test_single_files.py", "test_accumulate.py",
)
"""The test files that take longest in ``make test``, longest first (each 1.5-9 % of the suite's time).
They run first, the others after them in their usual order: pytest-xdist hands each worker a whole
file at a time in this order (``--no-loadscope-reorder``), so the run ends on short files, not with
one worker busy on a long one while the other has nothing left."""


def _emulator(item: pytest.Item) -> str | None:
    """The object store a test runs against (an emulator it starts), if any."""
    callspec = getattr(item, "callspec", None)
    place = callspec.params.get("place") if callspec is not None else None
    if place in ("s3", "gs", "az"):
        return str(place)
    return "s3" if "s3" in getattr(item, "fixturenames", ()) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the fast tier's tests ``fast`` (``pytest -m fast``): those of :data:`FAST_FILES` that
    start no emulator but :data:`FAST_EMULATOR`; put the files of :data:`SLOWEST_FILES` first."""
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    for item in items:
        store = _emulator(item)
        if item.path.name in FAST_FILES and (store is None or (item.path.name, store) == FAST_EMULATOR):
            item.add_marker(pytest.mark.fast)


def pytest_configure(config: pytest.Config) -> None:
    """Object-store outputs stage under one temporary directory of this session
    (``EMA_CKPT_STAGING_DIR``), removed when the session ends: a command a test kills mid-upload
    leaves nothing in the system's temporary directory. The controller makes it; xdist workers
    and every process the tests start inherit the variable."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get(STAGING_ENV):
        return
    staging = tempfile.mkdtemp(prefix="ema-ckpt-staging-")
    os.environ[STAGING_ENV] = staging
    config.add_cleanup(lambda: (os.environ.pop(STAGING_ENV, None), shutil.rmtree(staging, ignore_errors=True)))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Write the bytecode of ema-ckpt and of the tests once, before any test starts a process.

    Where ``PYTHONDONTWRITEBYTECODE`` is set (as in some containers) and the tree is a fresh clone,
    every process the tests start (CLIs, torchrun workers, spawned workers: hundreds) would
    otherwise compile the same sources again, about 0.3 s each.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller (or a run without xdist) has done it
    import compileall

    root = Path(__file__).resolve().parents[1]
    for tree in ("ema_ckpt", "tests", "benchmarks", "examples"):
        if (root / tree).is_dir():
            compileall.compile_dir(str(root / tree), quiet=1)


@pytest.fixture(scope="session")
def fsdp_sequence(tmp_path_factory) -> Callable[..., list[Path]]:
    """``fsdp_sequence(kind, world_size, dtype="float32", with_optim=False)`` → checkpoint dirs.

    Real FSDP1/FSDP2 training under torchrun + gloo on CPU, saving DCP checkpoints at the
    irregular steps in ``STEPS``: the copy committed in ``tests/fixtures/sequences`` (written by
    ``tests/producers/sequences.py``), else produced once per session. Inputs only: tests write
    their outputs elsewhere.
    """
    cache: dict[tuple, list[Path]] = {}

    def make(kind: str, world_size: int, dtype: str = "float32", with_optim: bool = False) -> list[Path]:
        key = (kind, world_size, dtype, with_optim)
        if key not in cache:
            name = sequences.fsdp_name(*key)
            cache[key] = sequences.committed(name) or built_once(
                tmp_path_factory, name, lambda out: sequences.build_fsdp(out, *key))
        return cache[key]

    return make
