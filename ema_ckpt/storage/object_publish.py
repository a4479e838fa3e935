"""Outputs on object storage: built on a local disk, uploaded, and committed last.

An object store has no atomic rename of a folder, only the atomic PUT of one object and a PUT
that succeeds only if the key is new (``If-None-Match: *``). So a directory output ``s3://b/ema``
is published in this order, by each file's *role* (:class:`~ema_ckpt.storage.roles.Role`):

1. the lock is taken: the next object of ``s3://b/.ema.lock/`` created with a conditional PUT,
   holding a lease that its holder renews (:class:`~ema_ckpt.storage.object_lock.RemoteLock`);
2. the marker ``ema/.ema-ckpt-staging/<generation>/started``;
3. the data files, each under a name carrying the generation (``__0_0.<generation>.distcp``:
   :func:`~ema_ckpt.storage.roles.tagged`), so that the previous output's files stay as they were;
4. beside the marker, copies of the commit files (the index files, then the manifest), then
   ``commit.json``: the output's files and roles, what it replaces, and the size and CRC-32 of
   the file whose PUT switches readers to the new output (its *switch*: the first index file,
   or else the one untagged data file, a lone ``model.safetensors``);
5. the other files, then the commit files at their keys: the commit;
6. the previous output's files that the new one does not have (data files of other
   generations, and the names the caller says it replaces), then the staging prefix, deleted.

A reader sees the previous output until the switch is put and the new one after. A run killed
before that leaves the previous output whole, and the next run removes what it uploaded; one
killed after it is finished by the next run (:func:`recover_remote`). A single-file output is
one PUT (a multipart upload appears when it completes).

Example:
    >>> commit_upload(staging, RemotePath.from_url("s3://b/ema"), "20261202T010203-ab12cd",   # doctest: +SKIP
    ...               {".metadata": "index", "__0_0.20261202T010203-ab12cd.distcp": "data"}, replaces=set())
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import OutputError
from .local_files import size_and_crc32
from .object_lock import HeldLock
from .object_paths import RemotePath, delete_objects, objects_under
from .roles import COMMIT_ROLES, DATA, generation_of, tagged

STAGING_DIR = ".ema-ckpt-staging"  # inside an output: an upload in progress, a folder per generation
MARKER = "started"  # made first, so a generation killed at once is still found and removed
RECORD = "commit.json"
STAGING_ENV = "EMA_CKPT_STAGING_DIR"


def local_staging_dir(final: RemotePath) -> Path:
    """A local directory to build ``final`` in (under ``EMA_CKPT_STAGING_DIR``, else the system's temporary one)."""
    root = os.environ.get(STAGING_ENV) or tempfile.gettempdir()
    try:
        return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    except OSError as err:
        raise OutputError(f"{root}: cannot make a local staging directory for {final} ({err.strerror})") from None


def new_generation() -> str:
    """A fresh generation tag: UTC time (sortable) and random hex (``20261202T010203-ab12cd``)."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def upload_data_files(local: Path, final: RemotePath, names: Iterable[str], generation: str) -> None:
    """Step 3, by the worker that wrote them: the files of ``names`` tagged with ``generation``."""
    for name in sorted(names):
        if tagged(name, generation):
            (final / name).upload(local / name)


def begin_upload(final: RemotePath, generation: str) -> None:
    """Step 2: the marker that names the generation being uploaded."""
    (final / STAGING_DIR / generation / MARKER).write_bytes(b"")


def commit_upload(local: Path, final: RemotePath, generation: str, roles: Mapping[str, str], *,
                  replaces: Collection[str] = (), lock: HeldLock | None = None) -> None:
    """Steps 3 (what is left) to 6 for a directory output built in ``local``. ``roles``: {name:
    role} (other files: ``"other"``); ``replaces``: the previous output's names to delete once committed."""
    names = sorted(p.name for p in local.iterdir() if p.is_file())
    role_of = {name: roles.get(name, "other") for name in names}
    existing = {p.name for p in objects_under(final)}
    for name in names:  # data files not uploaded by the workers that wrote them
        if tagged(name, generation) and name not in existing:
            (final / name).upload(local / name)
    commit = [n for role in COMMIT_ROLES for n in names if role_of[n] == role]
    others = [n for n in names if not tagged(n, generation) and n not in commit]
    pending = final / STAGING_DIR / generation
    for name in commit:
        (pending / name).upload(local / name)
    (pending / RECORD).write_bytes(_record(local, role_of, generation, replaces))
    if lock is not None:
        lock.check()
    for name in others + commit:
        (final / name).upload(local / name)
    _clean_up(final, generation, set(names), replaces)


def _switch(role_of: Mapping[str, str], generation: str) -> str | None:
    """The file whose PUT makes the new output the one readers see."""
    index = [n for n, role in role_of.items() if role == COMMIT_ROLES[0]]
    if index:
        return sorted(index)[0]
    plain = sorted(n for n, role in role_of.items() if role == DATA and not tagged(n, generation))
    return plain[0] if len(plain) == 1 else None


def _record(local: Path, role_of: Mapping[str, str], generation: str, replaces: Collection[str]) -> bytes:
    """``commit.json``.

    Example:
        >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / ".metadata").write_bytes(b"abc")
        >>> json.loads(_record(d, {".metadata": "index", "__0_0.t.distcp": "data"}, "t", ()))["switch"]
        {'crc32': 891568578, 'name': '.metadata', 'size': 3}
    """
    switch = _switch(role_of, generation)
    doc: dict[str, Any] = {"files": sorted(role_of), "roles": dict(sorted(role_of.items())),
                           "replaces": sorted(replaces), "switch": None}
    if switch is not None:
        size, crc = size_and_crc32(local / switch)
        doc["switch"] = {"name": switch, "size": size, "crc32": crc}
    return json.dumps(doc, sort_keys=True).encode()


def _switched(final: RemotePath, switch: dict[str, Any]) -> bool:
    """The object at the switch's key is the one recorded (the size first: no read when it differs)."""
    current = final / str(switch["name"])
    try:
        if current.stat().st_size != switch["size"]:
            return False
        return size_and_crc32(current) == (switch["size"], switch["crc32"])
    except FileNotFoundError:
        return False


def _same_bytes(copy: RemotePath, current: RemotePath) -> bool:
    try:
        return copy.read_bytes() == current.read_bytes()
    except FileNotFoundError:
        return False


def _read_record(path: RemotePath | None) -> dict[str, Any]:
    """A generation's ``commit.json`` (empty when it has none: killed before step 4)."""
    if path is None:
        return {}
    try:
        doc = json.loads(path.read_bytes())
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _names(record: dict[str, Any], key: str) -> set[str]:
    listed = record.get(key)
    return {str(n) for n in listed} if isinstance(listed, list) else set()


def _clean_up(final: RemotePath, generation: str, keep: set[str], replaces: Collection[str]) -> None:
    """Delete data files of other generations and the names in ``replaces`` that ``keep`` lacks,
    then the generation's staging."""

    def stale(name: str) -> bool:
        other = generation_of(name)
        if other is not None:  # this generation's may come from any worker
            return other != generation
        return name in replaces and name not in keep

    delete_objects([p for p in objects_under(final) if stale(p.name)])
    delete_objects(objects_under(final / STAGING_DIR / generation, recursive=True))


def recover_remote(final: RemotePath) -> list[str]:
    """Finish or undo what a killed upload left in ``final``; notes of what was done. A generation
    whose switch is the one its ``commit.json`` records was committed: the commit files after it
    are put in place and the earlier output's files removed. Any other is removed."""
    notes: list[str] = []
    staging = final / STAGING_DIR
    generations = sorted(p.name for p in objects_under(staging))
    for generation in generations:
        pending = staging / generation
        staged = {p.name: p for p in objects_under(pending)}
        record = _read_record(staged.get(RECORD))
        switch = record.get("switch")
        listed = record.get("roles")
        roles: dict[str, Any] = listed if isinstance(listed, dict) else {}
        if isinstance(switch, dict):
            committed = _switched(final, switch)
        else:  # no record: killed before it, or an earlier ema-ckpt's staging; committed if a copy is the output's
            copies = sorted(set(staged) - {RECORD, MARKER})
            put = [n for n in copies if _same_bytes(staged[n], final / n)]
            committed, switch = bool(put), {"name": put[0] if put else None}
        if committed:
            # the commit files after the switch (the manifest): every copy staged beside the
            # record, in their roles' order (a record written before roles were: by name)
            order = {n: COMMIT_ROLES.index(r) for n, r in roles.items() if r in COMMIT_ROLES}
            for name in sorted(set(staged) - {RECORD, MARKER, switch["name"]}, key=lambda n: (order.get(n, 0), n)):
                (final / name).write_bytes(staged[name].read_bytes())
            _clean_up(final, generation, _names(record, "files"), _names(record, "replaces"))
            notes.append(f"finished publishing {final} (generation {generation}: an earlier run was interrupted)")
        else:
            uploaded = [p for p in objects_under(final) if generation_of(p.name) == generation]
            delete_objects(uploaded + objects_under(pending, recursive=True))
            notes.append(f"removed what an interrupted run had uploaded to {final} (generation {generation})")
    return notes


__all__ = ["RECORD", "STAGING_DIR", "begin_upload", "commit_upload", "local_staging_dir", "new_generation",
           "recover_remote", "upload_data_files"]
