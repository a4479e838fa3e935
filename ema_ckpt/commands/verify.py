"""``verify``: is a checkpoint on disk intact and fully readable?

For an ema-ckpt output (a directory holding ``ema-ckpt.json``), every data file the
manifest lists is re-hashed (size and CRC-32, streamed in 8 MiB blocks) and compared
with the manifest, and files missing from the directory or not listed in the manifest
are reported. For any checkpoint, with or without a manifest, the reader must open it
(for DCP that already checks that the stored chunks cover every tensor exactly once)
and every stored box of every tensor is read once, block by block, so each record's
bytes must parse.

What is wrong with the data ends up in :attr:`VerifyResult.problems`, one line each,
naming the file; a path that does not exist or holds no checkpoint at all raises the
usual :class:`~ema_ckpt.errors.CheckpointNotFoundError`.

Example:
    >>> result = verify("ckpts/ema")                       # doctest: +SKIP
    >>> result.ok, result.files, result.problems           # doctest: +SKIP
    (True, ['__0_0.distcp', '__1_0.distcp'], [])
"""

from __future__ import annotations

import contextlib
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, EmaCkptError
from ..formats import open_checkpoint
from ..formats.base import CheckpointReader
from ..layout import split_rows
from ..manifest import MANIFEST_NAME, Manifest

HASH_BLOCK_BYTES = 8 << 20
"""CRC-32 is computed over blocks of this many bytes (memory stays bounded by one block)."""
READ_BLOCK_BYTES = 64 << 20
"""Tensors are read back in row blocks of at most this many bytes (at least one row)."""
_KNOWN_FILES = {MANIFEST_NAME, ".metadata"}
"""Files of an ema-ckpt output that the manifest's ``files`` does not list, by design."""


@dataclass(slots=True)
class VerifyResult:
    """What :func:`verify` checked and what it found wrong.

    ``files`` are the data files whose size and CRC-32 matched the manifest; ``keys`` the
    tensor keys read back in full without error. ``ok`` is True when ``problems`` is empty.
    """

    path: Path
    format_name: str | None = None
    manifest: bool = False
    """Whether the path is an ema-ckpt output (holds ``ema-ckpt.json``)."""
    checks: list[str] = field(default_factory=list)
    """What was checked: ``"files"`` (sizes and CRC-32s against the manifest), ``"readable"``."""
    files: list[str] = field(default_factory=list)
    keys: int = 0
    bytes_hashed: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bytes_checked(self) -> int:
        """Bytes hashed plus tensor bytes read back."""
        return self.bytes_hashed + self.bytes_read

    def problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "format": self.format_name,
            "manifest": self.manifest,
            "checks": list(self.checks),
            "files": list(self.files),
            "keys": self.keys,
            "bytes_hashed": self.bytes_hashed,
            "bytes_read": self.bytes_read,
            "bytes_checked": self.bytes_checked,
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


def verify(
    path: str | Path, *, hash_block_bytes: int = HASH_BLOCK_BYTES, read_block_bytes: int = READ_BLOCK_BYTES
) -> VerifyResult:
    """Check the checkpoint at ``path`` (see the module docstring).

    Example:
        >>> result = verify("ckpts/ema")                     # doctest: +SKIP
        >>> result.ok, result.checks                         # doctest: +SKIP
        (True, ['files', 'readable'])

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, or (without a manifest) holds no
            checkpoint of any known format.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise CheckpointNotFoundError(path, "no such file or directory")
    result = VerifyResult(path)
    manifest_file = path / MANIFEST_NAME
    result.manifest = path.is_dir() and (manifest_file.exists() or manifest_file.is_symlink())
    if result.manifest:
        result.checks.append("files")
        manifest = _read_manifest(path, result)
        if manifest is not None:
            _check_files(path, manifest, result, hash_block_bytes)
    else:
        result.notes.append(f"no {MANIFEST_NAME}: the checkpoint's own zip CRC-32s are checked (where it has "
                            "them) and every tensor read back")
    result.checks.append("readable")
    _check_readable(path, result, read_block_bytes, strict=result.manifest)
    if not result.manifest:
        _check_record_crcs(path, result)
    return result


def _zip_crcs_ok(source: Any, name: str, result: VerifyResult) -> None:
    """Every member of the zip at ``source`` against the CRC-32 its headers record.

    Members saved without checksums (``torch.serialization.set_crc32_options(False)`` writes
    CRC 0) and files in torch's legacy, non-zip format carry nothing to check: noted, not wrong.
    """
    try:
        if not zipfile.is_zipfile(source):
            result.notes.append(f"{name}: legacy torch.save format, no CRC-32s to check")
            return
        with zipfile.ZipFile(source) as archive:
            infos = archive.infolist()
            unchecked = [i for i in infos if i.CRC == 0 and i.file_size > 0]
            if unchecked and len(unchecked) == len([i for i in infos if i.file_size > 0]):
                result.notes.append(f"{name}: saved without CRC-32s, nothing to check")
                return
            for info in infos:
                result.bytes_hashed += info.file_size
            bad = archive.testzip()
    except Exception as err:  # any odd header (a compression or encryption flag): one line, not a crash
        result.problem(f"{name}: not a readable zip record ({err})")
        return
    if bad is not None:
        result.problem(f"{name}: member {bad!r} does not match the CRC-32 its zip header records (corrupt data)")


def _check_record_crcs(path: Path, result: VerifyResult) -> None:
    """A training checkpoint's own checksums: every ``torch.save`` zip's CRC-32s, which neither
    torch nor DeepSpeed ever checks when loading.

    DCP: every record the metadata names (optimizer and bytes entries too); DeepSpeed: every
    ``.pt`` file of the tag; a ``torch.save`` file: itself. Safetensors carries no checksum.
    """
    try:
        reader = open_checkpoint(path)
    except EmaCkptError:
        return  # already reported by the readability check
    with contextlib.closing(reader):
        records = reader.stored_records()
        if not records:
            return
        result.checks.append("file CRC-32s" if reader.whole_file_records else "record CRC-32s")
        for file, offset, length in records:
            name = str(path / file) if reader.whole_file_records else f"{path / file} (record at offset {offset})"
            try:
                source = reader.open_record(file, offset, length)
            except EmaCkptError as err:
                result.problem(str(err))
                continue
            except OSError as err:
                result.problem(f"{path / file}: cannot read ({err.strerror})")
                continue
            with contextlib.closing(source):
                _zip_crcs_ok(source, name, result)


def damage(path: str | Path, *, block_bytes: int = HASH_BLOCK_BYTES) -> list[str]:
    """What is wrong with an ema-ckpt output's data files against its manifest (empty: intact).

    Sizes and CRC-32s only, as ``verify`` checks them; files the manifest does not list are
    not damage and are left to ``verify``. Reads every data file once.

    Example:
        >>> damage("ckpts/ema")   # doctest: +SKIP
        []
    """
    path = Path(path)
    result = VerifyResult(path)
    manifest = _read_manifest(path, result)
    if manifest is not None:
        _check_files(path, manifest, result, block_bytes, extras=False)
    return result.problems


def _read_manifest(path: Path, result: VerifyResult) -> Manifest | None:
    file = path / MANIFEST_NAME
    try:
        if not file.is_file():
            raise CheckpointError(file, "not a regular file")
        manifest = Manifest.read(path)
    except EmaCkptError as err:
        result.problem(str(err))
        return None
    except RecursionError:  # absurdly nested JSON
        result.problem(f"{file}: unreadable ema-ckpt manifest (nested too deeply)")
        return None
    files = manifest.files if manifest is not None else None
    if not isinstance(files, dict):
        result.problem(f"{file}: 'files' is not an object mapping data file names to size and crc32")
        return None
    return manifest


def _entry(value: Any) -> tuple[int, int] | None:
    """``(size, crc32)`` of a manifest ``files`` entry, or None when malformed."""
    if not isinstance(value, dict):
        return None
    size, crc = value.get("size"), value.get("crc32")
    if type(size) is not int or type(crc) is not int or size < 0 or not 0 <= crc < 1 << 32:
        return None
    return size, crc


def _check_files(
    path: Path, manifest: Manifest, result: VerifyResult, block_bytes: int, *, extras: bool = True
) -> None:
    listed: dict[str, Any] = manifest.files
    manifest_file = path / MANIFEST_NAME
    for name in sorted(listed, key=str):
        if not isinstance(name, str) or Path(name).name != name or name in {"", ".", ".."} or "\0" in name:
            result.problem(f"{manifest_file}: lists {name!r}, which is not a file name in this directory")
            continue
        file = path / name
        expected = _entry(listed[name])
        if expected is None:
            result.problem(
                f"{manifest_file}: entry for {name!r} has no valid size and crc32 ({listed[name]!r})"
            )
            continue
        if not file.exists():
            result.problem(f"{file}: missing (listed in {MANIFEST_NAME})")
            continue
        if not file.is_file():
            result.problem(f"{file}: not a regular file")
            continue
        size, crc = expected
        try:
            actual_size, actual_crc = _size_and_crc32(file, block_bytes)
        except OSError as err:
            result.problem(f"{file}: cannot read ({err.strerror or err})")
            continue
        result.bytes_hashed += actual_size
        if actual_size != size:
            what = "truncated" if actual_size < size else "longer than recorded"
            result.problem(f"{file}: {what}: {actual_size} bytes, {MANIFEST_NAME} says {size}")
        elif actual_crc != crc:
            result.problem(f"{file}: CRC-32 {actual_crc:08x}, {MANIFEST_NAME} says {crc:08x} (corrupt data)")
        else:
            result.files.append(name)
    if not extras:
        return
    try:
        present = sorted(path.iterdir())
    except OSError as err:
        result.problem(f"{path}: cannot list ({err.strerror or err})")
        return
    for entry in present:
        if entry.name in _KNOWN_FILES or entry.name in listed:
            continue
        kind = "directory" if entry.is_dir() else "file"
        result.problem(f"{entry}: extra {kind} not listed in {MANIFEST_NAME}")


def _size_and_crc32(file: Path, block_bytes: int) -> tuple[int, int]:
    """Stream ``file`` once: its length and CRC-32 (as :mod:`zlib` computes it)."""
    crc = 0
    size = 0
    buffer = bytearray(max(1, block_bytes))
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def _check_readable(path: Path, result: VerifyResult, block_bytes: int, *, strict: bool) -> None:
    try:
        reader = open_checkpoint(path)
    except CheckpointNotFoundError as err:
        if not strict:
            raise  # not a checkpoint at all, and no manifest says it should be one
        result.problem(str(err))
        return
    except EmaCkptError as err:
        result.problem(str(err))
        return
    with contextlib.closing(reader):
        result.format_name = reader.format_name
        _read_everything(reader, result, block_bytes)


def _read_everything(reader: CheckpointReader, result: VerifyResult, block_bytes: int) -> None:
    try:
        specs = dict(reader.specs())
    except EmaCkptError as err:
        result.problem(str(err))
        return
    for key, spec in specs.items():
        limit = max(1, block_bytes // max(1, spec.dtype.itemsize))
        try:
            for box in reader.layout(key):
                for part in split_rows(box, limit):
                    value = reader.read(key, part)
                    result.bytes_read += value.numel() * value.element_size()
                    del value
        except EmaCkptError as err:
            result.problem(str(err))
            continue
        result.keys += 1
    # DCP non-tensor entries (``BytesStorageMetadata``): their records must lie in their files.
    for key in reader.non_tensor_keys:
        try:
            result.bytes_read += len(reader.read_bytes(key))
        except KeyError:
            result.problem(f"{reader.path}: non-tensor entry {key!r} has no stored record")
        except EmaCkptError as err:
            result.problem(str(err))
