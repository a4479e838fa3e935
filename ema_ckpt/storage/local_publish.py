"""Durable, atomic output directories and the lock that keeps cron runs apart.

An output is built beside its final place (``.<name>.tmp-<id>``), every file and the
directory are fsynced, then it is swapped in. On Linux the swap is one
``renameat2(RENAME_EXCHANGE)``: readers see the old or the new directory, never a mix
or nothing. Where the filesystem does not support it, the old directory is first renamed
to ``.<name>.old-<id>`` and the new one renamed in; a crash between the two renames is
repaired by :func:`recover` on the next run, which puts the old directory back.

Example:
    >>> import tempfile; from pathlib import Path
    >>> ema = Path(tempfile.mkdtemp()) / "ema"
    >>> with OutputLock(ema, wait_seconds=0):
    ...     notes = recover(ema)
    ...     staging = new_staging_dir(ema)
    ...     _ = (staging / "model.safetensors").write_bytes(b"weights")  # write into staging
    ...     publish(staging, ema)
    >>> [p.name for p in ema.parent.iterdir()], (ema / "model.safetensors").read_bytes()
    (['ema'], b'weights')
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import OutputError, OutputLockedError
from .local_files import fsync_dir, fsync_tree, libc_function
from .locations import Location

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@contextlib.contextmanager
def discard_on_error(stagings: Sequence[Path | None], *, owner: bool = True) -> Iterator[None]:
    """Remove the staging directories when the block fails; ``owner``: this process made them.

    Example:
        >>> import tempfile; from pathlib import Path
        >>> staging = new_staging_dir(Path(tempfile.mkdtemp()) / "ema")
        >>> with discard_on_error([staging]):
        ...     raise OSError("disk full")
        Traceback (most recent call last):
        OSError: disk full
        >>> staging.exists()
        False
    """
    try:
        yield
    except BaseException:
        if owner:
            for staging in stagings:
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
        raise


def staging_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def discard_stagings_in(folder: Location) -> None:
    """Remove the stagings killed runs left among the outputs in ``folder`` (``snapshots/``), any name."""
    if isinstance(folder, Path) and folder.is_dir():
        for leftover in folder.iterdir():
            if leftover.name.startswith(".") and ".tmp-" in leftover.name:
                shutil.rmtree(leftover, ignore_errors=True)


def backup_prefix(final: Path) -> str:
    return f".{final.name}.old-"


def new_staging_dir(final: Path, *, near: Path | None = None) -> Path:
    """An empty directory to build ``final`` in: beside it, or beside ``near`` (a sweep's folder
    ``final`` lies in), so no half-built directory appears in ``near``."""
    anchor = near if near is not None else final
    anchor.parent.mkdir(parents=True, exist_ok=True)
    suffix = f"-{final.name}" if near is not None else ""
    staging = anchor.parent / f"{staging_prefix(anchor)}{os.getpid()}-{secrets.token_hex(4)}{suffix}"
    staging.mkdir()
    return staging  # final's parent (a sweep's folder) is made when the output is published, not before


def _make_parent(final: Path) -> None:
    """Create ``final``'s folder (a sweep's ``OUT``) if missing: only a run that publishes makes it."""
    if not final.parent.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        fsync_dir(final.parent.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2); False where unsupported."""
    func = libc_function("renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if func is None:
        return False
    result = func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish(staging: Path, final: Path) -> None:
    """Make ``staging`` (complete and fsynced) visible as ``final``, atomically."""
    fsync_tree(staging)
    try:
        _make_parent(final)
        if final.exists():
            if _exchange(staging, final):
                fsync_dir(final.parent)
                shutil.rmtree(staging, ignore_errors=True)
                return
            backup = final.parent / f"{backup_prefix(final)}{secrets.token_hex(4)}"
            os.rename(final, backup)
            fsync_dir(final.parent)
            try:
                os.rename(staging, final)
            except OSError:
                os.rename(backup, final)  # put the previous output back before reporting
                fsync_dir(final.parent)
                raise
            fsync_dir(final.parent)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.rename(staging, final)
            fsync_dir(final.parent)
    except OSError as err:
        raise OutputError(f"{final}: cannot publish the new output ({err.strerror})") from None


def publish_file(staging: Path, final: Path) -> None:
    """Move the one file built in ``staging`` (named like ``final``) onto ``final``, atomically."""
    try:
        fsync_tree(staging)
        _make_parent(final)
        os.replace(staging / final.name, final)
        fsync_dir(final.parent)
    except OSError as err:
        raise OutputError(f"{final}: cannot write ({err.strerror})") from None
    shutil.rmtree(staging, ignore_errors=True)


def recover(final: Path) -> list[str]:
    """Repair what a killed run left beside ``final``; notes of what was done. Stagings are
    removed; a backup without ``final`` (a run died between :func:`publish`'s renames) is put back."""
    notes: list[str] = []
    parent = final.parent
    if not parent.is_dir():
        return notes
    backups = sorted(p for p in parent.iterdir() if p.name.startswith(backup_prefix(final)))
    if backups and not final.exists():
        os.rename(backups[0], final)
        fsync_dir(parent)
        notes.append(f"restored {final} from {backups[0].name} (an earlier run was interrupted)")
        backups = backups[1:]
    for path in backups + [p for p in parent.iterdir() if p.name.startswith(staging_prefix(final))]:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as err:
            notes.append(f"could not remove {path.name} left by an interrupted run ({err.strerror})")
            continue
        notes.append(f"removed {path.name} left by an interrupted run")
    return notes


class OutputLock:
    """An exclusive ``flock`` on ``.<name>.lock`` beside an output, removed when released.

    The kernel drops the lock when its holder dies. The holder unlinks the file before it
    unlocks; an acquirer that wins ``flock`` checks that the path still names the file it
    locked and starts over if not, so two runs never hold the lock at once. The lock file is
    never followed through a symlink and never written.
    """

    def __init__(self, final: Path, *, wait_seconds: float = 0.0) -> None:
        self.final = final
        self.path = final.parent / f".{final.name}.lock"
        self.wait_seconds = wait_seconds
        self._fd: int | None = None

    def _open(self) -> int:
        try:
            # never follow a planted symlink; the lock file's content is never written
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        except OSError as err:
            raise OutputError(f"{self.path}: cannot open the lock file ({err.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputError(f"{self.path}: the lock file is not a regular file")
        return fd

    def _names(self, fd: int) -> bool:
        """The lock path still names the file open as ``fd`` (not removed or replaced since)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def check(self) -> None:  # the kernel holds a flock until its holder releases it or dies
        pass

    def __enter__(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.wait_seconds
        pause = 0.001
        fd = self._open()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise OutputLockedError(
                            f"{self.final}: another ema-ckpt run is writing this output "
                            f"(lock {self.path.name}); retry later or pass {{wait_seconds=SECONDS}}",
                            remedy="wait_seconds",
                        ) from None
                    time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                    pause = min(0.2, pause * 2)  # a short wait is noticed at once, a long one polls gently
                    continue
                if self._names(fd):
                    self._fd = fd
                    return self
                # the holder removed the file we waited on (or it was replaced): lock the one the path names now
                os.close(fd)
                fd = -1
                fd = self._open()
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise

    def __exit__(self, *exc: object) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._names(fd):  # removed while still held: no one can lock this file and take it as current
                with contextlib.suppress(OSError):  # a file left behind is harmless: the next run removes it
                    os.unlink(self.path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
