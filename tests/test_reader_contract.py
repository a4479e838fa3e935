"""Every registered reader, over real checkpoints, against the whole reader contract.

Checkpoints come from their producers, never from ema-ckpt's own writers: torch's
``dcp.save`` and ``torch.save``, the safetensors library, DeepSpeed (``tests/ds_fixtures.py``)
and the trainers' committed layouts (``tests/fixtures/trainers/``). A format registered
later without a case here fails :func:`test_every_registered_format_has_a_case`.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ema_ckpt.discovery import discover
from ema_ckpt.dtypes import name_of
from ema_ckpt.errors import EmaCkptError
from ema_ckpt.formats import (
    CheckpointReader,
    detect_format,
    locate_model,
    open_checkpoint,
    registered_formats,
)
from ema_ckpt.layout import Box, boxes_cover
from tests.ds_fixtures import Config

TRAINERS = Path(__file__).parent / "fixtures" / "trainers"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),
        "b": torch.randn(5, generator=g).bfloat16(),
        "n": torch.tensor(7),
        "e": torch.empty(0, 3),
        "m": torch.arange(24, dtype=torch.int32).reshape(2, 3, 4),
    }


def _dcp(tmp: Path) -> Path:
    state = _state()
    dcp.save({"model": state, "optim": {"lr": torch.tensor(0.1)}, "extra": {"note": "x"}},
             checkpoint_id=str(tmp / "ck"), no_dist=True)
    return tmp / "ck"


def _safetensors(tmp: Path) -> Path:
    from safetensors.torch import save_file

    (tmp / "st").mkdir()
    save_file(_state(), str(tmp / "st" / "model.safetensors"))
    return tmp / "st"


def _torch_file(tmp: Path) -> Path:
    state = _state()
    torch.save({"model": {**state, "t": state["w"].t()}, "step": 3}, tmp / "m.pt")
    return tmp / "m.pt"


_EPOCHS = {"research-mae", "timm-saver"}
"""Sets whose files record epochs only (read with ``step_from='epoch'``)."""


def _trainer(name: str) -> Callable[[Path], Path]:
    def make(_tmp: Path) -> Path:
        """The first checkpoint (a component of it, where it holds several) its producer recorded."""
        root = TRAINERS / name
        for rel in sorted(json.loads((root / "producer.json").read_text())["checkpoints"]):
            try:
                found = discover([root / rel], all_components=True, step_from="epoch" if name in _EPOCHS else None)
            except EmaCkptError:
                continue
            for checkpoint in found.checkpoints:
                for part in [c.path for c in checkpoint.components] or [checkpoint.path]:
                    try:
                        open_checkpoint(part).close()
                    except EmaCkptError:  # refused whole (mmengine's pickled getattr): no reader to check
                        continue
                    return part
        pytest.skip(f"no checkpoint in {root} that ema-ckpt reads")

    return make


CASES: dict[str, Callable[[Path], Path]] = {
    "dcp-torch-save": _dcp,
    "safetensors": _safetensors,
    "torch-file": _torch_file,
    **{f"trainer-{p.name}": _trainer(p.name) for p in sorted(TRAINERS.iterdir()) if p.is_dir()},
}


@pytest.fixture(params=[*CASES, "deepspeed-zero3", "deepspeed-zero1"])
def checkpoint(request, tmp_path):
    if request.param.startswith("deepspeed"):
        stage = 3 if request.param.endswith("3") else 1
        return request.getfixturevalue("ds_run")(Config(2, stage, "bf16")) / "global_step2"
    return CASES[request.param](tmp_path)


def _full(reader: CheckpointReader, key: str) -> torch.Tensor:
    return reader.read(key, Box.full(reader.specs()[key].shape))


def test_every_registered_format_has_a_case(tmp_path, ds_run):
    seen = set()
    for name, make in CASES.items():
        (tmp_path / name).mkdir()
        try:
            seen.add(detect_format(make(tmp_path / name)).name)
        except pytest.skip.Exception:
            continue
    seen.add(detect_format(ds_run(Config(2, 3, "bf16")) / "global_step2").name)
    assert set(registered_formats()) <= seen


def test_specs_layout_and_reads(checkpoint):
    fmt = detect_format(checkpoint)
    with open_checkpoint(checkpoint) as reader:
        assert isinstance(reader, CheckpointReader) and reader.format_name == fmt.name
        specs = reader.specs()
        assert specs and reader.stored() == {k: (s.shape, name_of(s.dtype)) for k, s in specs.items()}
        for key, spec in specs.items():
            boxes = list(reader.layout(key))
            assert all(b.numel > 0 for b in boxes)
            if spec.numel:
                assert boxes_cover(spec.shape, boxes), key
            assert [c.box for c in reader.chunks(key)] == boxes or sorted(
                c.box.offsets for c in reader.chunks(key)) == sorted(b.offsets for b in boxes)
            full = _full(reader, key)
            assert tuple(full.shape) == spec.shape and full.dtype == spec.dtype
            for box in boxes:
                part = reader.read(key, box)
                assert torch.equal(part, full[box.slices()] if box.sizes else full), (key, box)
            if spec.numel:
                out = torch.full(spec.shape, 1, dtype=spec.dtype)
            else:
                out = torch.empty(spec.shape, dtype=spec.dtype)
            assert reader.read(key, Box.full(spec.shape), out=out) is out
            assert torch.equal(out, full)
            # a caller's buffer stays plain data, even when the saved tensor required grad
            assert not out.requires_grad and out.grad_fn is None and not part.requires_grad, key
            ranges = reader.byte_ranges(key)
            if ranges is not None:
                data = b"".join(reader.open_data(f).pread(n, o) for f, o, n in ranges if n)
                assert data == full.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert reader.root_of(key) is None or isinstance(reader.root_of(key), str)
            assert reader.container_of(key) is None or isinstance(reader.container_of(key), str)
        for key in reader.non_tensor_keys:
            assert isinstance(reader.read_bytes(key), bytes)
        for file, offset, length in reader.stored_records():
            with reader.open_record(file, offset, length) as record:
                assert zipfile.is_zipfile(record)
        assert isinstance(reader.info(), dict)
    reader.close()  # a second close does nothing


def test_step_of_is_the_readers_step(checkpoint):
    fmt = detect_format(checkpoint)
    with open_checkpoint(checkpoint) as reader:
        assert fmt.step_of(locate_model(checkpoint).path) == reader.step
        assert type(reader).step_of(reader.path) == reader.step


def test_share_and_reopen(checkpoint):
    with open_checkpoint(checkpoint) as reader:
        shared = reader.share()
        if shared is None:
            return
        with open_checkpoint(checkpoint, shared=pickle.loads(pickle.dumps(shared))) as again:
            assert type(again) is type(reader) and again.specs() == reader.specs()
            for key in reader.specs():
                assert list(again.layout(key)) == list(reader.layout(key))
                assert torch.equal(_full(again, key), _full(reader, key))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_box_reads_the_slice_of_the_full_tensor(checkpoint, data):
    with open_checkpoint(checkpoint) as reader:
        specs = reader.specs()
        key = data.draw(st.sampled_from(sorted(specs)))
        shape = specs[key].shape
        offsets = [data.draw(st.integers(0, d)) for d in shape]
        sizes = [data.draw(st.integers(0, d - o)) for o, d in zip(offsets, shape, strict=True)]
        box = Box(tuple(offsets), tuple(sizes))
        full = _full(reader, key)
        part = reader.read(key, box)
        assert torch.equal(part, full[box.slices()] if box.sizes else full)
