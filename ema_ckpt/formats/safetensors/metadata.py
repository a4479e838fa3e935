"""A safetensors file's header ``__metadata__``, carried from an input into the safetensors files
made from it, with the output's own provenance beside it.

Image-generation tools keep their training record there (kohya's ``ss_*``, ``modelspec.*``).
The reader offers it as a carried file (:data:`~..base.SAFETENSORS_METADATA_FILE`), kept like
``config.json``; the writer puts it back into each header (:func:`header_metadata`), under its
own keys (``format``) and the provenance (``ema_ckpt.version``, ``.kind``, ``.step``,
``.decay``, ``.profile``), which an input never overwrites.

Example:
    >>> header = header_metadata({"ss_network_dim": "16", "format": "np", "ema_ckpt.step": "1"},
    ...                          provenance(kind="ema", step=20, profile={"kind": "exponential", "decay": 0.5}))
    >>> header["format"], header["ss_network_dim"], header["ema_ckpt.step"], header["ema_ckpt.decay"]
    ('pt', '16', '20', '0.5')
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..._version import __version__
from ...errors import CheckpointFormatError
from ...storage import Location
from ..base import SAFETENSORS_METADATA_FILE, CarriedFile

OWN_KEYS = {"format": "pt"}
"""The writer's own header entries (what torch's ``save_file`` writes)."""
PROVENANCE_PREFIX = "ema_ckpt."
"""Keys of the provenance ema-ckpt adds: an input's keys of this prefix are never carried."""
MAX_METADATA_BYTES = 4 << 20
"""The most header metadata carried (UTF-8 keys and values); a header beyond it carries none."""
MAX_PROFILE_CHARS = 512


def carried_metadata(metadata: Any) -> dict[str, str] | None:
    """What of a header's ``__metadata__`` is carried: every entry but the writer's own keys and
    ``ema_ckpt.*``; None when nothing is left, or when it is not a string-to-string map of
    valid UTF-8 of at most :data:`MAX_METADATA_BYTES`."""
    if not isinstance(metadata, Mapping):
        return None
    kept: dict[str, str] = {}
    size = 0
    for key, value in metadata.items():
        if not (isinstance(key, str) and isinstance(value, str)):
            return None
        if key in OWN_KEYS or key.startswith(PROVENANCE_PREFIX):
            continue
        try:
            size += len(key.encode("utf-8")) + len(value.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: no safetensors loader reads it back
            return None
        if size > MAX_METADATA_BYTES:
            return None
        kept[key] = value
    return kept or None


def metadata_file(metadata: Mapping[str, str]) -> CarriedFile | None:
    """A header's carried metadata as :data:`~..base.SAFETENSORS_METADATA_FILE`, or None."""
    kept = carried_metadata(metadata)
    return None if kept is None else CarriedFile(SAFETENSORS_METADATA_FILE, json.dumps(
        kept, ensure_ascii=False).encode("utf-8"))


def metadata_from_carried(files: Sequence[CarriedFile], source: Location | str) -> dict[str, str]:
    """The header metadata among carried files ({} when none; ``CheckpointFormatError`` when edited badly)."""
    file = next((f for f in files if f.name == SAFETENSORS_METADATA_FILE), None)
    if file is None:
        return {}
    where = f"{source}/{file.name}"
    try:
        doc = json.loads(file.data)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(where, f"not JSON ({err})") from None
    if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
        raise CheckpointFormatError(where, "not a JSON object of strings")
    return carried_metadata(doc) or {}


def provenance(*, kind: str | None = None, step: int | None = None,
               profile: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The ``ema_ckpt.*`` entries of an output's headers."""
    made = {PROVENANCE_PREFIX + "version": __version__}
    if kind:
        made[PROVENANCE_PREFIX + "kind"] = str(kind)
    if step is not None:
        made[PROVENANCE_PREFIX + "step"] = str(int(step))
    if profile:
        decay = profile.get("decay")
        if profile.get("kind") == "exponential" and isinstance(decay, (int, float)):
            made[PROVENANCE_PREFIX + "decay"] = repr(float(decay))
        try:
            text = json.dumps(dict(profile), sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            text = ""
        if text and len(text) <= MAX_PROFILE_CHARS:
            made[PROVENANCE_PREFIX + "profile"] = text
    return made


def provenance_of(source: Any, *, copied: bool, carried: bool) -> dict[str, str]:
    """The provenance of an output written from ``source`` when its caller gave none.

    A computed output: the version alone. A copy of an ema-ckpt output: its manifest's kind,
    step and profile. Any other copy: ``consolidated`` at its step where it ``carried`` header
    metadata, else nothing (the header ``save_file`` writes).
    """
    if not copied:
        return provenance()
    from ...errors import EmaCkptError
    from ...manifest import Manifest

    path = getattr(source, "path", None)
    manifest = None
    try:
        if path is not None and path.is_dir():
            manifest = Manifest.read(path)
    except (EmaCkptError, OSError):  # an edited or unreadable manifest says nothing to trust
        manifest = None
    if manifest is not None:
        return provenance(kind=manifest.kind, step=manifest.step, profile=manifest.profile)
    return provenance(kind="consolidated", step=getattr(source, "step", None)) if carried else {}


def header_metadata(carried: Mapping[str, str] | None, made: Mapping[str, str] | None = None) -> dict[str, str]:
    """A written file's ``__metadata__``: the writer's own keys, the carried entries (never over
    those or ``ema_ckpt.*``), then ``made`` (the provenance; only ``ema_ckpt.*`` keys)."""
    header = dict(OWN_KEYS)
    header.update(carried_metadata(carried) or {})
    for key, value in (made or {}).items():
        if not key.startswith(PROVENANCE_PREFIX) or not isinstance(value, str):
            raise ValueError(f"provenance key {key!r}: must start with {PROVENANCE_PREFIX!r} and hold a string")
        header[key] = value
    return header


__all__ = ["MAX_METADATA_BYTES", "OWN_KEYS", "PROVENANCE_PREFIX", "carried_metadata", "header_metadata",
           "metadata_file", "metadata_from_carried", "provenance", "provenance_of"]
