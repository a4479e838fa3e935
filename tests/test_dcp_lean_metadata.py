"""Large DCP ``.metadata`` is read by the pure-Python unpickler with a lean memo
(:mod:`ema_ckpt.pickles.memo`): every trainer's metadata must read the same through it, and
hostile metadata must be refused the same way."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from ema_ckpt.errors import CheckpointFormatError, UnsafePickleError
from ema_ckpt.formats.dcp import metadata_unpickle
from ema_ckpt.formats.dcp.reader import DcpReader

FIXTURES = Path(__file__).parent / "fixtures" / "trainers"
DCP_DIRS = sorted({p.parent for p in FIXTURES.rglob(".metadata")})


def _index(path: Path) -> dict:
    reader = DcpReader(path)
    try:
        return {
            "stored": dict(reader.stored()),
            "chunks": {key: list(reader.chunks(key)) for key in reader.stored()},
            "planner_data": dict(reader.planner_data),
            "non_tensor_keys": list(reader.non_tensor_keys),
            "records": reader.stored_records(),
            "info": reader.info(),
        }
    finally:
        reader.close()


@pytest.fixture
def lean(monkeypatch):
    """Every metadata through the lean unpickler, however short."""
    monkeypatch.setattr(metadata_unpickle, "_LEAN_ABOVE", 0)


@pytest.mark.fast
def test_every_trainers_metadata_reads_the_same_through_the_lean_unpickler(monkeypatch):
    assert len(DCP_DIRS) >= 10
    for path in DCP_DIRS:
        fast = _index(path)
        with monkeypatch.context() as patch:
            patch.setattr(metadata_unpickle, "_LEAN_ABOVE", 0)
            assert _index(path) == fast, path


@pytest.mark.fast
def test_the_lean_unpickler_refuses_what_the_c_one_refuses(lean):
    with pytest.raises(UnsafePickleError, match=r"builtins\.print"):
        metadata_unpickle.load_dcp_metadata_bytes(pickle.dumps(print), "x")
    real = (DCP_DIRS[0] / ".metadata").read_bytes()
    for cut in (len(real) // 2, len(real) - 1):
        with pytest.raises(CheckpointFormatError, match="not a readable DCP metadata pickle"):
            metadata_unpickle.load_dcp_metadata_bytes(real[:cut], "x")
    with pytest.raises(CheckpointFormatError, match="Memo value not found"):
        metadata_unpickle.load_dcp_metadata_bytes(b"\x80\x04j\x00\x00\x01\x00.", "x")
