"""One look for checkpoints in object storage costs a listing, not requests per checkpoint kept.

``watch`` on object storage looks at the folder every interval; each look must cost a small
constant (one recursive listing) plus requests only for checkpoints it has not seen before
(``trainer_state.json`` of a new Hugging Face checkpoint), never requests per checkpoint kept.
Counted at a loopback proxy in front of moto's S3 server (the ``s3`` fixture of
:mod:`tests.test_object_storage`); the answers must stay those of asking the store one
question at a time, and a listing must never hide what a later look would find.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from ema_ckpt import discovery
from ema_ckpt.discovery import discover
from ema_ckpt.errors import CheckpointNotFoundError
from ema_ckpt.storage import object_clients, object_listings
from ema_ckpt.watching import stage_new
from tests import test_object_storage
from tests.dcp_helpers import write_dcp
from tests.object_stores import Faults, fault_proxy
from tests.test_object_storage import BUCKET, upload

s3 = test_object_storage.s3  # the moto server (module-scoped fixture)

boto3 = pytest.importorskip("boto3")

TRAINERS = Path(__file__).resolve().parent / "fixtures" / "trainers"
LISTING = 1
"""Requests of one look at a folder of a few objects: one LIST."""


def _put(key: str, body: bytes) -> None:
    boto3.client("s3").put_object(Bucket=BUCKET, Key=key, Body=body)


def _hf(prefix: str, step: int, *, finished: bool = True) -> None:
    """A Hugging Face Trainer checkpoint: the model, the Trainer's own files, ``trainer_state.json`` last."""
    key = f"{prefix}/checkpoint-{step}"
    _put(f"{key}/model.safetensors", save({"w": torch.full((4, 4), float(step))}))
    _put(f"{key}/optimizer.pt", b"x")
    if finished:
        _put(f"{key}/trainer_state.json", json.dumps({"global_step": step}).encode())


def _dcp(prefix: str, step: int, tmp_path: Path, *, finished: bool = True) -> None:
    local = write_dcp(tmp_path / f"dcp-{uuid.uuid4().hex[:6]}", {"model.w": torch.full((4,), float(step))})
    if not finished:
        (local / ".metadata").unlink()
    upload(local, f"{prefix}/step_{step}")


@contextlib.contextmanager
def _counted(endpoint: str) -> Iterator[Faults]:
    """S3 clients go through a counting proxy while inside."""
    faults = Faults()
    proxy, proxied = fault_proxy(endpoint, faults)
    os.environ["AWS_ENDPOINT_URL"] = proxied
    object_clients.forget_clients()
    try:
        yield faults
    finally:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        object_clients.forget_clients()
        proxy.shutdown()


def _look(url: str, faults: Faults) -> tuple[int, discovery.Discovery]:
    before = faults.requests
    found = discover([url], require=False)
    return faults.requests - before, found


@pytest.mark.parametrize("kind", ["hf", "dcp"])
def test_a_look_costs_one_listing_plus_requests_for_new_checkpoints_only(s3, tmp_path, kind):
    """First look: one listing, and for each Hugging Face checkpoint its ``trainer_state.json``
    (DCP: nothing more); every later look: the listing alone, however many checkpoints are kept.
    Before, a look cost 4 (HF) or 7 (DCP) requests per checkpoint, at every look."""
    for n in (1, 2, 4):
        prefix = f"requests-{kind}-{n}-{uuid.uuid4().hex[:6]}"
        for i in range(n):
            if kind == "hf":
                _hf(prefix, 100 * (i + 1))
            else:
                _dcp(prefix, 100 * (i + 1), tmp_path)
        url = f"s3://{BUCKET}/{prefix}"
        object_listings.forget_small_files()
        with _counted(s3) as faults:
            first, found = _look(url, faults)
            again, found_again = _look(url, faults)
            assert len(stage_new(url, incoming=tmp_path / f"in-{n}-{kind}")) == n
            before = faults.requests
            assert stage_new(url, incoming=tmp_path / f"in-{n}-{kind}") == []  # watch's look: all staged
            watch_look = faults.requests - before
        assert [c.step for c in found.checkpoints] == [100 * (i + 1) for i in range(n)], found.notes
        assert [c.step for c in found_again.checkpoints] == [100 * (i + 1) for i in range(n)]
        new_ones = n if kind == "hf" else 0  # trainer_state.json, read once per version
        assert first == LISTING + new_ones, (n, first)
        assert again == LISTING, (n, again)
        assert watch_look == LISTING, (n, watch_look)


def test_a_later_look_sees_what_changed_since_the_last(s3, tmp_path):
    """A save finished, a new one, a rewritten ``trainer_state.json`` and a deletion are each
    seen at the next look: nothing is answered from an earlier look's listing."""
    prefix = f"requests-changes-{uuid.uuid4().hex[:6]}"
    url = f"s3://{BUCKET}/{prefix}"
    _hf(prefix, 100)
    _hf(prefix, 200, finished=False)
    _dcp(prefix, 300, tmp_path, finished=False)
    with _counted(s3) as faults:
        _, found = _look(url, faults)
        assert [c.step for c in found.checkpoints] == [100]
        waiting = {Path(str(e.path)).name: e.why for e in found.entries if not e.taken}
        assert "trainer_state.json" in waiting["checkpoint-200"] and ".metadata" in waiting["step_300"], waiting

        _put(f"{prefix}/checkpoint-200/trainer_state.json", json.dumps({"global_step": 200}).encode())
        _dcp(prefix, 300, tmp_path)
        _hf(prefix, 400)
        _put(f"{prefix}/checkpoint-100/trainer_state.json", json.dumps({"global_step": 150}).encode())
        cost, found = _look(url, faults)
        assert [c.step for c in found.checkpoints] == [150, 200, 300, 400], found.notes
        assert cost == LISTING + 3, cost  # the two trainer_state.json new, and the one rewritten

        boto3.client("s3").delete_objects(Bucket=BUCKET, Delete={"Objects": [
            {"Key": f"{prefix}/checkpoint-400/trainer_state.json"},
            {"Key": f"{prefix}/checkpoint-400/model.safetensors"},
            {"Key": f"{prefix}/checkpoint-400/optimizer.pt"}]})
        cost, found = _look(url, faults)
        assert [c.step for c in found.checkpoints] == [150, 200, 300] and cost == LISTING, (found.notes, cost)


def _entries(found: discovery.Discovery) -> list[tuple[str, bool, str, int | None, str | None]]:
    return [(str(e.path), e.taken, str(e.why), e.step, e.format_name) for e in found.entries]


def test_a_look_answers_as_asking_the_store_one_question_at_a_time(s3, tmp_path, monkeypatch):
    """A folder of every kind (HF safetensors, the Trainer's FSDP and DeepSpeed saves, DCP,
    saves in progress, an ema-ckpt output, a stray file, accelerate's ``checkpoints/``): the
    entries, notes and checkpoints found from one listing are those found request by request."""
    prefix = f"requests-same-{uuid.uuid4().hex[:6]}"
    url = f"s3://{BUCKET}/{prefix}"
    _hf(prefix, 100)
    _hf(prefix, 250, finished=False)
    _dcp(prefix, 300, tmp_path)
    _dcp(prefix, 400, tmp_path, finished=False)
    upload(TRAINERS / "hf-trainer-fsdp" / "ckpts" / "checkpoint-2", f"{prefix}/checkpoint-2")
    upload(TRAINERS / "hf-trainer-zero2-bf16" / "ckpts" / "checkpoint-4", f"{prefix}/checkpoint-4")
    _dcp(prefix, 500, tmp_path)
    _put(f"{prefix}/step_500/ema-ckpt.json", b"{}")
    _put(f"{prefix}/notes.txt", b"hello")
    _put(f"{prefix}/deep/a/b/c.txt", b"x")
    accelerate = f"{prefix}-accelerate"
    upload(TRAINERS / "accelerate-fsdp2" / "ckpts", accelerate)

    for where in (url, f"s3://{BUCKET}/{accelerate}"):
        object_listings.forget_small_files()
        found = discover([where], require=False, step_regex=None)
        assert found.checkpoints or where == url
        monkeypatch.setattr(discovery, "one_look", lambda path: contextlib.nullcontext())
        asked = discover([where], require=False)
        monkeypatch.undo()
        assert _entries(found) == _entries(asked)
        assert [str(n) for n in found.notes] == [str(n) for n in asked.notes]
        assert found.checkpoints == asked.checkpoints
    assert [c.step for c in discover([url], require=False).checkpoints] == [2, 4, 100, 300]


def test_a_missing_folder_or_a_single_object_is_looked_at_as_before(s3):
    """Nothing under the path: the store is asked as usual (a missing checkpoint is exit 3, not a
    listing's empty answer); one object as the path is a checkpoint as before."""
    prefix = f"requests-single-{uuid.uuid4().hex[:6]}"
    _put(f"{prefix}/model-7.safetensors", save({"w": torch.zeros(2)}))
    found = discover([f"s3://{BUCKET}/{prefix}/model-7.safetensors"])
    assert [c.step for c in found.checkpoints] == [7]
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        discover([f"s3://{BUCKET}/{prefix}/missing"])


def test_a_listing_knows_folders_holding_only_folders_and_objects_over_folders():
    listing = object_listings.Listing("s3", "b/run", {
        "b/run/a/b/c/x": {"type": "file", "size": 1, "name": "b/run/a/b/c/x"},
        "b/run/f": {"type": "file", "size": 2, "name": "b/run/f"},
        "b/run/f/g": {"type": "file", "size": 3, "name": "b/run/f/g"},
        "b/run/empty/": {"type": "directory", "size": 0, "name": "b/run/empty/"},
        "b/runner/y": {"type": "file", "size": 1, "name": "b/runner/y"},
    })
    assert listing.children("b/run") == ["b/run/a", "b/run/empty", "b/run/f"]
    assert listing.children("b/run/a") == ["b/run/a/b"]
    assert listing.info("b/run/a/b")["type"] == "directory"  # type: ignore[index]
    assert listing.info("b/run/f")["size"] == 2  # type: ignore[index]  # an object wins, as a HEAD does
    assert listing.children("b/run/f") == ["b/run/f/g"]
    assert listing.info("b/run/empty")["type"] == "directory"  # type: ignore[index]
    assert listing.info("b/run/missing") is None and listing.children("b/run/missing") is None
    assert listing.covers("s3", "b/run/x") and not listing.covers("s3", "b/runner/y")
    assert not listing.covers("gs", "b/run/x")
