"""The JSON manifest of every ema-ckpt output (``ema-ckpt.json``): how it was made, every
checkpoint folded into it (path, step, fingerprint), its step, each data file's size and CRC-32.
No timestamps: two runs that do the same work write the same bytes.

Example:
    >>> m = Manifest(kind="ema", profile={"kind": "exponential", "decay": 0.999},
    ...              dtype="float32", step=10, source_format="dcp")
    >>> Manifest.from_json(m.to_json()).step
    10
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ._version import __version__
from .errors import CheckpointFormatError, ManifestMismatchError, OptionError
from .storage import Location, enclosing_folders, replace_file

MANIFEST_NAME = "ema-ckpt.json"
MANIFEST_FORMAT = 1
_SMALL_MARKERS = {".metadata", "latest", "model.safetensors.index.json", "trainer_state.json"}


@dataclass(frozen=True, slots=True)
class FoldedCheckpoint:
    """One input that went into an output."""

    path: str
    step: int
    fingerprint: str


@dataclass(slots=True)
class Manifest:
    """What an output is and how it was made (see the module docstring)."""

    kind: str
    profile: dict[str, Any]
    dtype: str
    step: int
    source_format: str
    checkpoints: list[FoldedCheckpoint] = field(default_factory=list)
    selection: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, int | None]] = field(default_factory=dict)
    terms: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    left: list[dict[str, str]] = field(default_factory=list)
    """Model-bearing parts of the checkpoints not read (``path``, ``why``): a trainer's own EMA, a copy."""
    options: dict[str, Any] = field(default_factory=dict)
    """The options of the run that made it (those that shape the result, not where it ran)."""
    tool_version: str = __version__
    format_version: int = MANIFEST_FORMAT

    def to_json(self) -> str:
        data = asdict(self)
        data[INTEGRITY] = _digest(data)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        data["checkpoints"] = [FoldedCheckpoint(**c) for c in data.get("checkpoints", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def read(cls, directory: Location, *, check: bool = True) -> Manifest | None:
        """The manifest in ``directory``, or None. ``check``: refuse one edited since ema-ckpt
        wrote it (one older than its ``integrity`` field is taken as it is).

        Raises:
            CheckpointFormatError: unreadable.
            ManifestMismatchError: edited by hand (``restart=True`` rebuilds the output).
        """
        file = directory / MANIFEST_NAME
        if not file.exists():
            return None
        try:
            text = file.read_text()
            if check:
                _check_integrity(file, json.loads(text))
            return cls.from_json(text)
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise CheckpointFormatError(file, f"unreadable ema-ckpt manifest ({err})") from None

    def write(self, directory: Location) -> None:
        """Write durably and atomically: into a staging published by the caller, or over the
        manifest of a published output (its data untouched)."""
        replace_file(directory / MANIFEST_NAME, self.to_json().encode())


INTEGRITY = "integrity"
"""The manifest's own checksum: an edit that does not recompute it cannot agree with it."""


def _digest(data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != INTEGRITY}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def _check_integrity(file: Location, data: Any) -> None:
    recorded = data.get(INTEGRITY) if isinstance(data, dict) else None
    if recorded is not None and recorded != _digest(data):
        raise ManifestMismatchError(
            f"{file}: edited since ema-ckpt wrote it (its integrity checksum no longer matches): the settings and "
            "checkpoints it records cannot be trusted; restore it, or pass {restart=True} to rebuild the output",
            remedy="restart")


def current_fingerprint(path: Location) -> str | None:
    """:func:`fingerprint` of what is at ``path`` now, or None when it is gone (or going: retention
    deleting it while it is looked at)."""
    try:
        return fingerprint(path) if path.exists() else None
    except OSError:
        return None


def fingerprint(path: Location) -> str:
    """A cheap identity of a checkpoint (names, sizes and mtimes of its files, its metadata's
    bytes): a rewrite in place is seen without hashing gigabytes."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        rel = str(file)[len(str(path)) + 1:] if path.is_dir() else file.name
        stat = file.stat()
        digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        if file.name in _SMALL_MARKERS or (file.name.endswith(".metadata") and stat.st_size < 64 << 20):
            digest.update(file.read_bytes())
    return "sha256:" + digest.hexdigest()[:32]


def check_not_overlapping(src: Location, out: Location) -> None:
    """Refuse an output inside its source, or a source inside its output."""
    a, b = src.resolve(), out.resolve()
    if a == b or a in b.parents or b in a.parents:
        raise OptionError("out", f"{out} overlaps the source {src}; write the output elsewhere", value=out)


OUTPUT_OWN_FILES = frozenset({MANIFEST_NAME, ".metadata"})
"""Files of an ema-ckpt output that its manifest's ``files`` does not list, by design."""


def check_output_place(final: Location) -> None:
    """Refuse an output that would nest in another (it would vanish at that one's next run), or
    replace what ema-ckpt did not write (publishing replaces a directory whole).

    Raises:
        OptionError: ``final`` lies inside an ema-ckpt output, or is one holding entries its
            manifest does not list.
    """
    for parent in enclosing_folders(final):
        if (parent / MANIFEST_NAME).is_file():
            raise OptionError("out", f"{final} is inside the ema-ckpt output {parent}, which its next run "
                              "replaces whole; write the output elsewhere", value=final)
    if not (final / MANIFEST_NAME).is_file():
        return
    manifest = Manifest.read(final, check=False)  # only its file list: a run that may replace it got here
    listed = set(manifest.files) if manifest is not None else set()
    entries: list[Location] = sorted(final.iterdir(), key=lambda p: p.name)
    for entry in entries:
        if entry.name not in OUTPUT_OWN_FILES and entry.name not in listed:
            kind = "directory" if entry.is_dir() else "file"
            raise OptionError("out", f"{final} holds the {kind} {entry.name}, which ema-ckpt did not write there; "
                              f"the new output replaces {final} whole: move {entry.name} away, or write "
                              "elsewhere", value=final)
