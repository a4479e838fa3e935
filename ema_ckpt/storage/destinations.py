"""Where an output is published: the one protocol a run uses, on a local disk or in object storage.

A run asks its :class:`Destination` to **recover** what a killed run left, **stage** the output,
give each worker a :class:`Sink` to write into, and **publish** the staged files by their roles;
a local output is swapped in with one rename (:mod:`.local_publish`), one in object storage is
uploaded as workers write it and committed last (:mod:`.object_publish`).

Example:
    >>> import tempfile; root = Path(tempfile.mkdtemp())
    >>> dest = destination_for(root / "ema")
    >>> staged = dest.stage(generation="20261202T010203-ab12cd")
    >>> sink = dest.sink(staged, coordinator=True)
    >>> _ = (sink.directory / "model.safetensors").write_bytes(b"...")
    >>> sink.written(["model.safetensors"])
    >>> dest.publish(staged, {"model.safetensors": "data"})
    >>> sorted(p.name for p in (root / "ema").iterdir())
    ['model.safetensors']
"""

from __future__ import annotations

import abc
import contextlib
import shutil
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .local_publish import OutputLock, new_staging_dir, publish, publish_file, recover
from .locations import Location
from .object_lock import HeldLock, RemoteLock
from .object_paths import RemotePath
from .object_publish import (
    begin_upload,
    commit_upload,
    local_staging_dir,
    recover_remote,
    upload_data_files,
)

Replaced = Callable[[], Collection[str]]  # the previous output's names a new one replaces


@dataclass(frozen=True)
class Staged:
    """An output's staging, sent to every worker: its directory, and the tag this run's data
    files carry in their names (object storage only)."""

    directory: Path
    file_tag: str | None = None


@dataclass
class Sink:
    """Where one worker writes one output (a local directory), and what becomes of the files
    written there (:meth:`written`). ``one_writer``: only one worker may write it."""

    final: Location
    directory: Path
    file_tag: str | None = None
    one_writer: bool = False
    send: Callable[[Path, Iterable[str]], None] | None = None
    own: bool = False  # the directory is this worker's own (removed by close), not the staging

    def written(self, names: Iterable[str]) -> None:
        if self.send is not None:
            self.send(self.directory, names)

    def close(self) -> None:
        if self.own:
            shutil.rmtree(self.directory, ignore_errors=True)


class Destination(abc.ABC):
    """One output's final place, and how a run stages and publishes it there. ``near``: stage
    beside this directory instead (a sweep's outputs live inside it)."""

    names_kept = True  # data files keep their writer's names (in object storage they carry the generation)

    def __init__(self, final: Location, *, near: Location | None = None, single_file: bool = False) -> None:
        self.final = final
        self.near = near
        self.single_file = single_file

    @abc.abstractmethod
    def recover(self) -> list[str]:
        """Repair what a killed run left; notes of what was done."""

    @abc.abstractmethod
    def stage(self, *, generation: str) -> Staged:
        """Coordinator: where the output is built (``generation``: this run's tag)."""

    @abc.abstractmethod
    def sink(self, staged: Staged, *, coordinator: bool) -> Sink:
        """Where this worker writes the output staged as ``staged``."""

    @abc.abstractmethod
    def publish(self, staged: Staged, roles: Mapping[str, str], *, replaces: Replaced = set,
                lock: HeldLock | None = None) -> None:
        """Make the staged files the output (``replaces``: asked where it is not swapped in whole)."""

    def abandon(self) -> None:
        """After a failed attempt: undo what it sent on (a local staging is simply removed)."""
        return None


class LocalDestination(Destination):
    """An output on a local or shared filesystem: built beside its place, swapped in whole by a rename."""

    final: Path

    def recover(self) -> list[str]:
        return recover(self.final)

    def stage(self, *, generation: str) -> Staged:
        near = self.near if isinstance(self.near, Path) else None
        return Staged(new_staging_dir(self.final, near=near))

    def sink(self, staged: Staged, *, coordinator: bool) -> Sink:
        return Sink(self.final, staged.directory)  # every worker writes into the one staging

    def publish(self, staged: Staged, roles: Mapping[str, str], *, replaces: Replaced = set,
                lock: HeldLock | None = None) -> None:
        (publish_file if self.single_file else publish)(staged.directory, self.final)


class ObjectDestination(Destination):
    """An output in object storage: built on local disks, uploaded as finished, committed last."""

    final: RemotePath
    names_kept = False

    def __init__(self, final: RemotePath, *, near: Location | None = None, single_file: bool = False) -> None:
        super().__init__(final, near=near, single_file=single_file)
        self._generation: str | None = None  # the coordinator's, once staged

    def recover(self) -> list[str]:
        return recover_remote(self.final)

    def stage(self, *, generation: str) -> Staged:
        staging = local_staging_dir(self.final)
        if self.single_file:
            return Staged(staging)
        self._generation = generation
        begin_upload(self.final, generation)
        return Staged(staging, generation)

    def sink(self, staged: Staged, *, coordinator: bool) -> Sink:
        tag = staged.file_tag

        def send(directory: Path, names: Iterable[str]) -> None:
            if tag is not None:
                upload_data_files(directory, self.final, names, tag)

        directory = staged.directory if coordinator else local_staging_dir(self.final)  # no shared filesystem
        return Sink(self.final, directory, tag, one_writer=self.single_file, send=send, own=not coordinator)

    def publish(self, staged: Staged, roles: Mapping[str, str], *, replaces: Replaced = set,
                lock: HeldLock | None = None) -> None:
        if lock is not None:
            lock.check()
        if staged.file_tag is None:  # a single file: one PUT (a multipart upload appears once complete)
            self.final.upload(staged.directory / self.final.name)
        else:
            commit_upload(staged.directory, self.final, staged.file_tag, roles, replaces=replaces(), lock=lock)
        shutil.rmtree(staged.directory, ignore_errors=True)

    def abandon(self) -> None:
        # what this attempt uploaded goes (an upload already switched over is finished instead);
        # where the store itself failed, the next run recovers it
        if self._generation is not None:
            with contextlib.suppress(Exception):
                recover_remote(self.final)


def destination_for(final: Location, *, near: Location | None = None, single_file: bool = False) -> Destination:
    """The :class:`Destination` of an output at ``final``."""
    if isinstance(final, RemotePath):
        return ObjectDestination(final, near=near, single_file=single_file)
    return LocalDestination(final, near=near, single_file=single_file)


def output_lock(path: Location, *, wait_seconds: float = 0.0) -> contextlib.AbstractContextManager[HeldLock]:
    """The exclusive lock of the output at ``path`` (enter it to take it)."""
    if isinstance(path, RemotePath):
        return RemoteLock(path, wait_seconds=wait_seconds)
    return OutputLock(path, wait_seconds=wait_seconds)


__all__ = ["Destination", "HeldLock", "LocalDestination", "ObjectDestination", "Sink", "Staged", "destination_for",
           "output_lock"]
