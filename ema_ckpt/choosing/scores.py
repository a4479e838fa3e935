"""The score cache of ``select``: one JSON file, keyed by what a candidate *is*.

A candidate's key hashes its terms (each input's resolved path, fingerprint, step and
coefficient, exactly) with everything else that changes its score: the evaluation command,
the metric, the format and dtype it is written in, the keys kept. A rerun, a widened grid or
a resumed selection evaluates only keys not yet scored; a checkpoint rewritten in place, or
another command, gets new keys. Failed evaluations are recorded for the report but tried
again by the next run.

The file is replaced atomically after every evaluation, so a selection killed at any moment
keeps every score it finished.

Example:
    >>> cache = ScoreCache(Path("/nonexistent/scores.json"))
    >>> cache.get("abc") is None
    True
"""

from __future__ import annotations

import hashlib
import json
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
            data = json.loads(self.path.read_text())
            if data.get("version") != _VERSION:
                raise ValueError(f"version {data.get('version')!r}")
            self.entries = {key: CacheEntry(**entry) for key, entry in data["entries"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            raise OptionError("cache", f"{self.path}: not a score cache ema-ckpt can read ({err}); move it away "
                              "to start over", value=str(self.path)) from None

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
