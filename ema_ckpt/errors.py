"""One error hierarchy for ema-ckpt.

Every error the library raises on purpose derives from :class:`EmaCkptError`. Each
class carries the process exit code the CLI uses for it, so scripts can tell a busy
output (another run holds the lock) from bad input or a bad option.

Example:
    >>> try:
    ...     raise CheckpointFormatError("/ckpts/step_10/.metadata", "not a DCP metadata file")
    ... except EmaCkptError as err:
    ...     print(err.exit_code, err)
    3 /ckpts/step_10/.metadata: not a DCP metadata file
"""

from __future__ import annotations

from pathlib import Path


class EmaCkptError(Exception):
    """Base of every error raised on purpose by ema-ckpt."""

    exit_code: int = 1


class UsageError(EmaCkptError, ValueError):
    """An option or a combination of options that cannot work."""

    exit_code = 2


class CheckpointError(EmaCkptError):
    """A problem with one checkpoint file or directory; names the path."""

    exit_code = 3

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was expected (missing path, empty folder, no metadata)."""


class CheckpointFormatError(CheckpointError):
    """A file that is not what its format says: truncated, corrupt, or unsupported."""


class UnsafePickleError(CheckpointFormatError):
    """A pickle that refers to something outside the allowlist; nothing from it ran."""


class IncompatibleCheckpointError(EmaCkptError):
    """Checkpoints that cannot be combined: keys, shapes or dtypes differ."""

    exit_code = 4


class ManifestMismatchError(EmaCkptError):
    """The existing output was made with other settings; ``--restart`` starts over."""

    exit_code = 5


class NonFiniteError(IncompatibleCheckpointError):
    """A checkpoint holds NaN or Inf values; ``source`` is its index among the run's inputs."""

    exit_code = 6

    def __init__(self, source: int, message: str) -> None:
        super().__init__(message)
        self.source = source

    def __reduce__(self) -> tuple:
        return (type(self), (self.source, str(self)))


class OutputLockedError(EmaCkptError):
    """Another run holds the lock on the output."""

    exit_code = 75  # EX_TEMPFAIL: cron wrappers retry on it.


class OutputError(EmaCkptError, OSError):
    """Writing the output failed (disk full, permissions); the previous output is intact."""

    exit_code = 7
