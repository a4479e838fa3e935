"""Every registered output format, through the engine, read back by its own format's loader.

The source is written by torch's ``dcp.save``; each output is read by the library its format
belongs to (safetensors, ``torch.load``, torch's ``dcp.load``), never by ema-ckpt. A format
registered later without a case here fails :func:`test_every_registered_output_has_a_case`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ema_ckpt
from ema_ckpt.writers.base import output_format_for, registered_outputs


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(300, 40, generator=g),
        "half": torch.randn(17, generator=g).bfloat16(),
        "count": torch.tensor(11),
        "empty": torch.empty(0, 3),
        "cube": torch.arange(60, dtype=torch.int32).reshape(3, 4, 5),
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "ck"
    dcp.save({"model": _state()}, checkpoint_id=str(path), no_dist=True)
    return path


def _load_safetensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out))


def _load_sharded(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(str(out / shard)))
    assert set(loaded) == set(index["weight_map"])
    return loaded


def _load_torch(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out, weights_only=True)


def _load_dcp(out: Path) -> dict[str, torch.Tensor]:
    like = {f"model.{k}": torch.empty_like(v) for k, v in _state().items()}
    dcp.load(like, checkpoint_id=str(out), no_dist=True)
    return {k.removeprefix("model."): v for k, v in like.items()}


def _consolidate(name: str, **options: object) -> Callable[[Path, Path, int], Path]:
    def make(src: Path, tmp: Path, workers: int) -> Path:
        out = tmp / f"w{workers}" / name
        ema_ckpt.consolidate(src, out, workers=workers, **options)  # type: ignore[arg-type]
        return out

    return make


def _load_lightning(path: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(path, weights_only=True)  # a source without trainer state: plain entries only
    assert set(checkpoint) == {"state_dict", "pytorch-lightning_version"}
    return checkpoint["state_dict"]


def _reshard(src: Path, tmp: Path, workers: int) -> Path:
    out = tmp / f"w{workers}" / "dcp-3"
    ema_ckpt.reshard(src, world_size=3, out=out, workers=workers)
    return out


CASES: dict[str, tuple[Callable[[Path, Path, int], Path], Callable[[Path], dict[str, torch.Tensor]]]] = {
    "safetensors": (_consolidate("model.safetensors"), _load_safetensors),
    "hf-sharded": (_consolidate("hf", format="hf-sharded", max_shard_size="20KB"), _load_sharded),
    "torch": (_consolidate("model.pt"), _load_torch),
    "lightning": (_consolidate("model.ckpt"), _load_lightning),
    "dcp": (_reshard, _load_dcp),
}


def test_every_registered_output_has_a_case():
    assert set(registered_outputs()) == set(CASES)


def _tree(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_format_loads_what_was_written_and_the_bytes_do_not_depend_on_workers(name, source, tmp_path):
    make, load = CASES[name]
    out = make(source, tmp_path, 1)
    loaded = load(out)
    expected = _state()
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert _tree(make(source, tmp_path, 2)) == _tree(out)


@pytest.mark.parametrize("name", ["safetensors", "torch", "hf-sharded"])
def test_a_cast_changes_floats_only(name, source, tmp_path):
    _make, load = CASES[name]
    suffix = {"safetensors": "model.safetensors", "torch": "model.pt", "hf-sharded": "hf"}[name]
    out = tmp_path / suffix
    ema_ckpt.consolidate(source, out, format=name, dtype="float16",
                         max_shard_size="20KB" if name == "hf-sharded" else None)
    loaded = load(out)
    for key, value in _state().items():
        want = value.to(torch.float16) if value.is_floating_point() else value
        assert loaded[key].dtype == want.dtype and torch.equal(loaded[key], want), key


def test_output_paths_choose_their_format():
    assert output_format_for("a/model.safetensors").name == "safetensors"
    assert output_format_for("a/model.PT").name == "torch"
    assert output_format_for("a/model.bin").name == "torch"
    assert output_format_for("a/hf-out").name == "hf-sharded"


@pytest.mark.parametrize("apart", [False, True], ids=["in-process", "child-process"])
def test_a_written_safetensors_file_is_checked_with_safetensors_own_loader(tmp_path, monkeypatch, apart):
    """Large headers are checked in a child process (the loader's memory never adds to the
    run's peak); both ways give safetensors' own verdict."""
    import struct

    from safetensors.torch import save_file

    from ema_ckpt.errors import CheckpointFormatError
    from ema_ckpt.formats.safetensors import writer

    if apart:
        monkeypatch.setattr(writer, "_CHECK_APART_HEADER_BYTES", 0)
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.ones(3), "b": torch.zeros(2, 2)}, str(good))
    (length,) = struct.unpack("<Q", good.read_bytes()[:8])
    writer._check_loads(good, length)
    bad = tmp_path / "bad.safetensors"
    data = bytearray(good.read_bytes())
    data[8:8 + length] = data[8:8 + length].replace(b'"b"', b'"a"')  # a duplicate key
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match="does not load in safetensors"):
        writer._check_loads(bad, length)
