"""Readers under hostile conditions: views that do not fit their storage, pickles nested
200,000 deep, and ``--inert-global`` patterns that would reach Python's own modules.

Every file here is written by torch itself (``torch.save``, ``dcp.save``) or by patching the
few bytes of its pickle that hold a stride; each is read through the CLI, as a user would.
"""

from __future__ import annotations

import binascii
import io
import struct
import sys
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.errors import CheckpointFormatError, OptionError
from ema_ckpt.formats.options import ReadOptions
from ema_ckpt.torch_records import view_problem

runner = CliRunner()


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


def _refused(args: list[str], *words: str) -> str:
    """Run ``args``; it must exit 3 in one line holding every one of ``words``, quickly."""
    start = time.monotonic()
    result = runner.invoke(app, args)
    assert time.monotonic() - start < 20, args
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    assert len(_lines(result.output)) == 1, result.output
    for word in words:
        assert word in result.output, result.output
    return result.output


def _refused_everywhere(path: Path, tmp_path: Path, *words: str) -> None:
    """``inspect`` and ``accumulate`` both refuse ``path``; ``accumulate`` writes nothing."""
    _refused(["inspect", str(path)], *words)
    out = tmp_path / "ema-out"
    _refused(["accumulate", str(path), "--decay", "0.9", "--out", str(out)], *words)
    assert not out.exists() or not any(out.iterdir())


def _rewrite_pickle(path: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (once) in a ``torch.save`` zip's ``data.pkl``; the zip is
    written again member by member, uncompressed, as torch writes it."""
    with zipfile.ZipFile(path) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for info, data in members:
            if info.filename.endswith("data.pkl"):
                assert data.count(old) == 1, (old, data)
                data = data.replace(old, new)
            archive.writestr(info.filename, data)


# --- 1. every view bounded by its storage -----------------------------------------------------


def test_view_problem_names_each_class_of_view():
    assert view_problem((4,), (1,), 0, 4, 4) is None
    assert view_problem((3, 4), (1, 3), 0, 12, 4) is None  # transposed: fits exactly
    assert view_problem((0, 5), (0, 0), 0, 0, 4) is None  # empty: reaches nothing
    assert "stride of 0" in view_problem((2**36,), (0,), 0, 1, 4)
    assert "outside its storage" in view_problem((7,), (17,), 0, 100, 4)
    assert "outside its storage" in view_problem((4,), (1,), 1, 4, 4)
    assert "negative stride" in view_problem((4,), (-1,), 3, 4, 4)
    assert "overlap" in view_problem((4, 4), (1, 1), 0, 16, 4)


def _stride0(n: int) -> torch.Tensor:
    return torch.empty(1).as_strided((n,), (0,))


@pytest.mark.parametrize("case, words", [
    ("stride0", ("'w'", "stride of 0")),
    ("bomb", ("'w'", "stride of 0")),
    ("overlap", ("'w'", "overlap")),
    ("reach", ("'w'", "outside its storage")),
    ("negative", ("'w'", "negative stride")),
])  # fmt: skip
def test_single_file_views_outside_their_storage_are_refused(tmp_path, case, words):
    path = tmp_path / "step_5.pt"
    if case == "stride0":
        torch.save({"w": _stride0(2**20), "b": torch.ones(2)}, path)
    elif case == "bomb":  # 4 stored bytes claiming 2^36 floats (256 GiB)
        torch.save({"w": _stride0(2**36), "b": torch.ones(2)}, path)
    elif case == "overlap":
        torch.save({"w": torch.arange(16.0).as_strided((4, 4), (1, 1)), "b": torch.ones(2)}, path)
    else:  # a (7,) view of 100 floats with stride 13, its stride then patched to 17 or -13
        torch.save({"w": torch.arange(100.0).as_strided((7,), (13,)), "b": torch.ones(2)}, path)
        _rewrite_pickle(path, b"K\r\x85", b"K\x11\x85" if case == "reach" else b"J\xf3\xff\xff\xff\x85")
    _refused_everywhere(path, tmp_path, str(path.name), *words)


def test_a_bin_folder_with_a_stride_0_view_is_refused(tmp_path):
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    torch.save({"w": _stride0(2**20), "b": torch.ones(2)}, folder / "pytorch_model.bin")
    _refused(["inspect", str(folder)], "pytorch_model.bin", "'w'", "stride of 0")
    out = tmp_path / "ema-out"
    _refused(["accumulate", str(folder), "--decay", "0.9", "--out", str(out)], "'w'", "stride of 0")
    assert not out.exists() or not any(out.iterdir())


def _write_zero2(tag: Path, *, buffer: torch.Tensor | None = None, flat: torch.Tensor | None = None) -> None:
    """A one-group ZeRO-2 checkpoint of world size 1 (64 fp32 weights), DeepSpeed's layout."""
    tag.mkdir(parents=True)
    module = {"a": torch.zeros(8, 8)}
    if buffer is not None:
        module["buf"] = buffer
    torch.save(
        {"module": module, "buffer_names": ["buf"] if buffer is not None else [],
         "param_shapes": [OrderedDict(a=torch.Size([8, 8]))], "shared_params": {},
         "frozen_param_shapes": None, "global_steps": 5, "dp_world_size": 1},
        tag / "mp_rank_00_model_states.pt",
    )  # fmt: skip
    groups = [flat if flat is not None else torch.randn(64)]
    osd = {"zero_stage": 2, "partition_count": [1], "single_partition_of_fp32_groups": groups,
           "base_optimizer_state": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}}  # fmt: skip
    torch.save({"optimizer_state_dict": osd}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tag.parent / "latest").write_text(tag.name)


def test_a_well_formed_deepspeed_checkpoint_of_this_shape_is_read(tmp_path):
    _write_zero2(tmp_path / "run" / "global_step5", buffer=torch.ones(3))
    result = runner.invoke(app, ["inspect", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("where", ["buffer", "flat"])
def test_deepspeed_stride_0_views_are_refused_naming_the_file_and_key(tmp_path, where):
    tag = tmp_path / "run" / "global_step5"
    if where == "buffer":
        _write_zero2(tag, buffer=_stride0(2**36))
        words = ("mp_rank_00_model_states.pt", "'buf'", "stride of 0")
    else:
        _write_zero2(tag, flat=_stride0(64))
        words = ("optim_states.pt", "single_partition_of_fp32_groups[0]", "stride of 0")
    _refused_everywhere(tmp_path / "run", tmp_path, *words)


def test_deepspeed_flat_groups_that_overlap_are_refused(tmp_path):
    tag = tmp_path / "run" / "global_step5"
    _write_zero2(tag)
    base = torch.randn(64)
    osd = {"zero_stage": 2, "partition_count": [1, 1], "single_partition_of_fp32_groups": [base[:40], base[24:]],
           "base_optimizer_state": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}}  # fmt: skip
    torch.save({"optimizer_state_dict": osd}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _refused(["inspect", str(tmp_path / "run")], "optim_states.pt", "overlap")


def _patch_file(path: Path, old: bytes, new: bytes) -> None:
    """Replace the one ``old`` in ``path`` by ``new`` (same length), fixing the CRC-32s its zip
    records for the member that holds it (local header and central directory)."""
    data = bytearray(path.read_bytes())
    at = data.find(old)
    assert at >= 0 and data.find(old, at + 1) < 0 and len(old) == len(new)
    # the member holding it: the last local header before it
    header = data.rfind(b"PK\x03\x04", 0, at)
    flags = struct.unpack_from("<H", data, header + 6)[0]
    name_len, extra_len = struct.unpack_from("<HH", data, header + 26)
    start = header + 30 + name_len + extra_len
    # torch writes sizes and CRC-32 in a data descriptor after the member (flag bit 3)
    size = data.find(b"PK\x07\x08", at) - start if flags & 8 else struct.unpack_from("<I", data, header + 18)[0]
    before = binascii.crc32(data[start:start + size])
    data[at:at + len(old)] = new
    after = binascii.crc32(data[start:start + size])
    old_crc, new_crc = struct.pack("<I", before), struct.pack("<I", after)
    pos = data.find(old_crc)
    while pos >= 0:
        data[pos:pos + 4] = new_crc
        pos = data.find(old_crc, pos + 4)
    path.write_bytes(bytes(data))


def test_a_dcp_record_describing_a_stride_0_view_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "step_5"
    dcp.save({"w": torch.arange(37.0), "b": torch.ones(2)}, checkpoint_id=str(ckpt))
    [data_file] = sorted(ckpt.glob("*.distcp"))
    # the record of w: size (37,) then stride (1,) in its data.pkl; the stride made 0
    _patch_file(data_file, b"K%\x85q\x06K\x01\x85", b"K%\x85q\x06K\x00\x85")
    out = tmp_path / "ema-out"
    _refused(["accumulate", str(ckpt), "--decay", "0.9", "--out", str(out)], data_file.name, "'w'", "stride of 0")
    assert not out.exists() or not any(out.iterdir())
    # inspect reads the metadata only; verify reads every record and names this one
    checked = runner.invoke(app, ["verify", str(ckpt)])
    assert checked.exit_code == 3 and "'w'" in checked.output and "stride of 0" in checked.output, checked.output


# --- 2. nested pickles: linear, and a depth limit ---------------------------------------------


def _deep_file(path: Path, depth: int) -> None:
    """A 400 KB ``torch.save`` zip whose pickle is ``{"w": [[[…]]]}`` ``depth`` lists deep,
    written opcode by opcode (MARK … LIST), as no pickler recurses that far."""
    body = b"\x80\x02}X\x01\x00\x00\x00w" + b"(" * depth + b"]" + b"l" * depth + b"s."
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", body)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")


@pytest.mark.parametrize("command", ["inspect", "accumulate"])
def test_a_pickle_nested_200000_deep_is_refused_at_once(tmp_path, command):
    path = tmp_path / "step_5.pt"
    _deep_file(path, 200_000)
    args = [command, str(path)] + (["--decay", "0.9", "--out", str(tmp_path / "o")] if command == "accumulate" else [])
    output = _refused(args, "step_5.pt", "more than 1000 deep")
    assert "w[0][0]" in output


def test_the_depth_refusal_is_linear(tmp_path):
    from ema_ckpt.torch_records.tree import load_tree

    body = b"\x80\x02}X\x01\x00\x00\x00w" + b"(" * 200_000 + b"]" + b"l" * 200_000 + b"s."
    start = time.monotonic()
    with pytest.raises(CheckpointFormatError, match="more than 1000 deep"):
        load_tree(body, "deep.pt")
    assert time.monotonic() - start < 20  # about 0.1 s; > 90 s when every level copied its path


def test_a_deep_but_bounded_pickle_is_read(tmp_path):
    nested: list = []
    for _ in range(990):
        nested = [nested]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        torch.save({"w": torch.ones(3), "deep": nested}, tmp_path / "step_5.pt")
    finally:
        sys.setrecursionlimit(limit)
    result = runner.invoke(app, ["inspect", str(tmp_path / "step_5.pt")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "ema"
    result = runner.invoke(app, ["accumulate", str(tmp_path / "step_5.pt"), "--decay", "0.9", "--out", str(out)])
    assert result.exit_code == 0, result.output


# --- 3. --inert-global never reaches Python's own modules ---------------------------------------

CODE_PATTERNS = [
    "posix.system", "os.system", "nt.system", "nt.*", "builtins.eval", "builtins.exec", "builtins.getattr",
    "subprocess.Popen", "subprocess.*", "shutil.rmtree", "importlib.import_module", "sys.modules", "pty.spawn",
    "socket.socket", "ctypes.CDLL", "pickle.loads", "marshal.loads", "types.FunctionType", "functools.partial",
    "operator.attrgetter", "operator.methodcaller", "posix.*", "os.*", "*.*", "*.system", "o*.system",
    "[p]osix.system", "p?six.*", "o*h.join", "os.path.join",
]  # fmt: skip


@pytest.mark.parametrize("pattern", CODE_PATTERNS)
def test_inert_global_patterns_reaching_python_itself_are_refused(tmp_path, pattern):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    with pytest.raises(OptionError, match="Python's own module"):
        ReadOptions(inert_globals=(pattern,))
    result = runner.invoke(app, ["inspect", str(tmp_path / "m.pt"), "--inert-global", pattern])
    assert result.exit_code == 2, result.output
    assert len(_lines(result.output)) == 1 and repr(pattern) in result.output, result.output


def test_a_training_scripts_own_class_is_still_accepted(tmp_path, monkeypatch):
    (tmp_path / "myproj.py").write_text(
        "class Config:\n    def __init__(self):\n        self.lr = 0.1\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    import myproj  # type: ignore[import-not-found]

    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "config": myproj.Config()}, buffer)
    del sys.modules["myproj"]
    (tmp_path / "myproj.py").unlink()
    (tmp_path / "m.pt").write_bytes(buffer.getvalue())
    refused = runner.invoke(app, ["inspect", str(tmp_path / "m.pt")])
    assert refused.exit_code == 3 and "myproj.Config" in refused.output, refused.output
    for pattern in ("myproj.Config", "myproj.*"):
        ReadOptions(inert_globals=(pattern,))
        result = runner.invoke(app, ["inspect", str(tmp_path / "m.pt"), "--inert-global", pattern])
        assert result.exit_code == 0, result.output
