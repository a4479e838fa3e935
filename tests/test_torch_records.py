"""torch.save records: what ema-ckpt writes loads in torch, what torch writes is located exactly."""

from __future__ import annotations

import io
import zipfile
import zlib

import pytest
import torch

from ema_ckpt.storage import open_readable
from ema_ckpt.torch_records import (
    FileWindow,
    TensorRecord,
    load_tensor_record,
    member_start,
    scan_record,
    state_dict_pickle,
    tensor_pickle,
    write_tensor_record,
)
from ema_ckpt.torch_records.tree import load_tree


class _Sink(io.BytesIO):
    def write(self, data, *, crc=None):  # type: ignore[override]
        return super().write(data)


@pytest.mark.parametrize("tensor", [torch.arange(12.0).reshape(3, 4), torch.tensor(5), torch.empty(0, 2),
                                    torch.ones(3, dtype=torch.bfloat16), torch.tensor([True, False])])
def test_a_written_record_loads_in_torch_and_is_located(tmp_path, tensor):
    sink = _Sink()
    sink.write(b"x" * 7)  # records sit at any offset of a data file
    length = write_tensor_record(sink, tensor)
    path = tmp_path / "d"
    path.write_bytes(sink.getvalue())
    assert torch.equal(torch.load(io.BytesIO(sink.getvalue()[7:]), weights_only=True), tensor)
    with open_readable(path) as fd:
        members = scan_record(fd, 7, length)
        assert members is not None and set(members) >= {"archive/data.pkl", "archive/data/0"}
        _method, size, local, _crc = members["archive/data.pkl"]
        start = member_start(fd, 7, length, local)
        record = load_tensor_record(fd.pread(size, 7 + start), "x")
        assert record.size == tuple(tensor.shape) and record.is_contiguous
        _, nbytes, local, crc = members["archive/data/0"]
        begin = member_start(fd, 7, length, local)
        assert begin % 64 == 0  # aligned within the record, as torch aligns it
        assert fd.pread(nbytes, 7 + begin) == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert crc == zlib.crc32(fd.pread(nbytes, 7 + begin))
        with zipfile.ZipFile(FileWindow(fd, 7, length)) as archive:
            assert archive.testzip() is None


def test_pickles_describe_what_torch_save_describes():
    t = torch.arange(6.0).reshape(2, 3)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    with zipfile.ZipFile(buffer) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        assert load_tensor_record(archive.read(name), "torch") == load_tensor_record(tensor_pickle(t), "ours")
    state = state_dict_pickle({"a": ((2, 3), torch.float32), "b": ((), torch.int64)})
    records = load_tree(state, "x").root
    assert [(k, r.size, r.dtype, r.storage_key) for k, r in records.items()] == [
        ("a", (2, 3), "float32", "0"), ("b", (), "int64", "1")]


def test_a_torch_saved_state_dict_is_located_without_building_tensors():
    state = {"model": {"w": torch.randn(3, 4), "t": torch.randn(4, 3).t()}, "step": 2}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with zipfile.ZipFile(buffer) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        tree = load_tree(archive.read(name), "x")
    records = tree.root["model"]
    assert set(records) == {"w", "t"} and tree.root["step"] == 2 and len(tree.storages) == 2
    assert isinstance(records["w"], TensorRecord) and records["w"].is_contiguous
    assert not records["t"].is_contiguous
