"""Where an output is published: the one protocol a run uses, on a local disk or in object storage.

A run asks its :class:`Destination` to **lock** (:func:`output_lock`), **recover** what a
killed run left, **stage** (a local directory to build the output in), and **publish** the
staged files by their roles (:mod:`.roles`). A local output is swapped in with one rename
(:mod:`.local_publish`); one in object storage is uploaded and committed last
(:mod:`.object_publish`). The run never asks which.

Example:
    >>> import tempfile; root = Path(tempfile.mkdtemp())
    >>> dest = destination_for(root / "ema")
    >>> staging = dest.stage(generation="20261202T010203-ab12cd")
    >>> _ = (staging / "model.safetensors").write_bytes(b"...")
    >>> dest.publish(staging, {"model.safetensors": "data"})
    >>> sorted(p.name for p in (root / "ema").iterdir())
    ['model.safetensors']
"""

from __future__ import annotations

import abc
import contextlib
import shutil
from collections.abc import Collection, Iterable, Mapping
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
    upload_file,
)


class Destination(abc.ABC):
    """One output's final place, and how a run stages and publishes it there.

    ``near``: stage beside this directory instead (the outputs of a sweep live inside it).
    ``single_file``: the output is one file.
    """

    def __init__(self, final: Location, *, near: Location | None = None, single_file: bool = False) -> None:
        self.final = final
        self.near = near
        self.single_file = single_file
        self.generation: str | None = None
        """The tag this run's data files carry in their names (object storage only), once staged."""

    @property
    @abc.abstractmethod
    def shared_staging(self) -> bool:
        """Every worker writes into the coordinator's staging (a local, shared filesystem);
        else each builds its own files in a local directory of its own (:meth:`worker_staging`)."""

    @property
    def one_writer(self) -> bool:
        """The output must be written by one worker."""
        return False

    @property
    @abc.abstractmethod
    def replaced_whole(self) -> bool:
        """A new output takes the previous one's place whole (a directory swapped in by a
        rename), so ``publish`` needs no list of what it replaces."""

    @abc.abstractmethod
    def recover(self) -> list[str]:
        """Repair what a killed run left; notes of what was done."""

    @abc.abstractmethod
    def stage(self, *, generation: str) -> Path:
        """The coordinator's directory to build the output in (``generation``: this run's tag)."""

    def worker_staging(self) -> Path:
        """A worker's own directory, where :attr:`shared_staging` is False."""
        raise NotImplementedError

    def upload_data(self, staging: Path, names: Iterable[str]) -> None:
        """Data files a worker wrote, sent on by that worker (where the output is not local)."""
        return None

    @abc.abstractmethod
    def publish(self, staging: Path, roles: Mapping[str, str], *, replaces: Collection[str] = (),
                lock: HeldLock | None = None) -> None:
        """Make the staged files the output (``roles``: {name: role}; ``replaces``: the previous
        output's names to remove where it is not replaced whole)."""

    def abandon(self) -> None:
        """After a failed attempt: undo what it sent on (a local staging is simply removed)."""
        return None


class LocalDestination(Destination):
    """An output on a local or shared filesystem: built beside its place, swapped in by a rename."""

    final: Path

    @property
    def shared_staging(self) -> bool:
        return True

    @property
    def replaced_whole(self) -> bool:
        return True

    def recover(self) -> list[str]:
        return recover(self.final)

    def stage(self, *, generation: str) -> Path:
        near = self.near if isinstance(self.near, Path) else None
        return new_staging_dir(self.final, near=near)

    def publish(self, staging: Path, roles: Mapping[str, str], *, replaces: Collection[str] = (),
                lock: HeldLock | None = None) -> None:
        (publish_file if self.single_file else publish)(staging, self.final)


class ObjectDestination(Destination):
    """An output in object storage: built on a local disk, uploaded, committed last."""

    final: RemotePath

    @property
    def shared_staging(self) -> bool:
        return False

    @property
    def one_writer(self) -> bool:
        return self.single_file

    @property
    def replaced_whole(self) -> bool:
        return False  # no rename of a prefix: the previous output's files are deleted by name

    def recover(self) -> list[str]:
        return recover_remote(self.final)

    def stage(self, *, generation: str) -> Path:
        staging = local_staging_dir(self.final)
        if not self.single_file:
            self.generation = generation
            begin_upload(self.final, generation)
        return staging

    def worker_staging(self) -> Path:
        return local_staging_dir(self.final)

    def upload_data(self, staging: Path, names: Iterable[str]) -> None:
        if self.generation is not None:
            upload_data_files(staging, self.final, names, self.generation)

    def publish(self, staging: Path, roles: Mapping[str, str], *, replaces: Collection[str] = (),
                lock: HeldLock | None = None) -> None:
        if lock is not None:
            lock.check()
        if self.generation is None:
            upload_file(staging / self.final.name, self.final)
        else:
            commit_upload(staging, self.final, self.generation, roles, replaces=replaces, lock=lock)
        shutil.rmtree(staging, ignore_errors=True)

    def abandon(self) -> None:
        # what this attempt uploaded goes (an upload already switched over is finished instead);
        # where the store itself failed, the next run recovers it
        if self.generation is not None:
            with contextlib.suppress(Exception):
                recover_remote(self.final)


def destination_for(final: Location, *, near: Location | None = None, single_file: bool = False) -> Destination:
    """The :class:`Destination` of an output at ``final``."""
    if isinstance(final, RemotePath):
        return ObjectDestination(final, near=near, single_file=single_file)
    return LocalDestination(final, near=near, single_file=single_file)


def output_lock(path: Location, *, wait_seconds: float = 0.0) -> contextlib.AbstractContextManager[HeldLock]:
    """The exclusive lock of the output at ``path`` (enter it to take it): a ``flock`` beside a
    local output, numbered objects with a lease beside one in object storage."""
    if isinstance(path, RemotePath):
        return RemoteLock(path, wait_seconds=wait_seconds)
    return OutputLock(path, wait_seconds=wait_seconds)


__all__ = ["Destination", "HeldLock", "LocalDestination", "ObjectDestination", "destination_for", "output_lock"]
