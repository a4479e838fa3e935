"""Crafted and damaged checkpoints: each ends in one clean error, nothing runs, nothing hangs."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.errors import CheckpointFormatError, CheckpointNotFoundError, OutputError, UnsafePickleError
from ema_ckpt.formats.dcp import DcpReader
from ema_ckpt.layout import Box
from ema_ckpt.storage.local_publish import OutputLock
from tests.dcp_helpers import write_dcp


def _edit_metadata(path: Path, edit) -> None:
    meta = pickle.loads((path / ".metadata").read_bytes())
    edit(meta)
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def test_negative_chunk_sizes_are_refused(tmp_path):
    ck = write_dcp(tmp_path / "ck", {"model.w": torch.ones(2, 2)}, world_size=2)

    def edit(meta):
        chunk = meta.state_dict_metadata["model.w"].chunks[1]
        chunk.offsets, chunk.sizes = torch.Size([2, 2]), torch.Size([-1, -2])

    _edit_metadata(ck, edit)
    with pytest.raises(CheckpointFormatError, match="negative chunk size"):
        DcpReader(ck)


def test_wrong_types_in_metadata_are_a_format_error(tmp_path):
    ck = write_dcp(tmp_path / "ck", {"model.w": torch.ones(3)})
    _edit_metadata(ck, lambda meta: setattr(next(iter(meta.storage_data.values())), "offset", "zero"))
    result = CliRunner().invoke(app, ["inspect", str(ck)])
    assert result.exit_code == 3 and "malformed DCP metadata" in result.stderr


def test_a_chunk_larger_than_its_record_is_refused_before_allocating(tmp_path):
    ck = write_dcp(tmp_path / "ck", {"model.w": torch.ones(3)})

    def edit(meta):
        entry = meta.state_dict_metadata["model.w"]
        entry.size = torch.Size([10**12])
        entry.chunks[0].sizes = torch.Size([10**12])

    _edit_metadata(ck, edit)
    with pytest.raises(CheckpointFormatError, match="larger than its record"):
        DcpReader(ck)


def test_a_fifo_in_place_of_a_data_file_does_not_hang(tmp_path):
    ck = write_dcp(tmp_path / "ck", {"model.w": torch.ones(4)})
    (ck / "__0_0.distcp").unlink()
    os.mkfifo(ck / "__0_0.distcp")
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        DcpReader(ck)


def test_the_lock_never_follows_a_planted_symlink(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("precious data")
    (tmp_path / ".ema.lock").symlink_to(victim)
    with pytest.raises(OutputError, match="lock file"), OutputLock(tmp_path / "ema"):
        pass
    assert victim.read_text() == "precious data"


def test_metadata_cannot_poison_classes_for_the_rest_of_the_process(tmp_path):
    ck = write_dcp(tmp_path / "ck", {"model.w": torch.ones(4)})
    legit = (ck / ".metadata").read_bytes()

    def short(text: str) -> bytes:
        data = text.encode()
        return b"\x8c" + bytes([len(data)]) + data

    # BUILD on class objects handed out by find_class: set attributes on them, then load on.
    evil = b"cpathlib\nPath\nN}" + short("exists") + b"ctorch\nfloat32\ns\x86b0"
    evil += b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\nN}" + short("fqn") + short("x") + b"s\x86b0"
    (ck / ".metadata").write_bytes(legit[:2] + evil + legit[2:])
    with contextlib.suppress(CheckpointFormatError):
        DcpReader(ck).close()
    assert not Path(tmp_path / "missing").exists()
    write_dcp(tmp_path / "ok", {"model.w": torch.ones(4)})
    with DcpReader(tmp_path / "ok") as reader:
        assert torch.equal(reader.read("model.w", Box((0,), (4,))), torch.ones(4))


def test_python_313_pathlib_names_are_admitted():
    from ema_ckpt.formats.dcp.metadata_unpickle import load_dcp_metadata_bytes

    # Python 3.13 pickles PosixPath as pathlib._local.PosixPath (in storage_meta.checkpoint_id)
    crafted = b"\x80\x04cpathlib._local\nPosixPath\n\x8c\x02/x\x85R."
    with pytest.raises(CheckpointFormatError, match="does not hold DCP Metadata"):
        load_dcp_metadata_bytes(crafted, "x")  # admitted (not refused as unsafe), just not Metadata


def _record_with_storage_offset(offset: int) -> bytes:
    import collections
    import io
    import zipfile

    class Ref:
        pass

    class Stub:
        def __reduce_ex__(self, protocol):
            return (torch._utils._rebuild_tensor_v2,
                    (Ref(), offset, torch.Size([8]), (1,), False, collections.OrderedDict()))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", 8) if isinstance(obj, Ref) else None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump(Stub())
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", data.getvalue())
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/data/0", torch.arange(8.0).numpy().tobytes())
        archive.writestr("archive/version", "3")
    return buffer.getvalue()


def test_records_with_negative_storage_offsets_are_refused(tmp_path):
    ck = write_dcp(tmp_path / "ck", {"model.w": torch.arange(8.0)})
    for offset, ok in ((0, True), (-2, False)):
        record = _record_with_storage_offset(offset)
        (ck / "__0_0.distcp").write_bytes(record)
        length = len(record)
        _edit_metadata(ck, lambda meta, n=length: [setattr(i, "length", n) for i in meta.storage_data.values()])
        with DcpReader(ck) as reader:
            if ok:
                assert torch.equal(reader.read("model.w", Box((0,), (8,))), torch.arange(8.0))
            else:
                with pytest.raises(CheckpointFormatError, match="corrupt record"):
                    reader.read("model.w", Box((0,), (8,)))


def test_a_crafted_record_cannot_run_code(tmp_path):
    ck = write_dcp(tmp_path / "ck", {"model.w": torch.zeros(2)})
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(Exploit(), protocol=2))
        archive.writestr("archive/version", "3")
    record = buffer.getvalue()
    (ck / "__0_0.distcp").write_bytes(record)
    _edit_metadata(ck, lambda meta: [setattr(i, "length", len(record)) for i in meta.storage_data.values()])
    with DcpReader(ck) as reader, pytest.raises(UnsafePickleError) as refused:
        reader.read("model.w", Box((0,), (2,)))
    assert not marker.exists()
    message = str(refused.value)
    assert "system" in message and "nothing from the file was run" in message
    assert "weights_only" not in message and "will likely succeed" not in message  # torch's advice, never ours


def test_unreadable_file_and_missing_directory_from_the_cli(tmp_path):
    ck = write_dcp(tmp_path / "c" / "step_1", {"model.w": torch.ones(2)})
    (ck / ".metadata").chmod(0)
    if os.geteuid() != 0:
        result = CliRunner().invoke(app, ["inspect", str(ck)])
        assert result.exit_code == 3
    proc = subprocess.run([str(Path(sys.executable).with_name("ema-ckpt")), "inspect", str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1 and "no such file" in proc.stderr


def test_explicit_directory_without_metadata_is_not_found(tmp_path):
    (tmp_path / "step_5").mkdir()
    with pytest.raises(CheckpointNotFoundError):
        DcpReader(tmp_path / "step_5")


def test_missing_or_unreadable_data_files_from_the_cli(tmp_path):
    ck = write_dcp(tmp_path / "c" / "step_1", {"model.w": torch.ones(8, 2)}, world_size=2)
    write_dcp(tmp_path / "c" / "step_2", {"model.w": torch.ones(8, 2)}, world_size=2)
    (ck / "__1_0.distcp").unlink()  # a rank's data file is gone
    result = CliRunner().invoke(app, ["accumulate", str(tmp_path / "c"), "--decay", "0.9"])
    assert result.exit_code == 3 and "__1_0.distcp: data file named by the metadata is missing" in result.stderr
    (ck / "__1_0.distcp").mkdir()  # unreadable as a file (what a permission error looks like to root)
    result = CliRunner().invoke(app, ["accumulate", str(tmp_path / "c"), "--decay", "0.9"])
    assert result.exit_code == 3 and "__1_0.distcp" in result.stderr
    assert not (tmp_path / "c" / "ema").exists()
