"""Hugging Face safetensors reader: fixtures written by the real ``safetensors.torch.save_file``."""

from __future__ import annotations

import json
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ema_ckpt.errors import CheckpointFormatError, CheckpointNotFoundError
from ema_ckpt.formats import detect_format, open_checkpoint, registered_formats
from ema_ckpt.formats.safetensors.reader import SafetensorsReader, read_header
from ema_ckpt.layout import Box, TensorSpec


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(7, 5, generator=g),
        "model.layers.0.attn.weight": torch.randn(4, 3, 2, generator=g).to(torch.bfloat16),
        "model.layers.0.norm.weight": torch.randn(6, generator=g).to(torch.float16),
        "model.pos_ids": torch.randint(-(2**40), 2**40, (3, 4), generator=g),
        "model.mask": torch.randint(0, 2, (5, 2), generator=g).bool(),
        "model.scale": torch.tensor(0.25),
        "model.empty": torch.zeros(0, 3),
        "model.bytes": torch.randint(0, 256, (9,), generator=g).to(torch.uint8),
        "model.fp8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
    }


def _save_sharded(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """Shards plus an index laid out the way ``save_pretrained`` writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return _tensors()


@pytest.fixture
def single(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder = tmp_path / "checkpoint-100"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture
def sharded(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    return _save_sharded(tmp_path / "checkpoint-200", tensors, shards=3)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality, also for dtypes ``torch.equal`` lacks (float8)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _assert_reads_back(reader: SafetensorsReader, tensors: dict[str, torch.Tensor]) -> None:
    assert set(reader.specs()) == set(tensors)
    for key, expected in tensors.items():
        spec = reader.specs()[key]
        assert spec == TensorSpec(key, tuple(expected.shape), expected.dtype)
        assert _same_bits(reader.read(key, Box.full(spec.shape)), expected), key


# -- reading ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["folder", "file", "sharded"])
def test_specs_and_whole_reads(
    layout: str, single: Path, sharded: Path, tensors: dict[str, torch.Tensor]
) -> None:
    path = {"folder": single, "file": single / "model.safetensors", "sharded": sharded}[layout]
    with open_checkpoint(path) as reader:
        assert isinstance(reader, SafetensorsReader)
        assert reader.format_name == "safetensors"
        assert list(reader.specs()) == sorted(tensors)
        _assert_reads_back(reader, tensors)


def test_plain_dtypes_compare_with_torch_equal(single: Path, tensors: dict[str, torch.Tensor]) -> None:
    with SafetensorsReader(single) as reader:
        for key in ["model.embed.weight", "model.layers.0.attn.weight", "model.layers.0.norm.weight",
                    "model.pos_ids", "model.mask", "model.scale", "model.empty"]:  # fmt: skip
            assert torch.equal(reader.read(key, Box.full(reader.specs()[key].shape)), tensors[key])


def test_layout_is_one_chunk_per_tensor(single: Path) -> None:
    with SafetensorsReader(single) as reader:
        assert reader.layout("model.embed.weight") == [Box((0, 0), (7, 5))]
        assert reader.layout("model.scale") == [Box((), ())]
        assert reader.layout("model.empty") == []  # zero-volume boxes are omitted


def test_read_returns_owned_contiguous_copy(single: Path, tensors: dict[str, torch.Tensor]) -> None:
    with SafetensorsReader(single) as reader:
        part = reader.read("model.embed.weight", Box((2, 1), (3, 2)))
        assert part.is_contiguous()
        assert part.untyped_storage().nbytes() == part.nbytes
        assert torch.equal(part, tensors["model.embed.weight"][2:5, 1:3])
        part.fill_(0)
        again = reader.read("model.embed.weight", Box((2, 1), (3, 2)))
        assert torch.equal(again, tensors["model.embed.weight"][2:5, 1:3])
        scalar = reader.read("model.scale", Box((), ()))
        assert scalar.shape == () and scalar.item() == 0.25
        assert reader.read("model.embed.weight", Box((7, 0), (0, 5))).shape == (0, 5)


def test_read_rejects_boxes_outside_the_tensor(single: Path) -> None:
    with SafetensorsReader(single) as reader:
        with pytest.raises(ValueError, match="outside"):
            reader.read("model.embed.weight", Box((5, 0), (3, 5)))
        with pytest.raises(ValueError, match="outside"):
            reader.read("model.embed.weight", Box((0,), (7,)))
        with pytest.raises(KeyError):
            reader.read("nope", Box((), ()))


def test_few_files_open_and_threads(sharded: Path, tensors: dict[str, torch.Tensor]) -> None:
    with SafetensorsReader(sharded) as reader:
        keys = sorted(tensors) * 20

        def read(key: str) -> bool:
            return _same_bits(reader.read(key, Box.full(reader.specs()[key].shape)), tensors[key])

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(read, keys))
        assert len(reader._readables) <= len(reader.headers)
    assert not reader._readables


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
           torch.int8, torch.uint8, torch.bool]  # fmt: skip


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


@st.composite
def _tensor_and_boxes(draw: st.DrawFn) -> tuple[torch.Tensor, list[Box]]:
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    tensor = _random(shape, draw(st.sampled_from(_DTYPES)), draw(st.integers(0, 2**31)))
    boxes = []
    for _ in range(draw(st.integers(1, 4))):
        offsets, sizes = [], []
        for dim in shape:
            start = draw(st.integers(0, dim))
            offsets.append(start)
            sizes.append(draw(st.integers(0, dim - start)))
        boxes.append(Box(tuple(offsets), tuple(sizes)))
    return tensor, boxes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_tensor_and_boxes(), st.booleans())
def test_any_box_matches_slicing(case: tuple[torch.Tensor, list[Box]], shard: bool) -> None:
    tensor, boxes = case
    saved = {"x": tensor, "other": torch.arange(3.0)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        if shard:
            _save_sharded(folder, saved)
        else:
            folder.mkdir()
            save_file(saved, str(folder / "model.safetensors"))
        with open_checkpoint(folder) as reader:
            assert reader.specs()["x"] == TensorSpec("x", tuple(tensor.shape), tensor.dtype)
            for box in boxes:
                got = reader.read("x", box)
                expected = tensor[box.slices()]
                assert got.shape == expected.shape and got.dtype == expected.dtype
                assert torch.equal(got, expected)


# -- metadata -----------------------------------------------------------------------


def test_info(single: Path, sharded: Path, tensors: dict[str, torch.Tensor]) -> None:
    with SafetensorsReader(single) as reader:
        info = reader.info()
        assert info["files"] == 1 and info["indexed"] is False
        assert info["total_bytes"] == (single / "model.safetensors").stat().st_size
        assert info["metadata"] == {"format": "pt"}
        assert info["tensors"] == len(tensors)
        assert info["dtypes"]["float32"] == 3 and info["dtypes"]["bfloat16"] == 1
        json.dumps(info)
    with SafetensorsReader(sharded) as reader:
        info = reader.info()
        assert info["files"] == 3 and info["indexed"] is True
        assert info["total_bytes"] == sum(p.stat().st_size for p in sharded.glob("*.safetensors"))
        assert info["index_metadata"]["total_size"] > 0
        assert info["metadata"] == {"format": "pt"}


def test_step_from_trainer_state(single: Path) -> None:
    with SafetensorsReader(single) as reader:
        assert reader.step is None
    (single / "trainer_state.json").write_text(json.dumps({"global_step": 100, "epoch": 1.0}))
    with SafetensorsReader(single) as reader:
        assert reader.step == 100
    (single / "trainer_state.json").write_text("{not json")
    with SafetensorsReader(single) as reader:
        assert reader.step is None


# -- detection ----------------------------------------------------------------------


def test_registered_and_detected(single: Path, sharded: Path) -> None:
    fmt = registered_formats()["safetensors"]
    for path in [single, single / "model.safetensors", sharded, sharded / "model.safetensors.index.json"]:
        assert detect_format(path) is fmt, path
        assert fmt.incomplete(path) is None


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "diffusion_pytorch_model.safetensors"])
def test_folder_with_one_other_safetensors_file(tmp_path: Path, name: str) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / name))
    (tmp_path / "adapter_config.json").write_text("{}")
    assert detect_format(tmp_path) is not None
    with open_checkpoint(tmp_path) as reader:
        assert list(reader.specs()) == ["w"]


def test_folder_with_one_other_index(tmp_path: Path) -> None:
    _save_sharded(tmp_path, {"a": torch.ones(2), "b": torch.zeros(3)})
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    (tmp_path / "model.safetensors.index.json").rename(index)
    with open_checkpoint(tmp_path) as reader:
        assert reader.info()["index"] == "diffusion_pytorch_model.safetensors.index.json"
        assert sorted(reader.specs()) == ["a", "b"]


def test_model_safetensors_wins_over_other_files(single: Path) -> None:
    save_file({"lora": torch.ones(2)}, str(single / "adapter_model.safetensors"))
    with open_checkpoint(single) as reader:
        assert "lora" not in reader.specs()


def test_ambiguous_or_empty_folders_are_not_detected(tmp_path: Path) -> None:
    assert detect_format(tmp_path) is None
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    assert detect_format(tmp_path) is None
    with pytest.raises(CheckpointNotFoundError):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        SafetensorsReader(tmp_path)


def test_missing_shard_is_incomplete(sharded: Path) -> None:
    (sharded / "model-00002-of-00003.safetensors").unlink()
    fmt = registered_formats()["safetensors"]
    reason = fmt.incomplete(sharded)
    assert reason is not None and "model-00002-of-00003.safetensors" in reason
    assert detect_format(sharded) is None
    with pytest.raises(CheckpointNotFoundError, match="model-00002-of-00003"):
        open_checkpoint(sharded)
    with pytest.raises(CheckpointNotFoundError, match="model-00002-of-00003"):
        SafetensorsReader(sharded)


def test_shards_without_index_are_incomplete(sharded: Path) -> None:
    (sharded / "model.safetensors.index.json").unlink()
    for shard in ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]:
        assert registered_formats()["safetensors"].incomplete(sharded) is not None
        assert detect_format(sharded) is None
        (sharded / shard).unlink()  # down to one lone shard: still not a whole checkpoint
    with pytest.raises(CheckpointNotFoundError, match=r"no .*index"):
        open_checkpoint(sharded)


# -- corrupt files ------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 5, 20, -1])
def test_truncated_file_names_the_file(single: Path, keep: int) -> None:
    file = single / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:keep])
    with pytest.raises(CheckpointFormatError, match="truncated") as err:
        open_checkpoint(single)
    assert str(file) in str(err.value) and err.value.path == str(file)


def test_truncated_shard_names_the_shard(sharded: Path) -> None:
    shard = sharded / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(CheckpointFormatError, match="truncated") as err:
        SafetensorsReader(sharded)
    assert err.value.path == str(shard)


def _write_raw(file: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 6, "2 bytes after"),
        (
            {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
             "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}},
            b"\0" * 6,
            "overlaps",
        ),
        ({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", "not supported"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "bad shape"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "bad data_offsets"),
        ({"__metadata__": {"format": 1}}, b"", "__metadata__"),
    ],
)
def test_bad_headers(tmp_path: Path, header: dict, data: bytes, match: str) -> None:
    file = tmp_path / "model.safetensors"
    _write_raw(file, header, data)
    with pytest.raises(CheckpointFormatError, match=match) as err:
        read_header(file)
    assert err.value.path == str(file)


def test_header_not_json(tmp_path: Path) -> None:
    file = tmp_path / "x.safetensors"
    file.write_bytes(struct.pack("<Q", 4) + b"{oop")
    with pytest.raises(CheckpointFormatError, match="not JSON") as err:
        open_checkpoint(file)
    assert err.value.path == str(file)


def test_bad_index_names_the_index(sharded: Path) -> None:
    index = sharded / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(CheckpointFormatError, match="not a JSON") as err:
        open_checkpoint(sharded)
    assert err.value.path == str(index)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointFormatError, match="weight_map") as err:
        open_checkpoint(sharded)
    assert err.value.path == str(index)
    index.write_text(json.dumps({"weight_map": {"a": "../model.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="not a file in this folder"):
        open_checkpoint(sharded)


def test_index_key_missing_from_its_shard(sharded: Path) -> None:
    index = sharded / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.ghost"] = "model-00001-of-00003.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError, match=r"model\.ghost") as err:
        open_checkpoint(sharded)
    assert err.value.path == str(index)
    assert str(sharded / "model-00001-of-00003.safetensors") in str(err.value)


def test_shard_key_the_index_does_not_list(sharded: Path) -> None:
    index = sharded / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    del doc["weight_map"]["model.scale"]
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError, match="does not list it") as err:
        open_checkpoint(sharded)
    assert err.value.path == str(index)


def test_file_replaced_after_open(single: Path) -> None:
    with SafetensorsReader(single) as reader:
        save_file({"model.embed.weight": torch.ones(2)}, str(single / "model.safetensors"))
        with pytest.raises(CheckpointFormatError, match="changed"):
            reader.read("model.embed.weight", Box((0, 0), (1, 1)))


def test_file_deleted_after_open(single: Path) -> None:
    with SafetensorsReader(single) as reader:
        (single / "model.safetensors").unlink()
        with pytest.raises(CheckpointNotFoundError, match="vanished"):
            reader.read("model.embed.weight", Box((0, 0), (1, 1)))
