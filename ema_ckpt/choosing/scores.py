"""The score cache of ``select``: one JSON file, keyed by what a candidate *is*.

A candidate's key (:func:`candidate_key`) hashes its terms with everything else that changes
its score, so a rerun or a widened grid evaluates only new keys; failed evaluations are
recorded for the report and tried again by the next run. The file is replaced atomically after
every evaluation, and checked whole when read (a score is a finite number, or None beside a
recorded failure; anything else is refused in one line naming the file and the entry). Each
entry keeps its inputs' fingerprints (``inputs``), which ``select`` compares before it publishes.

Example:
    >>> cache = ScoreCache(Path("/nonexistent/scores.json"))
    >>> cache.get("abc") is None
    True
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import OptionError
from ..manifest import fingerprint
from ..plans import Term
from ..storage import as_path, replace_file

__all__ = ["CacheEntry", "ScoreCache", "candidate_key"]

_VERSION = 1


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A scored (or failed) candidate as the cache keeps it."""

    name: str
    score: float | None
    error: str | None
    seconds: float
    terms: list[dict[str, Any]]
    inputs: dict[str, str] | None = None
    """Each input's fingerprint when the candidate was scored (None: an entry from before this was kept)."""


def candidate_key(terms: Sequence[Term], *, context: dict[str, Any], fingerprints: dict[str, str]) -> str:
    """The cache key of a candidate: its terms (by resolved path, fingerprint, step and the
    coefficient's exact bits) and ``context`` (command, metric, format, dtype, keys kept).

    ``fingerprints`` memoises each input's :func:`~ema_ckpt.manifest.fingerprint`.
    """
    items = []
    for term in sorted(terms, key=lambda t: (t.step, t.path)):
        if term.path not in fingerprints:
            fingerprints[term.path] = fingerprint(as_path(term.path))
        items.append([str(as_path(term.path).resolve()), fingerprints[term.path], term.step,
                      float(term.coefficient).hex()])
    blob = json.dumps({"terms": items, **context}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


class ScoreCache:
    """Scores by candidate key, read from and written back to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, CacheEntry] = {}
        if path.is_file():
            self._read()

    def _read(self) -> None:
        try:
            data = json.loads(self.path.read_text(), parse_constant=_Constant)
            if not isinstance(data, dict):
                raise ValueError(f"holds a JSON {type(data).__name__}, not an object")
            if data.get("version") != _VERSION:
                raise ValueError(f"version {data.get('version')!r}")
            entries = data.get("entries")
            if not isinstance(entries, dict):
                raise ValueError("no 'entries' object")
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise self._refuse(str(err)) from None
        for key, entry in entries.items():
            try:
                self.entries[key] = _entry(entry)
            except ValueError as err:
                raise self._refuse(f"entry {_short(key)}: {err}") from None

    def _refuse(self, why: str) -> OptionError:
        return OptionError("cache", f"{self.path}: not a score cache ema-ckpt can read ({why}); fix it, or move it "
                           "away to start over", value=str(self.path))

    def get(self, key: str) -> CacheEntry | None:
        """The entry of a scored candidate; None when it was never scored or its evaluation failed."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.score is not None else None

    def put(self, key: str, entry: CacheEntry) -> None:
        """Record ``entry`` and write the file (atomically: a kill keeps the previous file whole)."""
        self.entries[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": _VERSION, "entries": {k: asdict(v) for k, v in self.entries.items()}}
        replace_file(self.path, json.dumps(data, indent=1).encode())


_FIELDS = {"name", "score", "error", "seconds", "terms", "inputs"}


class _Constant:
    """``NaN``, ``Infinity`` or ``-Infinity`` as read (not JSON, though Python writes them): refused
    by the entry holding it, which the message then names."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _short(text: object) -> str:
    shown = repr(text)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _entry(entry: object) -> CacheEntry:
    """One entry of the file, checked field by field (ValueError: what is wrong, one line)."""
    if not isinstance(entry, dict):
        raise ValueError(f"is a JSON {type(entry).__name__}, not an object")
    missing = sorted({"name", "score", "error", "seconds", "terms"} - entry.keys())
    if missing:
        raise ValueError(f"has no {', '.join(repr(m) for m in missing)}")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ValueError(f"has an unknown field {_short(unknown[0])}")
    name, score, error, seconds, terms = (entry[f] for f in ("name", "score", "error", "seconds", "terms"))
    if not isinstance(name, str):
        raise ValueError(f"name {_short(name)} is not a string")
    where = f"({name}) "
    if score is None:
        if not isinstance(error, str):
            raise ValueError(f"{where}has neither a score nor a recorded failure (error {_short(error)})")
    elif not _number(score):
        raise ValueError(f"{where}score {_short(score)} is not a finite number")
    if error is not None and not isinstance(error, str):
        raise ValueError(f"{where}error {_short(error)} is not a string")
    if not _number(seconds):
        raise ValueError(f"{where}seconds {_short(seconds)} is not a finite number")
    if not isinstance(terms, list) or not all(
            isinstance(t, dict) and isinstance(t.get("path"), str) and isinstance(t.get("step"), int)
            and _number(t.get("coefficient")) for t in terms):
        raise ValueError(f"{where}terms are not a list of {{path, step, coefficient}}")
    inputs = entry.get("inputs")
    if inputs is not None and not (isinstance(inputs, dict)
                                   and all(isinstance(k, str) and isinstance(v, str) for k, v in inputs.items())):
        raise ValueError(f"{where}inputs are not a map of path to fingerprint")
    return CacheEntry(name, None if score is None else float(score), error, float(seconds), terms, inputs)
