"""Staging: a complete checkpoint copied aside the moment it is seen, so retention cannot take it
before it is folded, and checked before its fold.

A staged copy never shares storage a trainer may write into: a single file (rewritten in place:
nanoGPT's ``ckpt.pt``) is reflinked, else copied; a folder's files (written once) are reflinked,
else hard-linked, else copied; on object storage, downloaded. Each copy's files (size, mtime,
inode) are recorded and compared before its fold (:func:`rewritten_since_staged`).

Example:
    >>> import tempfile; from pathlib import Path
    >>> ckpts = Path(tempfile.mkdtemp()); (ckpts / "step_100").mkdir()
    >>> (ckpts / "step_100" / "model.safetensors").touch()
    >>> stage(ckpts / "step_100", incoming_dir(ckpts)).relative_to(ckpts)
    PosixPath('.ema-ckpt-incoming/step_100')
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from .storage import Location, as_path, files_on_disk, local_file, open_readable

INCOMING = ".ema-ckpt-incoming"
"""The folder, inside the checkpoints' folder, that holds checkpoints staged for folding."""
DOWNLOAD_BLOCK = 8 << 20
"""Bytes of an object downloaded per read when a checkpoint in object storage is staged."""


def incoming_dir(checkpoints: str | os.PathLike[str]) -> Path:
    """Where checkpoints of the folder ``checkpoints`` are staged for folding."""
    return Path(checkpoints) / INCOMING


def stage(checkpoint: str | os.PathLike[str] | Location, incoming: str | os.PathLike[str], *,
          step: int | None = None) -> Path:
    """Stage ``checkpoint`` (a file or a folder) into ``incoming``, as the module says, under its
    own name, with a hidden record (:func:`staged_record`) of its name, its ``step`` and each
    staged file's size, time and inode. The copy appears whole (built under a hidden name, then
    renamed); an existing staged copy of the same bytes is kept. A single file staged already
    with other bytes (written again in place since) is staged beside it, as
    ``<stem>.<mtime><suffix>`` (a hash of its name where that would pass NAME_MAX).

    Raises:
        FileNotFoundError: the checkpoint went (or lost a file, or a single file was written
            again while it was copied) before all of it was staged.

    Example:
        >>> import tempfile; from pathlib import Path
        >>> ckpts = Path(tempfile.mkdtemp()); _ = (ckpts / "ckpt.pt").write_bytes(b"weights")
        >>> staged = stage(ckpts / "ckpt.pt", ckpts / ".ema-ckpt-incoming")
        >>> staged.relative_to(ckpts), staged.read_bytes()
        (PosixPath('.ema-ckpt-incoming/ckpt.pt'), b'weights')
    """
    source, into = as_path(checkpoint), Path(incoming)
    local = local_file(source)
    if local is not None and local.parent.resolve() == into.resolve():
        return local  # already staged (a callback's own copy)
    seen = file_identity(local) if local is not None and local.is_file() else None
    target = staged_target(source.name, into, seen)
    if target.exists():
        return target
    into.mkdir(parents=True, exist_ok=True)
    partial = into / f".partial-{_short(target.name)}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        if local is None:
            _download(source, partial)
        elif local.is_dir():
            shutil.copytree(local, partial, copy_function=_clone_link_or_copy)
        else:
            _clone_or_copy(str(local), str(partial))
            if file_identity(local) != seen:  # written again while it was copied: the copy may be torn
                raise FileNotFoundError(errno.ENOENT, "written again while it was staged", str(local))
        _write_record(into, target.name, source.name, step, seen, partial)
        os.replace(partial, target)
    except OSError as err:
        remove_staged(partial)
        # not found: deleted by retention while it was staged, it was never whole here
        if isinstance(err, FileNotFoundError) or not target.exists():
            raise
    return target


_NAME_MAX = 255
RECORD_PREFIX = ".staged-"


def _short(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:20]


def _fits(name: str) -> bool:
    return len(name.encode("utf-8", "surrogateescape")) <= _NAME_MAX


def file_identity(path: Path) -> tuple[int, int, int] | None:
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return (info.st_size, info.st_mtime_ns, info.st_ino)


def records_dir(incoming: str | os.PathLike[str]) -> Path:
    """Where :func:`stage` keeps its records of the copies staged in ``incoming``: a hidden folder
    beside it (``CKPTS/.ema-ckpt-incoming.records``), so ``incoming`` holds checkpoints alone."""
    into = Path(incoming)
    return into.parent / f"{into.name}.records"


def record_path(into: Path, staged_name: str) -> Path:
    return records_dir(into) / f"{RECORD_PREFIX}{_short(staged_name)}.json"


def staged_record(into: str | os.PathLike[str], staged_name: str) -> dict[str, Any] | None:
    """The record :func:`stage` kept of the copy ``into/staged_name``: ``name`` (the original
    name), ``step`` (or None), ``source`` (size, time, inode of the original single file, or
    None) and ``files`` (each staged file's size, time and inode); None without one."""
    try:
        record = json.loads(record_path(Path(into), staged_name).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("staged") == staged_name else None


def _files_identity(path: Path) -> dict[str, list[int]]:
    if path.is_dir():
        files = {str(p.relative_to(path)): p for p in sorted(path.rglob("*")) if p.is_file()}
    else:
        files = {"": path}
    return {rel: [(info := file.stat()).st_size, info.st_mtime_ns, info.st_ino] for rel, file in files.items()}


def _write_record(into: Path, staged_name: str, name: str, step: int | None, seen: tuple[int, int, int] | None,
                  partial: Path) -> None:
    """Record what ``partial`` holds before it is renamed ``into/staged_name`` (a rename keeps
    inodes and times): a staged copy never lacks its record."""
    record = {"staged": staged_name, "name": name, "step": step, "source": None if seen is None else list(seen),
              "files": _files_identity(partial)}
    final = record_path(into, staged_name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".record-{os.getpid()}-{threading.get_ident()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, final)


def staged_target(name: str, into: Path, seen: tuple[int, int, int] | None) -> Path:
    """Where a checkpoint named ``name`` is staged: its own name, unless a single file (its
    ``seen`` identity) is already staged there with other bytes (a file written again in
    place since): then a name of its version."""
    target = into / name
    if seen is None or not target.exists():
        return target
    record = staged_record(into, name)
    if record is None or record.get("source") in (None, list(seen)):
        return target
    stem, suffix = os.path.splitext(name)
    versioned = f"{stem}.{seen[1]}{suffix}"
    if not _fits(versioned):
        versioned = f"{_short(name)}.{seen[1]}{suffix if _fits('x' * 60 + suffix) else ''}"
    return into / versioned


def rewritten_since_staged(into: str | os.PathLike[str], staged_name: str) -> bool:
    """Whether the staged copy ``into/staged_name`` no longer holds the bytes staged (a file
    changed size, time or inode, or went): False where there is no record to compare with."""
    record = staged_record(into, staged_name)
    if record is None:
        return False
    try:
        return _files_identity(Path(into) / staged_name) != record.get("files")
    except OSError:
        return True


def _clone(src: str, dst: str) -> bool:
    """Reflink ``src`` to ``dst`` (FICLONE: shares no bytes the trainer can write into); False
    where the filesystem cannot (``dst`` is then absent)."""
    try:
        with open(src, "rb") as reading, open(dst, "wb") as writing:
            fcntl.ioctl(writing.fileno(), _FICLONE, reading.fileno())
    except OSError as err:
        if isinstance(err, FileNotFoundError) and not os.path.exists(src):
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)
        return False
    shutil.copystat(src, dst)
    return True


_FICLONE = 0x40049409


def _clone_or_copy(src: str, dst: str) -> str:
    if not _clone(src, dst):
        shutil.copy2(src, dst)
    return dst


def _clone_link_or_copy(src: str, dst: str) -> str:
    if _clone(src, dst):
        return dst
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _download(source: Location, target: Path) -> None:
    """Every file of ``source`` (one object, or the objects under a prefix) into ``target``."""
    single = source.is_file()
    files = files_on_disk(source)
    if not files:
        raise FileNotFoundError(errno.ENOENT, "no such object or prefix", str(source))
    if not single:
        target.mkdir(parents=True)
    for name, size in files:
        into, where = (target, source) if single else (target / name, source / name)
        into.parent.mkdir(parents=True, exist_ok=True)
        readable = open_readable(where, size=size)
        try:
            with open(into, "wb") as out:
                done = 0
                while done < size:
                    data = readable.pread(min(DOWNLOAD_BLOCK, size - done), done)
                    if not data:  # rewritten shorter while it was read
                        raise FileNotFoundError(errno.ENOENT, "changed while it was downloaded", str(source))
                    out.write(data)
                    done += len(data)
        finally:
            readable.close()
        # the object's time as the file's: staged again, it is the same checkpoint (its fingerprint)
        with contextlib.suppress(FileNotFoundError):  # deleted since it was read: the bytes are whole
            modified = where.stat().st_mtime_ns
            if modified:
                os.utime(into, ns=(modified, modified))


def remove_staged(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


__all__ = ["DOWNLOAD_BLOCK", "INCOMING", "RECORD_PREFIX", "file_identity", "incoming_dir", "record_path", "records_dir",
           "remove_staged", "rewritten_since_staged", "stage", "staged_record", "staged_target"]
