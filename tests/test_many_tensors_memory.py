"""Checkpoints of many small tensors: the compact paths give what the plain ones gave.

The safetensors header is read entry by entry (falling back to ``json.loads`` for anything
unusual), and the DCP writer keeps its chunks as columns merged at the end; both must give
the same parse and the same ``.metadata`` as before, whatever the order things come in.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from ema_ckpt.errors import CheckpointFormatError
from ema_ckpt.formats.dcp.writer import DcpWriter
from ema_ckpt.formats.safetensors.header import read_header
from ema_ckpt.layout import Box


def _file(tmp_path: Path, name: str, header: str, data: int) -> Path:
    raw = header.encode()
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return path


@pytest.mark.parametrize("header", [
    '{"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    ' {\n "a" : {"dtype":"F32","shape":[2],"data_offsets":[0,8]} ,\n"__metadata__":{"k":"v"},'
    '"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}\n} ',
    # a key given twice: json keeps the last value at the first place
    '{"a":{"dtype":"F32","shape":[9],"data_offsets":[0,36]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},'
    '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
])
def test_header_read_as_json_reads_it(tmp_path: Path, header: str) -> None:
    path = _file(tmp_path, "x.safetensors", header, 16)
    parsed = read_header(path)
    doc = json.loads(header)
    metadata = doc.pop("__metadata__", None) or {}
    assert parsed.metadata == metadata
    assert list(parsed.tensors) == list(doc)
    assert {k: (s.shape, s.dtype) for k, s in parsed.tensors.items()} == {
        k: (tuple(e["shape"]), torch.float32) for k, e in doc.items()}
    assert parsed.offsets == {k: 8 + len(header.encode()) + e["data_offsets"][0] for k, e in doc.items()}


def test_header_refusals_keep_their_order(tmp_path: Path) -> None:
    bad_entry = '{"a":{"dtype":"XX","shape":[2],"data_offsets":[0,8]},'
    # malformed JSON after a bad entry: the JSON error wins, as with json.loads first
    with pytest.raises(CheckpointFormatError, match="header is not JSON"):
        read_header(_file(tmp_path, "a.safetensors", bad_entry + '"b":}', 8))
    # bad metadata after a bad entry: the metadata error wins
    with pytest.raises(CheckpointFormatError, match="__metadata__ is not a string-to-string map"):
        read_header(_file(tmp_path, "b.safetensors", bad_entry + '"__metadata__":{"k":1}}', 8))
    with pytest.raises(CheckpointFormatError, match="dtype 'XX' is not supported"):
        read_header(_file(tmp_path, "c.safetensors", bad_entry + '"__metadata__":{"k":"v"}}', 8))
    gap = '{"a":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    with pytest.raises(CheckpointFormatError, match="tensor 'a' at data byte 8 leaves a gap before it"):
        read_header(_file(tmp_path, "d.safetensors", gap, 12))


def test_workers_states_merge_in_key_order(tmp_path: Path) -> None:
    """Rows from two writers, interleaved and out of order, give the metadata one writer gives."""
    values = {"w": torch.arange(12.0).reshape(4, 3), "v": torch.ones(5), "e": torch.zeros(0, 2)}
    writes = [("w", Box((0, 0), (2, 3)), values["w"][:2], 0, 0), ("w", Box((2, 0), (2, 3)), values["w"][2:], 1, 0),
              ("v", Box((0,), (5,)), values["v"], 1, 1), ("e", Box((0, 0), (0, 2)), values["e"], 0, 0)]

    def declared(path: Path) -> DcpWriter:
        writer = DcpWriter(path)
        for key, value in values.items():
            writer.declare(key, tuple(value.shape), value.dtype)
        return writer

    one = declared(tmp_path / "one")
    for key, box, value, rank, part in writes:
        one.write(key, box, value, rank=rank, part=part)
    one.finish(key_order=list(values))

    workers = [declared(tmp_path / "two") for _ in range(2)]
    for worker, (key, box, value, rank, part) in zip([1, 1, 0, 0], reversed(writes), strict=True):
        workers[worker].write(key, box, value, rank=rank, part=part)
    states = [workers[1].close(), workers[0].close()]
    declared(tmp_path / "two").finish(others=states, key_order=list(values))
    assert (tmp_path / "one" / ".metadata").read_bytes() == (tmp_path / "two" / ".metadata").read_bytes()


def test_uncovered_key_is_named(tmp_path: Path) -> None:
    writer = DcpWriter(tmp_path / "out")
    writer.declare("a", (2,), torch.float32)
    writer.declare("b", (4,), torch.float32)
    writer.write("a", Box((0,), (2,)), torch.ones(2))
    writer.write("b", Box((0,), (2,)), torch.ones(2))
    with pytest.raises(ValueError, match=r"b: written chunks do not cover shape \[4\]"):
        writer.finish()
