"""The ``ema-ckpt`` command line: thin adapters over the library.

This package is the only one that imports Typer and rich. Each command lives in its own
module, parses options, calls one library function and renders its result.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .. import _signals
from .._compat.fast_exit import exit_now
from .._version import __version__
from . import accumulate as _accumulate
from . import consolidate as _consolidate
from . import diff as _diff
from . import inspect as _inspect
from . import posthoc as _posthoc
from . import reshard as _reshard
from . import verify as _verify

app = typer.Typer(
    name="ema-ckpt",
    help="EMAs, post-hoc EMAs and consolidation of sharded PyTorch checkpoints, offline.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_show_locals=False,  # locals here are multi-GB tensors and paths
    context_settings={"help_option_names": ["-h", "--help"]},
)


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


app.command("accumulate", epilog=_accumulate.EPILOG)(_accumulate.accumulate_command)
app.command("inspect", epilog=_inspect.EPILOG)(_inspect.inspect_command)
app.command("posthoc", epilog=_posthoc.POSTHOC_EPILOG)(_posthoc.posthoc_command)
app.command("average", epilog=_posthoc.AVERAGE_EPILOG)(_posthoc.average_command)
app.command("consolidate", epilog=_consolidate.EPILOG)(_consolidate.consolidate_command)
app.command("reshard", epilog=_reshard.EPILOG)(_reshard.reshard_command)
app.command("verify", epilog=_verify.EPILOG)(_verify.verify_command)
app.command("diff", epilog=_diff.EPILOG)(_diff.diff_command)


def main() -> None:
    """Console-script entry point: run the command, then end the process at once.

    Once the command is done nothing is left to clean up, so the process ends without
    interpreter teardown (:func:`ema_ckpt._compat.fast_exit.exit_now`).
    """
    _signals.install()
    try:
        app()
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    signum = _signals.pending()
    if signum is not None and not _signals.entered():
        # stopped while starting up or parsing, before any command ran: nothing was written
        print("terminated" if _signals.exit_code(signum) == _signals.TERMINATED_EXIT else "interrupted",
              file=sys.stderr)
        code = _signals.exit_code(signum)
    exit_now(code)
