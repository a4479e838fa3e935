"""The options commands share, declared once as groups a command's options inherit; each group
checks its fields when made, with no I/O. Fields marked :data:`RUNTIME` no manifest records.

Example:
    >>> @dataclass(frozen=True, kw_only=True)
    ... class CopyOptions(KeyFields, RunFields):
    ...     pass
    >>> CopyOptions(include=("*.weight",), workers=2).workers
    2
    >>> CopyOptions(include=["*.weight"])
    Traceback (most recent call last):
    ...
    ema_ckpt.errors.OptionError: include must be a tuple of texts, got ['*.weight']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import OptionError
from .formats.options import ReadOptions, read_options_from
from .storage import Location, as_path, is_location, output_location, output_path

RUNTIME = {"recorded": False}
"""Field metadata of an option that says where or how a run runs, not what it computes."""


def check_texts(options: object, *names: str, paths: bool = False) -> None:
    """Refuse a field of ``options`` that is not a tuple of texts (``paths``: of locations)."""
    for name in names:
        value = getattr(options, name)
        if not isinstance(value, tuple) or not all(is_location(v) if paths else isinstance(v, str) for v in value):
            raise OptionError(name, f"must be a tuple of {'paths' if paths else 'texts'}, got {value!r}", value=value)


class _Checked:
    """The end of the chain of checks: each group's ``__post_init__`` checks its fields, then the next."""

    def __post_init__(self) -> None:
        return None


@dataclass(frozen=True, kw_only=True)
class RunFields(_Checked):
    """How a run runs: ``wait_seconds`` for another run's lock, ``workers``, the ``device``."""

    wait_seconds: float = field(default=0.0, metadata=RUNTIME)
    workers: int = field(default=1, metadata=RUNTIME)
    device: str = field(default="cpu", metadata=RUNTIME)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.workers, int) or self.workers < 1:
            raise OptionError("workers", f"must be a whole number above 0, got {self.workers!r}", value=self.workers)
        if self.wait_seconds < 0:
            raise OptionError("wait_seconds", f"must be 0 or more, got {self.wait_seconds}", value=self.wait_seconds)
        from .engine import check_device

        check_device(self.device)


@dataclass(frozen=True, kw_only=True)
class ReadFields(_Checked):
    """How checkpoints are read (:class:`~ema_ckpt.formats.options.ReadOptions`)."""

    state_key: str | None = None
    inert_globals: tuple[str, ...] = field(default=(), metadata=RUNTIME)
    keep_prefix: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_texts(self, "inert_globals")
        read_options_from(self)  # refuses a bad pattern or state key

    @property
    def read(self) -> ReadOptions:
        return read_options_from(self)


@dataclass(frozen=True, kw_only=True)
class KeyFields(_Checked):
    """Which keys a run reads: glob patterns to ``include`` and to ``exclude``."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_texts(self, "include", "exclude")


@dataclass(frozen=True, kw_only=True)
class InputFields(_Checked):
    """What a run reads: the ``checkpoints`` given, those to ``skip``, and how each is placed."""

    checkpoints: tuple[Location, ...]
    skip: tuple[Location, ...] = ()
    step_regex: str | None = None
    step_from: str | None = None
    component: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_texts(self, "checkpoints", "skip", paths=True)


def command_options(given: dict[str, Any]) -> dict[str, Any]:
    """A library call's arguments as its options take them: lists made tuples, paths made
    locations, ``out`` where its output is published (:func:`~ema_ckpt.storage.output_path`).

    >>> command_options({"checkpoints": "ckpts", "include": ["*.weight"]})
    {'checkpoints': (PosixPath('ckpts'),), 'include': ('*.weight',)}
    """
    options: dict[str, Any] = {name: tuple(v) if isinstance(v, list) else v for name, v in given.items()}
    if "checkpoints" in options:
        checkpoints = options["checkpoints"]
        many = not (isinstance(checkpoints, str) or is_location(checkpoints))
        options["checkpoints"] = tuple(as_path(p) for p in checkpoints) if many else (as_path(checkpoints),)
    if "skip" in options:
        options["skip"] = tuple(as_path(p) for p in options["skip"])
    if options.get("out") is not None:
        options["out"] = output_path(output_location(options["out"]))
    return options


__all__ = ["RUNTIME", "InputFields", "KeyFields", "ReadFields", "RunFields", "check_texts", "command_options"]
