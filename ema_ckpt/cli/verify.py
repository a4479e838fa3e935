"""``ema-ckpt verify``: re-hash an output's data files and read every tensor back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import CheckpointFormatError
from ._errors import reports_errors
from ._flags import cli_text
from ._options import InertGlobalOpt, JsonOpt, StateKeyOpt, WorkersOpt, library_args
from ._output import console, err_console, error, exact_bytes, note, plural, print_json, progress_bar
from ._tables import Name, summary_grid

if TYPE_CHECKING:
    from ..commands.verify import VerifyResult

EPILOG = """\
Examples:

  ema-ckpt verify ckpts/ema                 # sizes + CRC-32s vs ema-ckpt.json, then read every tensor

  ema-ckpt verify ckpts/step_1000           # any checkpoint: readability only

  ema-ckpt verify ckpts/ema --json | jq .problems

  ema-ckpt verify ckpts/ema --quiet --workers 4   # exit code only; files and keys shared out among 4 processes

Exit codes: 0 intact; 3 a problem was found (each printed on stderr, one per line, naming
its file) or the path holds no checkpoint.
"""


def checked_text(result: VerifyResult) -> str:
    """What was checked against a checksum, each byte counted once.

    Example:
        >>> checked_text(verify("ckpts/ema"))                      # doctest: +SKIP
        '486.2 KiB (497,868 bytes) in 3 files, against ema-ckpt.json (sizes and CRC-32s)'
    """
    if not result.hashed_files:
        if result.manifest:
            return "no data file could be checked against ema-ckpt.json"
        return f"nothing: {result.format_name or 'this format'} records no checksums"
    amount = exact_bytes(result.bytes_hashed)
    files = plural(result.hashed_files, "file")
    if result.manifest:
        return f"{amount} in {files}, against ema-ckpt.json (sizes and CRC-32s)"
    if result.hashed_files == 1 and result.records == 1:
        return f"{amount} in 1 file, against its own zip CRC-32s"
    if result.records == result.hashed_files:
        return f"{amount} in {files}, against their own zip CRC-32s"
    return f"{amount} in {result.records:,} records of {files}, against their own zip CRC-32s"


def read_back_text(result: VerifyResult) -> str:
    """What was read back: tensor keys, and non-tensor entries where the format has them."""
    text = plural(result.keys, "key")
    if result.entries:
        text += " and " + plural(result.entries, "non-tensor entry", "non-tensor entries")
    return text


@reports_errors
def verify_command(
    path: Annotated[str, typer.Argument(help="An ema-ckpt output directory, or any checkpoint.")],
    state_key: StateKeyOpt = None,
    inert_global: InertGlobalOpt = None,
    workers: WorkersOpt = 1,
    json_output: JsonOpt = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print nothing but the problems found; the exit code says intact (0).")
    ] = False,
) -> None:
    """Check data files against ema-ckpt.json (size, CRC-32; missing or extra files) and read every tensor."""
    args = library_args(locals())
    from ..commands.verify import verify  # here: the library loads on use, so --help and --version stay fast

    with progress_bar("verify", enabled=not (quiet or json_output)) as on_progress:
        result = verify(**args, on_progress=on_progress)
    if json_output:
        print_json(result.to_dict())
    elif not quiet:
        note(*result.notes)
        summary = summary_grid()
        summary.add_row("path", Name(result.path))
        summary.add_row("format", result.format_name or "unreadable")
        summary.add_row("checked", Name(checked_text(result)))
        summary.add_row("read back", Name(read_back_text(result)))
        summary.add_row("result", "OK" if result.ok else f"{len(result.problems):,} problem(s)")
        console.print(summary)
    if not result.ok:
        n = len(result.problems)
        error(f"{result.path}: {n} problem{'s' if n != 1 else ''} found", soft_wrap=True)
        for problem in result.problems:
            err_console.print(cli_text(problem), highlight=False, soft_wrap=True)
        raise typer.Exit(CheckpointFormatError.exit_code)
