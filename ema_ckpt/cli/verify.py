"""``ema-ckpt verify``: re-hash an output's data files and read every tensor back."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from ..errors import CheckpointFormatError
from ._errors import reports_errors
from ._flags import cli_text
from ._options import JsonOpt
from ._output import console, err_console, human_bytes, note, print_json, shown

EPILOG = """\
Examples:

  ema-ckpt verify ckpts/ema                 # sizes + CRC-32s vs ema-ckpt.json, then read every tensor

  ema-ckpt verify ckpts/step_1000           # any checkpoint: readability only

  ema-ckpt verify ckpts/ema --json | jq .problems

Exit codes: 0 intact; 3 a problem was found (each printed on stderr, one per line, naming
its file) or the path holds no checkpoint.
"""


@reports_errors
def verify_command(
    path: Annotated[Path, typer.Argument(help="An ema-ckpt output directory, or any checkpoint.")],
    json_output: JsonOpt = False,
) -> None:
    """Check data files against ema-ckpt.json (size, CRC-32; missing or extra files) and read every tensor."""
    from ..commands.verify import verify  # here: the library loads on use, so --help and --version stay fast
    result = verify(path)
    if json_output:
        print_json(result.to_dict())
    else:
        for line in result.notes:
            note(line)
        summary = Table.grid(padding=(0, 2))
        summary.add_row("path", Text(shown(result.path)))
        summary.add_row("format", result.format_name or "unreadable")
        summary.add_row("checks", ", ".join(result.checks))
        if result.manifest:
            summary.add_row("files", f"{len(result.files)} matched ema-ckpt.json")
        summary.add_row("keys", f"{result.keys} read back")
        summary.add_row("bytes", f"{human_bytes(result.bytes_checked)} ({result.bytes_checked:,}) checked")
        summary.add_row("result", "OK" if result.ok else f"{len(result.problems)} problem(s)")
        console.print(summary)
    if not result.ok:
        n = len(result.problems)
        err_console.print(
            f"error: {result.path}: {n} problem{'s' if n != 1 else ''} found", style="red", highlight=False,
            soft_wrap=True, markup=False,
        )
        for problem in result.problems:
            err_console.print(cli_text(problem), highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(CheckpointFormatError.exit_code)
