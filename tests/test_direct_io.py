"""Outputs appended past the page cache: the same bytes as a buffered write, whatever the sizes,
and a clean fallback where a file system refuses O_DIRECT (at open or at the first write)."""

from __future__ import annotations

import errno
import mmap
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ema_ckpt.storage import direct_io
from ema_ckpt.storage.direct_io import ALIGNMENT, DirectAppender


def _write(path, pieces, **kwargs):
    with DirectAppender(path, **kwargs) as out:
        for piece in pieces:
            out.write(piece)
        position = out.tell()
        out.flush()
        os.fsync(out.fileno())
        direct = out.direct
    return position, direct


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3 * ALIGNMENT + 5), max_size=12), st.sampled_from([ALIGNMENT, 2 * ALIGNMENT, 1 << 16]))
def test_any_sequence_of_writes_gives_the_same_bytes(tmp_path_factory, sizes, buffer_bytes):
    path = tmp_path_factory.mktemp("d") / "f.bin"
    pieces = [os.urandom(n) for n in sizes]
    position, _ = _write(path, [memoryview(p) for p in pieces], buffer_bytes=buffer_bytes)
    assert path.read_bytes() == b"".join(pieces) and position == sum(sizes)


def test_direct_io_is_used_where_the_file_system_takes_it(tmp_path):
    data = os.urandom(5 * ALIGNMENT + 17)
    _, direct = _write(tmp_path / "f.bin", [data])
    assert (tmp_path / "f.bin").read_bytes() == data
    if direct_io.direct_io_enabled():
        try:
            fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
            os.close(fd)
        except OSError:
            pytest.skip("this file system refuses O_DIRECT")
        assert direct


def test_refused_at_open_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    data = os.urandom(3 * ALIGNMENT + 1)
    _, direct = _write(tmp_path / "f.bin", [data[:10], data[10:]], buffer_bytes=ALIGNMENT)
    assert not direct and (tmp_path / "f.bin").read_bytes() == data


def _source(size, page_aligned):
    """``size`` random bytes whose memory starts on a page, or one byte past it (the two write paths)."""
    memory = mmap.mmap(-1, size + 1)
    memory.write(os.urandom(size + 1))
    start = 0 if page_aligned else 1
    return memoryview(memory)[start:start + size]


@pytest.mark.parametrize("page_aligned", [True, False])
def test_refused_at_the_first_write_falls_back_with_every_byte(tmp_path, monkeypatch, page_aligned):
    real_write = os.write
    calls = []
    data = _source(4 * ALIGNMENT + 99, page_aligned)
    with DirectAppender(tmp_path / "f.bin", buffer_bytes=ALIGNMENT) as out:
        if not out.direct:
            pytest.skip("this file system refuses O_DIRECT")
        direct_fd = out.fileno()

        def refuse(fd, data):
            # only this file's writes (other threads of the process write too), each one while direct: a
            # page-aligned source is tried once straight from its memory, then again through the buffer
            if fd == direct_fd and out.direct:
                calls.append(len(data))
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", refuse)
        out.write(data)
        assert not out.direct
    assert (tmp_path / "f.bin").read_bytes() == data.tobytes()


def test_the_environment_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("EMA_CKPT_NO_DIRECT_IO", "1")
    assert not direct_io.direct_io_enabled()
    _, direct = _write(tmp_path / "f.bin", [b"abc"])
    assert not direct and (tmp_path / "f.bin").read_bytes() == b"abc"


@pytest.mark.parametrize("page_aligned", [True, False])
def test_a_later_write_error_is_raised(tmp_path, monkeypatch, page_aligned):
    real_write = os.write
    calls = []
    out = DirectAppender(tmp_path / "f.bin", buffer_bytes=ALIGNMENT)
    if not out.direct:
        pytest.skip("this file system refuses O_DIRECT")

    def fail_second(fd, data):
        if fd != out.fileno():  # only this file's writes: other threads of the process write too
            return real_write(fd, data)
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        # one block per call: a page-aligned source would otherwise go down in one write
        return real_write(fd, memoryview(data)[:ALIGNMENT])

    monkeypatch.setattr(os, "write", fail_second)
    with pytest.raises(OSError) as info:
        out.write(_source(3 * ALIGNMENT, page_aligned))
    assert info.value.errno == errno.ENOSPC
    out.abort()


def test_drain_writes_whole_blocks_and_keeps_the_bytes(tmp_path):
    data = [os.urandom(n) for n in (100, 3 * ALIGNMENT + 5, 17, 2 << 20, 9)]
    with DirectAppender(tmp_path / "f.bin", buffer_bytes=1 << 20) as out:
        for piece in data:
            out.write(piece)
            out.drain(at_least=1)
            assert out.tell() == sum(len(p) for p in data[: data.index(piece) + 1])
    assert (tmp_path / "f.bin").read_bytes() == b"".join(data)


def test_page_aligned_memory_goes_to_the_disk_uncopied_and_gives_the_same_bytes(tmp_path):
    import torch

    from ema_ckpt.engine.buffers import _page_aligned

    aligned = _page_aligned(5 * ALIGNMENT + 3, torch.uint8)
    aligned.copy_(torch.randint(0, 255, aligned.shape, dtype=torch.uint8))
    offset = aligned[1:]  # not on a page: copied through the buffer
    pieces = [b"h" * ALIGNMENT, memoryview(aligned.numpy()), b"x" * 5, memoryview(offset.numpy())]
    _write(tmp_path / "f.bin", pieces, buffer_bytes=ALIGNMENT)
    assert (tmp_path / "f.bin").read_bytes() == b"".join(bytes(p) for p in pieces)


def test_large_dcp_records_are_page_aligned_in_their_files(tmp_path):
    """A record of 1 MiB or more starts 64-aligned and its data starts on a page of the file,
    so it is written from memory; torch still reads the output."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ema_ckpt.formats import open_checkpoint
    from ema_ckpt.formats.dcp.writer import DcpWriter
    from ema_ckpt.layout import Box
    from ema_ckpt.storage import open_readable
    from ema_ckpt.torch_records import member_start, scan_record

    tensors = {"a": torch.randn(3), "big": torch.randn(700, 1000), "b": torch.randn(5, 7),
               "big2": torch.randn(2, 300_000)}
    writer = DcpWriter(tmp_path / "out")
    for key, value in tensors.items():
        writer.declare(key, tuple(value.shape), value.dtype)
        writer.write(key, Box.full(tuple(value.shape)), value)
    writer.finish()
    reader = open_checkpoint(tmp_path / "out")
    for file, offset, length in reader.stored_records():
        with open_readable(tmp_path / "out" / file) as fd:
            members = scan_record(fd, offset, length)
            assert members is not None
            data = member_start(fd, offset, length, members["archive/data/0"][2])
            assert data is not None
            assert data % 64 == 0  # torch's storage alignment, counted from the record's start
            if length >= 1 << 20:
                assert offset % 64 == 0 and (offset + data) % ALIGNMENT == 0
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "out.pt"))
    loaded = torch.load(tmp_path / "out.pt")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_a_dcp_output_of_many_small_files_holds_a_bounded_amount_gathered(tmp_path, monkeypatch):
    """Files stay open for the run; what idle ones hold is bounded over all of them, so an
    output of many files smaller than a direct write does not end up held in memory."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ema_ckpt.formats.dcp import writer as dcp_writer
    from ema_ckpt.layout import Box

    monkeypatch.setattr(dcp_writer, "IDLE_BYTES", 256 << 10)
    writer = dcp_writer.DcpWriter(tmp_path / "out")
    tensors = {f"w{i}": torch.randn(40, 1024) for i in range(24)}  # 160 KiB each, one file each
    most = 0
    for round_ in range(2):  # each file written twice, the second time after all others
        for i, (key, value) in enumerate(tensors.items()):
            half = value[round_ * 20:(round_ + 1) * 20]
            writer.declare(key, tuple(value.shape), value.dtype)
            writer.write(key, Box((round_ * 20, 0), (20, 1024)), half.clone(), part=i)
            held = sum(handle.gathered for name, (handle, _) in writer._handles.items() if name != writer._current)
            most = max(most, held)
    assert most <= (256 << 10) + len(tensors) * ALIGNMENT
    writer.finish()
    loaded = {key: torch.empty_like(value) for key, value in tensors.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert all(torch.equal(loaded[key], value) for key, value in tensors.items())
