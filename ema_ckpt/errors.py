"""One error hierarchy for ema-ckpt: every error raised on purpose derives from :class:`EmaCkptError`,
whose class carries the exit code the CLI ends with (:data:`EXIT_CODES`, which ``--help`` and the
docs follow), so scripts can tell a busy output from bad input or a bad option.

    >>> err = CheckpointFormatError("/ckpts/step_10/.metadata", "not a DCP metadata file")
    >>> err.exit_code, str(err)
    (3, '/ckpts/step_10/.metadata: not a DCP metadata file')

Errors carry data; the CLI words them. The library never names a command-line flag: an error
names the *library parameter* at fault (:class:`OptionError`'s ``option``) and the one whose
value would fix it (``remedy``). In a message, ``{name}`` stands for the parameter ``name`` and
``{name=text}`` for passing it a value; only the names the error declares (``option``,
``remedy``, ``mentions``, as string literals: a test reads them) are placeholders, so text from
checkpoints or users is never mistaken for one. ``str(err)`` names library parameters; the CLI
renders the same error with its flags (``ema_ckpt.cli._flags``). Errors pickle whole, so a
worker hands one to rank 0 as itself.

    >>> err = ManifestMismatchError("out/ema was made with decay 0.9; pass {restart=True} to start over",
    ...                             remedy="restart")
    >>> err.render({"restart": "--restart"}.__getitem__)
    'out/ema was made with decay 0.9; pass --restart to start over'
    >>> str(OptionError("from_step", "40 is after {to_step} 20", value=40, mentions=("to_step",)))
    'from_step 40 is after to_step 20'

Notes and warnings in results are :class:`Note` strings, with the same placeholders and wordings;
``+`` keeps their placeholders, and an error given a note as its message takes them over:

    >>> note = Note("skipped step_3: left out ({skip})", mentions=("skip",))
    >>> str(CheckpointNotFoundError("ckpts", "no checkpoints found (" + note + ")"))
    'ckpts: no checkpoints found (skipped step_3: left out (skip))'
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .storage import Location

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:=([^{}]*))?\}")


def _worded(template: str, names: Iterable[str], name_of: Callable[[str], str] | None) -> str:
    declared = set(names)

    def word(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if name not in declared:
            return match.group(0)
        if name_of is None:
            return name if value is None else f"{name}={value}"  # the library's: at_step, restart=True
        flag = name_of(name)
        return flag if value in (None, "True") else f"{flag} {value}"

    return _PLACEHOLDER.sub(word, template) if declared else template


class Note(str):
    """A note or warning in a result: plain text naming library parameters, placeholders kept.

    ``str`` of it (its value) is the library's wording; :meth:`render` words the placeholders
    of ``mentions`` as another caller names them (the CLI: flags). ``+`` with text or another
    note keeps every placeholder:

        >>> hint = Note("pass {step_regex} to take the name as the step", mentions=("step_regex",))
        >>> ("no step record; " + hint).render(lambda name: "--step-regex")
        'no step record; pass --step-regex to take the name as the step'
    """

    template: str
    mentions: tuple[str, ...]

    def __new__(cls, template: str = "", *, mentions: Iterable[str] = ()) -> Note:
        mentions = tuple(mentions)
        self = super().__new__(cls, _worded(template, mentions, None))
        self.template = template
        self.mentions = mentions
        return self

    @staticmethod
    def of(text: str) -> Note:
        """``text`` as a note: itself when it is one, else plain text (no placeholders)."""
        return text if isinstance(text, Note) else Note(text)

    @staticmethod
    def joined(separator: str, texts: Iterable[str]) -> Note:
        """``separator.join(texts)``, keeping the placeholders of the notes among ``texts``."""
        notes = [Note.of(text) for text in texts]
        return Note(separator.join(n.template for n in notes),
                    mentions=dict.fromkeys(name for n in notes for name in n.mentions))

    def render(self, name_of: Callable[[str], str] | None = None) -> str:
        """The text with each placeholder worded by ``name_of`` (None: the library's names)."""
        return _worded(self.template, self.mentions, name_of)

    def __add__(self, other: str) -> Note:
        return Note.joined("", (self, other))

    def __radd__(self, other: str) -> Note:
        return Note.joined("", (other, self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_note, (self.template, self.mentions))


def _note(template: str, mentions: tuple[str, ...]) -> Note:
    return Note(template, mentions=mentions)


def worded(text: str, name_of: Callable[[str], str] | None = None) -> str:
    """A note, warning or plain text worded by ``name_of``: ``Note.render``, or the text itself."""
    return text.render(name_of) if isinstance(text, Note) else str(text)


@dataclass(frozen=True)
class ExitCode:
    """One row of :data:`EXIT_CODES`: a status the ``ema-ckpt`` process ends with, and its meaning.

    ``meaning`` may be a :class:`Note`: the CLI words its parameters as flags.

        >>> row = EXIT_CODES[5]
        >>> row.code, row.meaning.render({"restart": "--restart"}.__getitem__)
        (5, 'the output was made with other settings (--restart starts over)')
    """

    code: int
    meaning: str


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(0, 'success, including "nothing new to fold"'),
    ExitCode(1, "unexpected internal error (EMA_CKPT_DEBUG=1 shows the traceback)"),
    ExitCode(2, "bad option or combination of options"),
    ExitCode(3, "a checkpoint is missing, unreadable, truncated, corrupt or unsafe"),
    ExitCode(4, "checkpoints cannot be combined (keys, shapes, dtypes, steps)"),
    ExitCode(5, Note("the output was made with other settings ({restart=True} starts over)",
                     mentions=("restart",))),
    ExitCode(6, "a checkpoint holds NaN/Inf values"),
    ExitCode(7, "writing the output failed; the previous output is intact"),
    ExitCode(8, "a worker of the run was lost (node down, network cut, launcher gone)"),
    ExitCode(9, "object storage failed or did not answer; nothing was published"),
    ExitCode(10, "select: the evaluation command failed on every candidate (the scores it kept are cached)"),
    ExitCode(75, Note("another run holds the output's lock (retry later, or {wait_seconds=SECONDS})",
                      mentions=("wait_seconds",))),
    # CPython's own status when flushing stdout or stderr at exit fails (a closed pipe)
    ExitCode(120, "the command ended but its output could not be flushed"),
    ExitCode(130, "interrupted (Ctrl-C); the previous output is intact"),
    ExitCode(143, "stopped by SIGTERM (Slurm, systemd, Kubernetes, timeout), as Ctrl-C"),
)
"""Every status the CLI can exit with, in order. Scripts and cron wrappers branch on these."""


def _restore(cls: type[EmaCkptError], args: tuple[Any, ...], state: dict[str, Any]) -> EmaCkptError:
    err = cls.__new__(cls, *args)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class EmaCkptError(Exception):
    """Base of every error raised on purpose by ema-ckpt; ``message`` may hold placeholders for
    ``remedy`` and ``mentions`` (see the module docstring)."""

    exit_code: int = 1
    template: str = ""
    remedy: str | None = None
    mentions: tuple[str, ...] = ()

    def __init__(self, message: str = "", *, remedy: str | None = None, mentions: Iterable[str] = ()) -> None:
        if isinstance(message, Note):  # its placeholders become the error's
            mentions = (*message.mentions, *mentions)
            message = message.template
        self.template = message
        self.remedy = remedy
        self.mentions = tuple(dict.fromkeys(mentions))
        super().__init__(self.render())

    @property
    def parameters(self) -> tuple[str, ...]:
        """Every library parameter the message names (placeholders), the remedy included."""
        return self.mentions + ((self.remedy,) if self.remedy is not None else ())

    def render(self, name_of: Callable[[str], str] | None = None) -> str:
        """The message with each placeholder worded: ``name_of(parameter)`` gives a flag.

        Without ``name_of``, the library's own names (``str(err)``). With it, ``{name=True}``
        becomes the flag alone and ``{name=text}`` the flag followed by ``text``.
        """
        if not self.template:
            return str(self.args[0]) if self.args else ""
        return _worded(self.template, self.parameters, name_of)

    def note(self) -> Note:
        """The message as a :class:`Note`, placeholders kept: to build another message on it."""
        return Note(self.template, mentions=self.parameters) if self.template else Note.of(str(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.args, self.__dict__))


class UsageError(EmaCkptError, ValueError):
    """An option or a combination of options that cannot work."""

    exit_code = 2


class OptionError(UsageError):
    """A library parameter ``option`` (never a flag) whose ``value`` cannot work (None: the message
    is about its absence or form). The message starts with the option unless it places ``{option}``
    itself. Example:

        >>> OptionError("decay", "must lie strictly between 0 and 1, got 1.5", value=1.5).args[0]
        'decay must lie strictly between 0 and 1, got 1.5'
    """

    def __init__(self, option: str, message: str, *, value: object = None, remedy: str | None = None,
                 mentions: Iterable[str] = ()) -> None:
        self.option = option
        self.value = value
        if not re.search(r"\{" + re.escape(option) + r"(?:=[^{}]*)?\}", message):
            message = f"{{{option}}} {message}"
        super().__init__(message, remedy=remedy, mentions=(option, *mentions))


class CheckpointError(EmaCkptError):
    """A problem with one checkpoint file or directory; names the path."""

    exit_code = 3

    def __init__(self, path: str | os.PathLike[str] | Location, reason: str, *, remedy: str | None = None,
                 mentions: Iterable[str] = ()) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(Note.of(self.path) + ": " + reason, remedy=remedy, mentions=mentions)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was expected (missing path, empty folder, no metadata)."""


class CheckpointFormatError(CheckpointError):
    """A file that is not what its format says: truncated, corrupt, or unsupported."""


class UnplacedCheckpointError(CheckpointFormatError):
    """A checkpoint like the others that no record places at a step: folding the rest would be a
    partial result."""


class UnsafePickleError(CheckpointFormatError):
    """A pickle that refers to something outside the allowlist; nothing from it ran."""


class RecordChecksumError(CheckpointFormatError):
    """Bytes read from a ``torch.save`` zip do not match the CRC-32 its directory records: the
    file was damaged after it was written (a hole, a torn copy)."""


class IncompatibleCheckpointError(EmaCkptError):
    """Checkpoints that cannot be combined: keys, shapes or dtypes differ."""

    exit_code = 4


class ManifestMismatchError(EmaCkptError):
    """The existing output was made with other settings; ``restart=True`` starts over."""

    exit_code = 5


class NonFiniteError(IncompatibleCheckpointError):
    """A checkpoint holds NaN or Inf values; ``source`` is its index among the run's inputs."""

    exit_code = 6

    def __init__(self, source: int, message: str, *, remedy: str | None = None,
                 mentions: Iterable[str] = ()) -> None:
        super().__init__(message, remedy=remedy, mentions=mentions)
        self.source = source


class OutputLockedError(EmaCkptError):
    """Another run holds the lock on the output."""

    exit_code = 75  # EX_TEMPFAIL: cron wrappers retry on it.


class PeerLostError(EmaCkptError):
    """A worker of the group is gone or silent (node down, network cut); nothing was published."""

    exit_code = 8


class RemoteStorageError(EmaCkptError):
    """Object storage refused a request for good: access denied, no such bucket, a wrong region,
    the endpoint unreachable, or transient errors past the client's retries."""

    exit_code = 9


class EvaluationError(EmaCkptError):
    """``select``: the evaluation command failed on every candidate; nothing was published."""

    exit_code = 10


class FoldError(EmaCkptError):
    """A training callback's fold failed (raised at the end of training with ``strict=True``;
    without it the failure is logged and training goes on)."""


class OutputError(EmaCkptError, OSError):
    """Writing the output failed (disk full, permissions); the previous output is intact."""

    exit_code = 7


def one_line(err: BaseException) -> str:
    r"""``err`` in one line: the first of its message, after its type's name unless it is one of
    ours (whose messages say what went wrong themselves).

    Example:
        >>> one_line(ValueError("bad\nmore")), one_line(CheckpointFormatError("ck", "torn"))
        ('ValueError: bad', 'ck: torn')
    """
    first = (str(err).strip().splitlines() or [""])[0]
    return first if isinstance(err, EmaCkptError) else f"{type(err).__name__}: {first}"
