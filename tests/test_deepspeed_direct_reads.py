"""The DeepSpeed reader reads fp32 partitions with ``pread`` at their place in the file, and only them.

The rank files stay memory-mapped for their structure; each flat group's bytes are located
(``storage_file_offsets``) and read straight into the caller's buffer. Adam moments, which
make an optimizer file three times its masters, are never read. Files whose storages cannot be
located (legacy ``torch.save``) are still read through the mapping.
"""

from __future__ import annotations

import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from ema_ckpt.errors import CheckpointFormatError
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.formats.deepspeed import DeepSpeedReader
from ema_ckpt.formats.deepspeed.unpickle import load_ds_file_releasable, storage_file_offsets
from ema_ckpt.layout import Box
from tests.ds_fixtures import Config


def _full(reader, key):
    return reader.read(key, Box.full(reader.specs()[key].shape))


def _member_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """``{data/<key>: (data offset, size)}`` from the zip's local headers, by the zipfile module."""
    out = {}
    with zipfile.ZipFile(path) as zf, path.open("rb") as fh:
        for info in zf.infolist():
            if "/data/" in info.filename:
                fh.seek(info.header_offset + 26)
                name_len, extra_len = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
                out[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return out


def _write_stage2(tag: Path, a: torch.Tensor, *, legacy: bool = False) -> None:
    """A one-group ZeRO-2 checkpoint of world size 2 holding ``a`` (numel a multiple of 4), with moments."""
    tag.mkdir()
    extra = {"_use_new_zipfile_serialization": False} if legacy else {}
    torch.save(
        {"module": {}, "buffer_names": [], "param_shapes": [OrderedDict(a=a.shape)], "shared_params": {},
         "frozen_param_shapes": None, "global_steps": 1, "dp_world_size": 2},
        tag / "mp_rank_00_model_states.pt", **extra,
    )  # fmt: skip
    flat = a.reshape(-1)
    half = flat.numel() // 2
    for r, part in enumerate((flat[:half], flat[half:])):
        moments = {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(half), "exp_avg_sq": torch.rand(half)}}
        osd = {"zero_stage": 2, "partition_count": [2], "single_partition_of_fp32_groups": [part.clone()],
               "base_optimizer_state": {"state": moments, "param_groups": [{"lr": 0.1, "params": [0]}]}}  # fmt: skip
        torch.save({"optimizer_state_dict": osd}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", **extra)


@pytest.mark.parametrize("config", [Config(2, 3, "fp32"), Config(2, 1, "bf16"), Config(3, 2, "bf16")],
                         ids=lambda c: c.name)  # fmt: skip
def test_fp32_partitions_are_read_from_the_file_and_the_moments_never(ds_run, config):
    tag_dir = ds_run(config) / "global_step7"
    key = "fp32_flat_groups" if config.stage == 3 else "single_partition_of_fp32_groups"
    with DeepSpeedReader(tag_dir) as reader:
        optim_files = set(reader._optim_files)
        trainable = [e for e in reader._entries.values() if e.kind == "param"]
        assert trainable
        for entry in trainable:
            for piece in entry.pieces:
                assert piece.file in optim_files, entry.spec.name
                # the bytes at the recorded place are the mapped tensor's (same file, same offset)
                got = torch.empty(piece.length, dtype=piece.src.dtype)
                reader._gather(entry, piece.dst, piece.dst + piece.length, got)
                assert torch.equal(got, piece.src[piece.start : piece.start + piece.length])
        ranges = [(p, o, n) for p, o, n in reader.data_ranges() if p in optim_files]
        # ... every element of every parameter, once
        assert sum(n for _, _, n in ranges) == sum(
            p.length * p.src.element_size() for e in trainable for p in e.pieces
        )
        for path in optim_files:
            state, releasable = load_ds_file_releasable(path)
            assert releasable
            offsets = storage_file_offsets(path, state)
            assert offsets is not None
            osd = state["optimizer_state_dict"]
            masters = {t.untyped_storage().data_ptr() for t in osd[key]}
            moments = [t for t in _tensors(osd) if t.untyped_storage().data_ptr() not in masters]
            assert moments  # AdamW: exp_avg and exp_avg_sq per group
            mine = [(o, o + n) for p, o, n in ranges if p == path]
            flats = [(offsets[t.untyped_storage().data_ptr()], t.untyped_storage().nbytes()) for t in osd[key]]
            # inside the fp32 partitions (stage-3 padding at a rank's end is not read) ...
            assert all(any(s <= a and b <= s + n for s, n in flats) for a, b in mine)
            for t in moments:
                lo = offsets[t.untyped_storage().data_ptr()]
                hi = lo + t.untyped_storage().nbytes()
                assert all(b <= lo or a >= hi for a, b in mine), "a range covers an Adam moment"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def test_storage_offsets_are_the_zip_members_and_a_foreign_state_is_refused(tmp_path):
    a = torch.randn(64, 8)
    _write_stage2(tmp_path / "global_step1", a)
    path = tmp_path / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state, releasable = load_ds_file_releasable(path)
    offsets = storage_file_offsets(path, state)
    assert releasable and offsets is not None
    assert sorted(offsets.values()) == sorted(o for o, n in _member_offsets(path).values() if n)
    other, _ = load_ds_file_releasable(path.with_name("zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    other["optimizer_state_dict"]["extra"] = torch.zeros(3)  # a storage that is no member of `path`
    assert storage_file_offsets(path, other) is None
    assert storage_file_offsets(path, {"no": "tensors"}) is None


def test_a_file_cut_short_after_opening_is_a_format_error_naming_it(tmp_path):
    a = torch.randn(1024, 256)  # 1 MiB, 512 KiB per rank
    tag = tmp_path / "global_step1"
    _write_stage2(tag, a)
    victim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open_checkpoint(tag) as reader:
        assert torch.equal(_full(reader, "a"), a)
        (entry,) = [e for e in reader._entries.values() if e.kind == "param"]
        start = min(p.file_start for p in entry.pieces if p.file == victim)
        with victim.open("r+b") as fh:
            fh.truncate(start + 1000)  # mid-partition: reading the mapping there would be SIGBUS
        with pytest.raises(CheckpointFormatError, match="changed while being read") as err:
            _full(reader, "a")
        assert err.value.path == str(victim) and "\n" not in str(err.value)


def test_a_file_replaced_after_opening_is_read_as_it_was_opened(tmp_path):
    a, b = torch.randn(64, 16), torch.randn(64, 16)
    tag, other = tmp_path / "global_step1", tmp_path / "other"
    _write_stage2(tag, a)
    _write_stage2(other, b)
    with open_checkpoint(tag) as reader:
        for f in other.iterdir():
            f.replace(tag / f.name)  # a new save renamed over the open one
        assert torch.equal(_full(reader, "a"), a)
    with open_checkpoint(tag) as reader:
        assert torch.equal(_full(reader, "a"), b)


def test_legacy_torch_save_files_are_read_through_the_mapping(tmp_path):
    a = torch.randn(32, 6)
    tag = tmp_path / "global_step1"
    _write_stage2(tag, a, legacy=True)
    with open_checkpoint(tag) as reader:
        (entry,) = [e for e in reader._entries.values() if e.kind == "param"]
        assert all(p.file is None for p in entry.pieces)
        assert torch.equal(_full(reader, "a"), a)
        assert torch.equal(reader.read("a", Box((3, 1), (5, 4))), a[3:8, 1:5])
        assert [p.name for p, _, _ in reader.data_ranges()] == ["mp_rank_00_model_states.pt"]
