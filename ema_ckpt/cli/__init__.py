"""The ``ema-ckpt`` command line: thin adapters over the library.

This package is the only one that imports Typer and rich. Each command lives in its own
module, parses options, calls one library function and renders its result.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

from .. import _signals
from .._compat.fast_exit import exit_now
from .._version import __version__
from . import accumulate as _accumulate
from . import consolidate as _consolidate
from . import diff as _diff
from . import inspect as _inspect
from . import posthoc as _posthoc
from . import reshard as _reshard
from . import select as _select
from . import verify as _verify
from . import watch as _watch
from ._errors import exit_codes_help, usage_error_line, usage_name
from ._output import error


class _Root(TyperGroup):
    """The command group; its epilog (the exit codes, worded with the commands' flags) is made
    when a help page asks for it, not on every start."""

    @property
    def epilog(self) -> str:
        return exit_codes_help()

    @epilog.setter
    def epilog(self, value: str | None) -> None:
        pass  # always the exit codes


app = typer.Typer(
    cls=_Root,
    name="ema-ckpt",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_show_locals=False,  # locals here are multi-GB tensors and paths
    context_settings={"help_option_names": ["-h", "--help"]},
)


class _Command(TyperCommand):
    """A command whose usage line names its arguments plainly: ``CHECKPOINTS...``, ``SRC``."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                pieces.append(usage_name(param))
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces


_COMMANDS: dict[str, tuple[str, Any]] = {
    "accumulate": (_accumulate.EPILOG, _accumulate.accumulate_command),
    "inspect": (_inspect.EPILOG, _inspect.inspect_command),
    "posthoc": (_posthoc.POSTHOC_EPILOG, _posthoc.posthoc_command),
    "average": (_posthoc.AVERAGE_EPILOG, _posthoc.average_command),
    "consolidate": (_consolidate.EPILOG, _consolidate.consolidate_command),
    "reshard": (_reshard.EPILOG, _reshard.reshard_command),
    "verify": (_verify.EPILOG, _verify.verify_command),
    "select": (_select.EPILOG, _select.select_command),
    "diff": (_diff.EPILOG, _diff.diff_command),
    "watch": (_watch.EPILOG, _watch.watch_command),
}
for _name, (_epilog, _function) in _COMMANDS.items():
    app.command(_name, cls=_Command, epilog=_epilog)(_function)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ema-ckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """EMAs, post-hoc EMAs and consolidation of sharded PyTorch checkpoints, offline."""


def run(args: Sequence[str] | None = None) -> int:
    """Run the command line on ``args`` (default: ``sys.argv[1:]``); the exit code.

    Parse errors (an unknown option, a bad value, a missing argument) are one line on stderr
    and exit 2, like every other error:

        error: consolidate: no such option --outt (did you mean --out?); see 'ema-ckpt consolidate --help'
    """
    argv = list(sys.argv[1:] if args is None else args)
    try:
        returned = app(args=argv, prog_name="ema-ckpt", standalone_mode=False)
    except typer.TyperException as err:  # Click's errors as Typer raises them: parsing, usage
        if not err.format_message().strip():  # ``ema-ckpt`` alone: its error is the help, printed already
            return err.exit_code
        named = argv[0] if argv and argv[0] in _COMMANDS else None  # for the errors raised before a command's context
        message, code = usage_error_line(err, named)
        error(message, soft_wrap=True)
        return code
    except typer.Abort:
        error("aborted")
        return 1
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    return returned if isinstance(returned, int) else 0  # an exit code, or a command's None


def main() -> None:
    """Console-script entry point: run the command, then end the process at once.

    Once the command is done nothing is left to clean up, so the process ends without
    interpreter teardown (:func:`ema_ckpt._compat.fast_exit.exit_now`).
    """
    _signals.install()
    code = run()
    signum = _signals.pending()
    if signum is not None and not _signals.entered():
        # stopped while starting up or parsing, before any command ran: nothing was written
        print("terminated" if _signals.exit_code(signum) == _signals.TERMINATED_EXIT else "interrupted",
              file=sys.stderr)
        code = _signals.exit_code(signum)
    exit_now(code)
