"""Checkpoints on S3 (moto's server, through s3fs): every scenario of
``tests/object_store_scenarios.py``. What only S3 has is in ``tests/test_object_storage.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from tests.object_store_scenarios import *  # noqa: F403 (the scenarios, collected here)
from tests.object_store_scenarios import Emulator, running_store


@pytest.fixture(scope="module")
def store() -> Iterator[Emulator]:
    yield from running_store("s3")
