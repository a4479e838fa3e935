"""Outputs on object storage: built on a local disk, uploaded, and committed last.

An object store has no atomic rename of a folder and no ``flock``; what it has is the atomic
PUT of one object (a reader sees all of it or none) and, on S3, a PUT that succeeds only if
the key is new (``If-None-Match: *``). So a directory output ``s3://b/ema`` is published in
this order:

1. the lock is taken: the next object of ``s3://b/.ema.lock/`` created with a conditional PUT,
   holding a lease that its holder renews (:class:`RemoteLock`);
2. the marker ``ema/.ema-ckpt-staging/<generation>/started``;
3. the data files that ``.metadata`` or the index names, each under a name carrying the
   generation (``__0_0.<generation>.distcp``, ``model-00001-of-00004.<generation>.safetensors``),
   so that the previous output's files stay as they were;
4. beside the marker, copies of the commit files (``.metadata``,
   ``model.safetensors.index.json``, ``ema-ckpt.json``), then ``commit.json``: the output's
   file names, and the size and CRC-32 of the file whose PUT switches readers to the new
   output (its *switch*: ``.metadata``, the index, or a lone ``model.safetensors``);
5. a lone ``model.safetensors``, then ``.metadata`` or the index, then ``ema-ckpt.json``, at
   their keys: the commit;
6. the files of the previous output that the new one does not have, then the staging prefix,
   deleted.

A reader (``dcp.load``, ``from_pretrained``, ema-ckpt) sees the previous output until the
switch is put and the new one after. A run killed before that leaves the previous output
whole, and the next run removes what it uploaded; one killed after it (the switch at its key
is the one ``commit.json`` records) is finished by the next run (:func:`recover_remote`). A
single-file output (``consolidate --out s3://b/model.safetensors``) is one PUT (a multipart
upload appears when it completes).

Example:
    >>> with RemoteLock(as_path("s3://b/ema")):             # doctest: +SKIP
    ...     commit_upload(local_staging, as_path("s3://b/ema"), "20261202T010203-ab12cd")
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from ._env import seconds
from .errors import OutputError, OutputLockedError
from .fs import size_and_crc32
from .manifest import MANIFEST_NAME
from .remote import RemotePath, _call
from .writers.safetensors import INDEX_NAME

STAGING_DIR = ".ema-ckpt-staging"
"""The prefix inside an output that holds an upload in progress (one folder per generation)."""
METADATA_FILE = ".metadata"
SINGLE_SAFETENSORS = "model.safetensors"
COMMIT_ORDER = (METADATA_FILE, INDEX_NAME, MANIFEST_NAME)
"""The files uploaded last, in this order (those an output has): what makes an upload the output."""
SWITCHES = (METADATA_FILE, INDEX_NAME, SINGLE_SAFETENSORS)
"""The file whose PUT switches readers to a new output: the first of these an output has."""
RECORD = "commit.json"
"""Beside the marker: the new output's file names and its switch's size and CRC-32."""
LOCK_LEASE_SECONDS = 60.0
"""How long a lock is honoured after its holder last renewed it (a killed run's lock expires);
``EMA_CKPT_LOCK_LEASE`` sets it."""
LEASE_ENV = "EMA_CKPT_LOCK_LEASE"
STAGING_ENV = "EMA_CKPT_STAGING_DIR"
_TAGGED = re.compile(r"^(?:__\d+_\d+|model-\d+-of-\d+)\.(?P<tag>[0-9A-Za-z-]+)\.(?:distcp|safetensors)$")
_PLAIN = re.compile(r"^(?:__\d+_\d+\.distcp|model-\d+-of-\d+\.safetensors)$")
_NAMED = frozenset((*COMMIT_ORDER, SINGLE_SAFETENSORS))
"""Files of an output that a new output without them leaves behind unless they are deleted."""


def lock_lease() -> float:
    """The lease of a lock on object storage, in seconds (``EMA_CKPT_LOCK_LEASE``, default 60)."""
    return seconds(LEASE_ENV, LOCK_LEASE_SECONDS)


def local_staging_dir(final: Path) -> Path:
    """A local directory to build ``final`` (an object-storage output) in before it is
    uploaded: under ``EMA_CKPT_STAGING_DIR``, else the system's temporary directory."""
    root = os.environ.get(STAGING_ENV) or tempfile.gettempdir()
    try:
        return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    except OSError as err:
        raise OutputError(f"{root}: cannot make a local staging directory for {final} ({err.strerror})") from None


def new_generation() -> str:
    """A fresh generation tag: UTC time (sortable) and random hex (``20261202T010203-ab12cd``)."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def _remote(path: Path) -> RemotePath:
    return cast(RemotePath, path)


def _delete(paths: list[Path]) -> None:
    if paths:
        first = _remote(paths[0])
        with contextlib.suppress(FileNotFoundError):
            _call(first, first.fs.rm, [_remote(p).key for p in paths])


def _children(path: Path) -> list[Path]:
    try:
        return [cast(Path, p) for p in _remote(path).iterdir()]
    except FileNotFoundError:
        return []


def _everything_under(path: Path) -> list[Path]:
    try:
        return [cast(Path, p) for p in _remote(path).rglob("*")]
    except FileNotFoundError:
        return []


class RemoteLock:
    """An exclusive lock on an output in object storage, under ``.<name>.lock/`` beside it.

    The lock is a sequence of numbered objects (``.ema.lock/000000000007``), each created
    with a conditional PUT (``If-None-Match: *``), so that of any runs creating the same
    number, one succeeds. The highest number is the lock: it names its owner and an expiry
    :data:`LOCK_LEASE_SECONDS` ahead, which the owner renews (a thread, a third of the lease
    apart) by rewriting its own object, which no other run writes. A run takes a free lock
    (none yet, or the highest released or expired) by creating the next number, then confirms
    that its number is still the highest; the objects below it are deleted. Nothing is ever
    overwritten or deleted by a run that does not hold the lock, so of two runs racing for
    a lock that expired, one gets it. Released, the highest object stays as a record
    (``"released": true``) until the next run takes the number after it.

    A store without conditional writes is refused (:class:`~ema_ckpt.errors.OutputError`),
    since two runs could then both publish.
    """

    def __init__(self, final: Path, *, wait_seconds: float = 0.0, lease: float | None = None) -> None:
        self.final = final
        self.path = final.parent / f".{final.name}.lock"
        self.wait_seconds = wait_seconds
        self.lease = lease if lease is not None else lock_lease()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}"
        self.number = 0
        """The lock object this run holds (0: none)."""
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = False

    def _object(self, number: int) -> RemotePath:
        return _remote(self.path / f"{number:012d}")

    def _body(self, *, released: bool = False) -> bytes:
        doc: dict[str, Any] = {"owner": self.owner, "expires": time.time() + self.lease}
        if released:
            doc = {"owner": self.owner, "expires": 0.0, "released": True}
        return json.dumps(doc).encode()

    def _numbers(self) -> list[int]:
        """The lock objects there now, in order (a fresh listing, never a cached one)."""
        try:
            names = [p.name for p in _remote(self.path).iterdir(fresh=True)]
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def _read(self, number: int) -> dict[str, Any] | None:
        try:
            doc = json.loads(self._object(number).read_bytes())
        except FileNotFoundError:
            return None
        except ValueError:
            return {"owner": "?", "expires": 0.0}  # unreadable: treated as expired
        return doc if isinstance(doc, dict) else {"owner": "?", "expires": 0.0}

    @staticmethod
    def _free(holder: dict[str, Any] | None) -> bool:
        return holder is None or float(holder.get("expires", 0)) <= time.time()

    def _holder(self) -> tuple[int, dict[str, Any] | None]:
        """The highest lock object's number and what it holds (0, None: no lock yet)."""
        numbers = self._numbers()
        if not numbers:
            return 0, None
        return numbers[-1], self._read(numbers[-1])

    def _try(self) -> tuple[bool, dict[str, Any] | None]:
        """One attempt: (taken, the holder that kept it from this run)."""
        top, holder = self._holder()
        if top and not self._free(holder):
            return False, holder
        mine = top + 1
        try:
            self._object(mine).write_bytes(self._body(), exclusive=True)
        except FileExistsError:
            return False, None  # another run took this number first: look again
        except (TypeError, NotImplementedError):
            raise OutputError(f"{self.path}: {_remote(self.path).protocol}:// offers no conditional write, so "
                              "two runs could both publish this output; write it to a local disk or a "
                              "shared filesystem instead") from None
        if self._numbers()[-1:] != [mine]:  # a run that listed earlier made a higher one
            _delete([cast(Path, self._object(mine))])
            return False, None
        self.number = mine
        _delete([cast(Path, self._object(n)) for n in self._numbers() if n < mine])
        return True, None

    def __enter__(self) -> RemoteLock:
        deadline = time.monotonic() + self.wait_seconds
        pause = 0.05
        while True:
            taken, holder = self._try()
            if taken:
                break
            if holder is None:
                continue  # a race for a free lock, lost: look again at once
            if time.monotonic() >= deadline:
                raise OutputLockedError(
                    f"{self.final}: another ema-ckpt run is writing this output (lock {self.path.name}, "
                    f"held by {holder.get('owner')}); retry later or pass {{wait_seconds=SECONDS}}",
                    remedy="wait_seconds")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2.0, pause * 2)
        self._renewer = threading.Thread(target=self._renew, name="ema-ckpt-lock-lease", daemon=True)
        self._renewer.start()
        return self

    def _still_mine(self) -> bool:
        """This run's object is the highest, names it, and its lease has not run out."""
        top, holder = self._holder()
        return (top == self.number and holder is not None and holder.get("owner") == self.owner
                and not self._free(holder))

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 3):
            try:
                if not self._still_mine():
                    self.lost = True
                    return
                self._object(self.number).write_bytes(self._body())
            except Exception:  # a failed renewal is retried; the lease covers two misses
                continue

    def check(self) -> None:
        """Raise if the lock was lost (its lease ran out and another run took it)."""
        if self.lost or not self._still_mine():
            raise OutputError(f"{self.final}: the output's lock {self.path.name} was lost (its lease of "
                              f"{self.lease:.0f} s ran out); nothing was published")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with contextlib.suppress(Exception):
            if self.number and self._still_mine():
                self._object(self.number).write_bytes(self._body(released=True))


def upload_data_files(local: Path, final: Path, names: Iterable[str]) -> None:
    """Step 3, by the worker that wrote them: ``names`` (generation-tagged) from ``local``."""
    for name in sorted(names):
        if _TAGGED.match(name):
            _remote(final / name).upload(local / name)


def begin_upload(final: Path, generation: str) -> None:
    """Step 2: the marker that names the generation being uploaded."""
    _remote(final / STAGING_DIR / generation / "started").write_bytes(b"")


def commit_upload(local: Path, final: Path, generation: str, *, lock: RemoteLock | None = None) -> None:
    """Steps 3 (what is left), 4, 5 and 6 for a directory output built in ``local``."""
    names = sorted(p.name for p in local.iterdir() if p.is_file())
    existing = {p.name for p in _children(final)}
    for name in names:  # data files not uploaded by the workers that wrote them
        if _TAGGED.match(name) and name not in existing:
            _remote(final / name).upload(local / name)
    others = [n for n in names if not _TAGGED.match(n) and n not in COMMIT_ORDER]
    commit = [n for n in COMMIT_ORDER if n in names]
    pending = final / STAGING_DIR / generation
    for name in commit:
        _remote(pending / name).upload(local / name)
    _remote(pending / RECORD).write_bytes(_record(local, names))
    if lock is not None:
        lock.check()
    for name in others + commit:
        _remote(final / name).upload(local / name)
    _clean_up(final, generation, set(names))


def _record(local: Path, names: list[str]) -> bytes:
    """``commit.json``: the output's names and its switch's size and CRC-32.

    Example:
        >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / ".metadata").write_bytes(b"abc")
        >>> json.loads(_record(d, [".metadata", "__0_0.t.distcp"]))["switch"]
        {'crc32': 891568578, 'name': '.metadata', 'size': 3}
    """
    switch = next((n for n in SWITCHES if n in names), None)
    doc: dict[str, Any] = {"files": names, "switch": None}
    if switch is not None:
        size, crc = size_and_crc32(local / switch)
        doc["switch"] = {"name": switch, "size": size, "crc32": crc}
    return json.dumps(doc, sort_keys=True).encode()


def _switched(final: Path, switch: dict[str, Any]) -> bool:
    """The object at the switch's key is the one recorded (its size first: no read when it differs)."""
    current = final / str(switch["name"])
    try:
        if current.stat().st_size != switch["size"]:
            return False
        return size_and_crc32(current) == (switch["size"], switch["crc32"])
    except FileNotFoundError:
        return False


def _read_record(path: Path | None) -> dict[str, Any]:
    """A generation's ``commit.json`` (empty when it has none: killed before step 4)."""
    if path is None:
        return {}
    try:
        doc = json.loads(path.read_bytes())
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _clean_up(final: Path, generation: str, keep: set[str] | None) -> None:
    """Delete the files of earlier outputs, then the generation's staging: data files of other
    generations, and the commit files (and lone ``model.safetensors``) not in ``keep`` (None:
    staging without a record, whose output's names are unknown: data files only)."""

    def stale(name: str) -> bool:
        if (tagged := _TAGGED.match(name)) is not None:  # this generation's may come from any worker
            return tagged.group("tag") != generation
        return bool(_PLAIN.match(name)) or (keep is not None and name in _NAMED and name not in keep)

    _delete([p for p in _children(final) if stale(p.name)])
    _delete(_everything_under(final / STAGING_DIR / generation))


def upload_file(local: Path, final: Path) -> None:
    """A single-file output: one PUT (a multipart upload is visible only once complete)."""
    _remote(final).upload(local)


def recover_remote(final: Path) -> list[str]:
    """Finish or undo what a killed upload left in ``final``; notes of what was done.

    A generation whose switch (``.metadata``, the index, or a lone ``model.safetensors``) is
    the one its ``commit.json`` records was committed: the commit files after it are put in
    place and the earlier output's files removed. Any other generation was not: its files
    and its staging prefix are removed, leaving the previous output whole.
    """
    notes: list[str] = []
    staging = final / STAGING_DIR
    generations = sorted(p.name for p in _children(staging))
    for generation in generations:
        pending = staging / generation
        staged = {p.name: p for p in _children(pending)}
        record = _read_record(staged.get(RECORD))
        switch = record.get("switch")
        if isinstance(switch, dict):
            committed = _switched(final, switch)
        else:  # no record (an older ema-ckpt's staging): committed if its .metadata copy is the output's
            current = final / METADATA_FILE
            committed = METADATA_FILE in staged and current.exists() and (
                staged[METADATA_FILE].read_bytes() == current.read_bytes())
            switch = {"name": METADATA_FILE}
        if committed:
            for name in COMMIT_ORDER:  # the commit files after the switch (the manifest)
                if name in staged and name != switch["name"]:
                    _remote(final / name).write_bytes(staged[name].read_bytes())
            files = record.get("files")
            keep = {str(n) for n in files} if isinstance(files, list) else None
            _clean_up(final, generation, keep)
            notes.append(f"finished publishing {final} (generation {generation}: an earlier run was interrupted)")
        else:
            tagged = [p for p in _children(final) if (m := _TAGGED.match(p.name)) and m.group("tag") == generation]
            _delete(tagged + _everything_under(pending))
            notes.append(f"removed what an interrupted run had uploaded to {final} (generation {generation})")
    return notes


__all__ = ["COMMIT_ORDER", "LOCK_LEASE_SECONDS", "RECORD", "STAGING_DIR", "SWITCHES", "RemoteLock", "begin_upload",
           "commit_upload", "local_staging_dir", "lock_lease", "new_generation", "recover_remote", "upload_data_files",
           "upload_file"]
