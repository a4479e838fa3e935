"""The storage seam: one protocol, the same lock / recover / publish behaviour on a local disk
and in object storage (moto's S3 server, fake-gcs-server and azurite on loopback), and the
seam's own boundaries."""

from __future__ import annotations

import ast
import re
import secrets
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ema_ckpt.errors import OutputLockedError
from ema_ckpt.storage import (
    Location,
    as_path,
    destination_for,
    discard_stagings_in,
    enclosing_folders,
    local_file,
    one_file,
    open_structure,
    output_lock,
    read_in_blocks,
    scratch_beside,
    size_without_requests,
)
from ema_ckpt.storage.roles import DATA, INDEX, MANIFEST
from tests import object_stores, test_object_storage

s3 = test_object_storage.s3  # the moto server (module-scoped fixture)
PACKAGE = Path(__file__).resolve().parents[1] / "ema_ckpt"


@pytest.fixture(scope="module")
def emulators() -> Iterator[dict[str, object_stores.Emulator]]:
    """The GCS and Azure emulators, started once for this module's conformance runs."""
    started: dict[str, object_stores.Emulator] = {}
    try:
        for protocol in ("gs", "az"):
            started[protocol] = object_stores.STARTERS[protocol]()
        yield started
    finally:
        for emulator in started.values():
            emulator.stop()


@pytest.fixture(params=["local", "s3", "gs", "az"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """Where an output goes: a local folder, or a prefix in a bucket of a real S3 server, of
    fake-gcs-server, or of azurite."""
    if request.param == "local":
        return tmp_path / "out"
    if request.param == "s3":
        request.getfixturevalue("s3")
        return as_path(f"s3://{test_object_storage.BUCKET}/conformance/{secrets.token_hex(4)}/out")
    emulator = request.getfixturevalue("emulators")[request.param]
    emulator.use()
    return as_path(emulator.url(f"conformance/{secrets.token_hex(4)}/out"))


def _files(where: Location) -> dict[str, bytes]:
    """Every file under ``where`` by its relative name, with its bytes."""
    if not where.is_dir():
        return {}
    return {str(p)[len(str(where)) + 1:]: p.read_bytes() for p in where.rglob("*") if p.is_file()}


def _build(place: Location, body: bytes, generation: str) -> tuple[object, Path, dict[str, str]]:
    """Stage one output as a run does: a data file (named with the generation where the
    destination tags data files), an index naming it, and a manifest."""
    destination = destination_for(place)
    staged = destination.stage(generation=generation)
    sink = destination.sink(staged, coordinator=True)
    data = f"__0_0.{sink.file_tag}.distcp" if sink.file_tag else "__0_0.distcp"
    (sink.directory / data).write_bytes(body)
    (sink.directory / ".metadata").write_bytes(data.encode())
    (sink.directory / "ema-ckpt.json").write_bytes(b"{}")
    sink.written([data])
    return destination, staged, {data: DATA, ".metadata": INDEX, "ema-ckpt.json": MANIFEST}


def _generation() -> str:
    return "20261203T000000-" + secrets.token_hex(3)


def test_a_published_output_is_what_was_staged_and_the_staging_is_gone(place, tmp_path):
    destination, staged, roles = _build(place, b"first", _generation())
    destination.publish(staged, roles)
    files = _files(place)
    data = next(name for name in files if name.endswith(".distcp"))
    assert files == {data: b"first", ".metadata": data.encode(), "ema-ckpt.json": b"{}"}
    assert not staged.directory.exists()
    local = local_file(place)
    if local is not None:
        assert [p.name for p in local.parent.iterdir()] == ["out"]


def test_a_new_output_replaces_the_previous_one_whole(place):
    first, staged, roles = _build(place, b"first", _generation())
    first.publish(staged, roles)
    second, staged, roles = _build(place, b"second", _generation())
    previous = set(_files(place))
    second.publish(staged, roles, replaces=lambda: previous)
    files = _files(place)
    assert sorted(files.values()) == sorted([b"second", files[".metadata"], b"{}"])
    assert files[files[".metadata"].decode()] == b"second"  # the index names the new data file


def test_a_run_killed_before_publishing_is_undone_by_the_next_and_the_output_stays(place):
    first, staged, roles = _build(place, b"first", _generation())
    first.publish(staged, roles)
    before = _files(place)
    _build(place, b"abandoned", _generation())  # staged (and its data sent on), never published
    notes = destination_for(place).recover()
    assert notes and all("interrupted run" in note for note in notes), notes
    assert _files(place) == before
    assert destination_for(place).recover() == []


def test_a_single_file_output_is_one_file_at_its_place(place):
    target = place / "model.safetensors"
    destination = destination_for(target, single_file=True)
    staged = destination.stage(generation=_generation())
    (staged.directory / "model.safetensors").write_bytes(b"weights")
    destination.publish(staged, {"model.safetensors": DATA})
    assert target.read_bytes() == b"weights"
    assert not staged.directory.exists()


def test_the_lock_is_exclusive_and_released(place):
    with output_lock(place) as held:
        held.check()
        with pytest.raises(OutputLockedError), output_lock(place, wait_seconds=0):
            pass
    with output_lock(place, wait_seconds=0) as again:
        again.check()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_what_a_place_allows_is_answered_by_the_seam(where, tmp_path, request):
    """What code above the seam asks of a place, answered without its asking where it is: a name
    for a loader that opens the file itself, links, folders to nest in, CRC-32s from the blocks
    read, a size known without requests, scratch space, stagings left, data files' own names."""
    (tmp_path / "f.bin").write_bytes(b"abc")
    (tmp_path / "snapshots" / ".s.tmp-1").mkdir(parents=True)
    local = where == "local"
    if local:
        base = tmp_path
        (tmp_path / "g.bin").hardlink_to(tmp_path / "f.bin")
    else:
        request.getfixturevalue("s3")
        base = as_path(f"s3://{test_object_storage.BUCKET}/allows/{secrets.token_hex(4)}")
        for name in ("f.bin", "g.bin"):
            (base / name).upload(tmp_path / "f.bin")
    with open_structure(base / "f.bin") as source:
        assert (source.name() == str(tmp_path / "f.bin")) if local else source.name() is None
    assert one_file(base / "f.bin", base / "g.bin") is local
    assert enclosing_folders(base / "f.bin")[:1] == ([tmp_path.resolve()] if local else [])
    assert read_in_blocks(base / "f.bin") is not local
    assert size_without_requests(base / "f.bin") == (3 if local else None)
    assert scratch_beside(base / "f.bin", "x") == (tmp_path / "x" if local else Path.cwd() / "x")
    assert destination_for(base / "out").names_kept is local
    discard_stagings_in(base / "snapshots")
    assert (tmp_path / "snapshots" / ".s.tmp-1").exists() is not local


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_nothing_outside_the_storage_package_asks_where_bytes_live():
    """Outside ``ema_ckpt.storage`` no module names the object-store types or asks whether a
    location is remote: it reads through a ``Source`` and asks it for a capability (``mapped``,
    ``fd``), or goes through the seam."""
    asking = re.compile(r"\b(is_remote|RemotePath|RemoteFile|RangedReads|LocalFile)\b")
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in _modules() if "storage" not in p.relative_to(PACKAGE).parts
             for n, line in enumerate(p.read_text().splitlines(), 1) if asking.search(line)]
    assert found == []


# where a file name is wanted: watch's own staging (hard links, local by nature); everything else
# asks its Source or the storage package for a capability
_BY_NAME = {"staging.py", "watching.py"}


def test_readers_ask_no_location_for_a_local_file():
    """Only the modules of :data:`_BY_NAME` ask a location for its local file or whether it is a
    ``Path``; the rest read through a ``Source`` (none may join them)."""
    asking = re.compile(r"\blocal_(file|path)\(|isinstance\([^)]*\bPath\)")
    found = {str(p.relative_to(PACKAGE)) for p in _modules() if "storage" not in p.relative_to(PACKAGE).parts
             and asking.search(p.read_text())}
    assert found <= _BY_NAME, sorted(found - _BY_NAME)


def test_no_path_is_cast():
    casts = re.compile(r"cast\((Path|RemotePath|Location)\b")
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in _modules()
             for n, line in enumerate(p.read_text().splitlines(), 1) if casts.search(line)]
    assert found == []


def _imported(module: Path) -> set[str]:
    """The ``ema_ckpt`` modules ``module`` imports, resolved to dotted names."""
    package = ".".join(module.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join([*base, *([node.module] if node.module else [])]))
            elif node.module and node.module.startswith("ema_ckpt"):
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("ema_ckpt"))
    return names


def test_the_storage_package_imports_nothing_above_it():
    """Storage sits under formats, writers, manifests and jobs: it imports only the error
    hierarchy, the CRC and the environment settings."""
    allowed = {"ema_ckpt.errors", "ema_ckpt._crc", "ema_ckpt._env"}
    for module in (PACKAGE / "storage").glob("*.py"):
        outside = {m for m in _imported(module) if not m.startswith("ema_ckpt.storage")}
        assert outside <= allowed, (module.name, outside - allowed)


def test_an_upload_killed_after_its_switch_is_finished_even_from_a_record_without_roles(s3):
    """The next run puts the commit files staged beside the record (the manifest after the
    switch), whether the record names their roles or, written by an earlier ema-ckpt, does not,
    or there is no record (then a staged copy that is the output's says the switch was put)."""
    import json

    from ema_ckpt.storage.object_publish import MARKER, RECORD, STAGING_DIR

    for roles in (True, False, None):
        final = as_path(f"s3://{test_object_storage.BUCKET}/conformance/{secrets.token_hex(4)}/out")
        generation = _generation()
        data = f"__0_0.{generation}.distcp"
        pending = final / STAGING_DIR / generation
        (pending / MARKER).write_bytes(b"")
        (final / data).write_bytes(b"tensors")
        (pending / ".metadata").write_bytes(data.encode())
        (pending / "ema-ckpt.json").write_bytes(b"{}")
        record = {"files": sorted([data, ".metadata", "ema-ckpt.json"]),
                  "switch": {"name": ".metadata", "size": len(data), "crc32": zlib.crc32(data.encode())}}
        if roles:
            record["roles"] = {data: DATA, ".metadata": INDEX, "ema-ckpt.json": MANIFEST}
        if roles is not None:
            (pending / RECORD).write_bytes(json.dumps(record).encode())
        (final / ".metadata").write_bytes(data.encode())  # the switch is put; killed before the manifest
        notes = destination_for(final).recover()
        assert len(notes) == 1 and notes[0].startswith("finished publishing"), notes
        assert _files(final) == {data: b"tensors", ".metadata": data.encode(), "ema-ckpt.json": b"{}"}
