"""The one place that turns errors into user messages and exit codes.

Every command body runs inside :func:`reports_errors`: an error becomes one line on stderr and
its exit code (:data:`ema_ckpt.errors.EXIT_CODES`, which the top-level ``--help`` lists); an
unexpected one also says to set ``EMA_CKPT_DEBUG=1`` for the traceback. Library errors name
library parameters, worded here as this CLI's flags (:func:`._flags.flag_for`):

    >>> from ema_ckpt.errors import OptionError
    >>> error_message(OptionError("at_step", "5 is before the first checkpoint (step 10)", value=5))
    ('--at-step 5 is before the first checkpoint (step 10)', 2)
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from typer.core import TyperArgument

from .. import _signals
from .._signals import Terminated, exit_code
from .._text import escaped
from ..errors import EXIT_CODES, EmaCkptError, OutputError, worded
from ._flags import flag_for
from ._output import err_console, error

F = TypeVar("F", bound=Callable[..., Any])

INTERNAL_ERROR = EmaCkptError.exit_code  # 1
OS_ERROR = OutputError.exit_code  # 7: an OSError that no ema-ckpt error wraps


def exit_codes_help() -> str:
    """The exit codes of :data:`~ema_ckpt.errors.EXIT_CODES` as the top-level ``--help`` shows them.

    Indented four spaces: ``docs/cli.md`` (generated from the help) shows them as a code block.

        >>> print(exit_codes_help().splitlines()[7])
            5    the output was made with other settings (--restart starts over)
    """
    rows = "\n".join(f"    {row.code:<4} {worded(row.meaning, flag_for)}" for row in EXIT_CODES)
    return f"Exit codes:\n\n{rows}\n"


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]


def error_message(err: BaseException) -> tuple[str, int]:
    """The one-line message and exit code for ``err``.

    A message is escaped whole, never cut: a path or key holding a newline shows it as ``\\x0a``
    (the rest of the line is what tells which file). Only a foreign exception's own text, which
    may run over many lines, is cut to its first.
    """
    if isinstance(err, EmaCkptError):
        return escaped(err.render(flag_for).strip()), err.exit_code
    if isinstance(err, OSError):
        where = f"{err.filename}: " if err.filename else ""
        return escaped(f"{where}{err.strerror or _first_line(str(err))}"), OS_ERROR
    return escaped(f"internal error: {type(err).__name__}: {_first_line(str(err))}"), INTERNAL_ERROR


def usage_name(param: Any) -> str:
    """How a usage line and an error name a command's parameter: ``CHECKPOINTS...``, ``SRC``, ``--out``."""
    if isinstance(param, TyperArgument):
        name = (param.metavar or param.name or "").upper() + ("..." if param.nargs != 1 else "")
        return name if param.required else f"[{name}]"
    opts = list(getattr(param, "opts", ()))
    return max(opts, key=len) if opts else str(getattr(param, "name", ""))


def _clause(text: str) -> str:
    """A parser message as a clause: first letter lower case (unless the word is upper case), no stop."""
    text = _first_line(text).rstrip(".")
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def usage_error_line(err: typer.TyperException, command: str | None = None) -> tuple[str, int]:
    """A command-line parse error (Click's, as :class:`typer.TyperException`) as one line, and its
    exit code. Its kind shows in the attributes it carries (``option_name`` and ``possibilities``:
    an unknown option; ``param``: a bad or missing value); ``command`` names the command where the
    error carries no ``ctx``:

        >>> class NoSuchOption(typer.TyperException):
        ...     exit_code, ctx, option_name, possibilities = 2, None, "--outt", ["--out"]
        >>> usage_error_line(NoSuchOption("No such option: --outt"))
        ("no such option --outt (did you mean --out?); see 'ema-ckpt --help'", 2)
    """
    ctx = getattr(err, "ctx", None)
    param = getattr(err, "param", None)
    possibilities = getattr(err, "possibilities", None)
    if hasattr(err, "option_name") and hasattr(err, "possibilities"):
        what = f"no such option {err.option_name}"
    elif param is not None and hasattr(err, "param_type"):
        what = f"missing {'argument' if isinstance(param, TyperArgument) else 'option'} {usage_name(param)}"
    elif param is not None:
        what = f"invalid value for {usage_name(param)}: {_clause(err.message)}"
    else:  # Typer words its suggestion of a command into the message: "… Did you mean 'x'?"
        what = re.sub(r"\. Did you mean (.+)\?$", r" (did you mean \1?)", _clause(err.format_message()))
        possibilities = None
    if possibilities:
        what += f" (did you mean {next(iter(possibilities))}?)"
    if ctx is not None:
        command = ctx.info_name if ctx.parent is not None else None
    line = f"{command}: {what}" if command else what
    code = int(getattr(err, "exit_code", 2))
    if code == 2:
        line += f"; see 'ema-ckpt {command} --help'" if command else "; see 'ema-ckpt --help'"
    return escaped(line), code


def _interrupt_behind(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM an exception was raised from, if any (its cause or context chain)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def reports_errors(command: F) -> F:
    """Run a command body, mapping every failure to one line and an exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _signals.armed():
                return command(*args, **kwargs)
        except typer.Exit:
            raise
        except (KeyboardInterrupt, Exception) as err:
            # Ctrl-C or SIGTERM, itself or wrapped by Python, or swallowed by code (an import)
            stop = _interrupt_behind(err) or _signals.raised()
            if stop is not None:
                what = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
                err_console.print(f"{what}; the previous output is intact", style="yellow", highlight=False)
                raise typer.Exit(exit_code(stop)) from None
            if os.environ.get("EMA_CKPT_DEBUG") and not isinstance(err, EmaCkptError):
                raise
            message, code = error_message(err)
            hint = "" if isinstance(err, EmaCkptError) else " (set EMA_CKPT_DEBUG=1 for a traceback)"
            error(f"{message}{hint}", soft_wrap=True)
            raise typer.Exit(code) from None

    return wrapper  # type: ignore[return-value]
