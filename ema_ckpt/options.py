"""The options commands share, each declared once: what a run reads, which keys, how it reads, how it runs.

A command's options dataclass inherits the groups it has and adds its own fields. Every group
checks its fields when the options are made (types, ranges, combinations), with no I/O: paths
are looked at when the run plans. Fields marked :data:`RUNTIME` say where or how a run runs,
so no manifest records them (:func:`~ema_ckpt.jobs.recorded_options`).

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


def check_texts(options: object, *names: str) -> None:
    """Refuse a field of ``options`` that is not a tuple of texts (lists are made tuples by the caller)."""
    for name in names:
        value = getattr(options, name)
        if not isinstance(value, tuple) or not all(isinstance(item, str) for item in value):
            raise OptionError(name, f"must be a tuple of texts, got {value!r}", value=value)


def check_locations(options: object, *names: str) -> None:
    """Refuse a field of ``options`` that is not a tuple of locations (``Path`` or object-store paths)."""
    for name in names:
        value = getattr(options, name)
        if not isinstance(value, tuple) or not all(is_location(item) for item in value):
            raise OptionError(name, f"must be a tuple of paths, got {value!r}", value=value)


class _Checked:
    """The end of the chain of checks: each group's ``__post_init__`` checks its fields, then the next."""

    def __post_init__(self) -> None:
        return None


@dataclass(frozen=True, kw_only=True)
class RunFields(_Checked):
    """How a run runs: ``wait_seconds`` for another run's lock on the output, ``workers`` local
    processes, the ``device`` of the arithmetic (``cpu``, ``cuda``, ``cuda:N``)."""

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
    """How checkpoints are read (:class:`~ema_ckpt.formats.options.ReadOptions`, made by
    :func:`~ema_ckpt.formats.options.read_options_from`): ``state_key``, ``inert_globals``, ``keep_prefix``."""

    state_key: str | None = None
    inert_globals: tuple[str, ...] = field(default=(), metadata=RUNTIME)
    keep_prefix: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_texts(self, "inert_globals")
        read_options_from(self)  # refuses a bad pattern or state key

    @property
    def read(self) -> ReadOptions:
        """These fields as every reader of the run takes them."""
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
    """What a run reads: the ``checkpoints`` given (folders or checkpoints), those to ``skip``,
    and how each is placed and read: ``step_regex``, ``step_from``, ``component``."""

    checkpoints: tuple[Location, ...]
    skip: tuple[Location, ...] = ()
    step_regex: str | None = None
    step_from: str | None = None
    component: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_locations(self, "checkpoints", "skip")


def command_options(given: dict[str, Any]) -> dict[str, Any]:
    """A library call's arguments as its options dataclass takes them: lists made tuples, the
    ``checkpoints`` and ``skip`` given made paths, ``out`` the place its output is published
    (a symlink's target: :func:`~ema_ckpt.storage.output_path`).

    >>> command_options({"checkpoints": "ckpts", "include": ["*.weight"]})
    {'checkpoints': (PosixPath('ckpts'),), 'include': ('*.weight',)}
    """
    options = as_tuples(given)
    if "checkpoints" in options:
        checkpoints = options["checkpoints"]
        many = not (isinstance(checkpoints, str) or is_location(checkpoints))
        options["checkpoints"] = tuple(as_path(p) for p in checkpoints) if many else (as_path(checkpoints),)
    if "skip" in options:
        options["skip"] = tuple(as_path(p) for p in options["skip"])
    if options.get("out") is not None:
        options["out"] = output_path(output_location(options["out"]))
    return options


def as_tuples(given: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments with each list made a tuple, as the options take them.

    >>> as_tuples({"include": ["*.weight"], "decay": 0.9})
    {'include': ('*.weight',), 'decay': 0.9}
    """
    return {name: tuple(value) if isinstance(value, list) else value for name, value in given.items()}


__all__ = ["RUNTIME", "InputFields", "KeyFields", "ReadFields", "RunFields", "as_tuples", "check_locations",
           "check_texts", "command_options"]
