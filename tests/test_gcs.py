"""Checkpoints on Google Cloud Storage (fake-gcs-server, through gcsfs): every scenario of
``tests/object_store_scenarios.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("gcsfs")

from tests.object_store_scenarios import *  # noqa: F403 (the scenarios, collected here)
from tests.object_store_scenarios import Emulator, running_store


@pytest.fixture(scope="module")
def store() -> Iterator[Emulator]:
    yield from running_store("gs")
