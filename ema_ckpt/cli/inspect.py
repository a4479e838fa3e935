"""``ema-ckpt inspect``: what a checkpoint holds, from metadata alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ._errors import reports_errors
from ._flags import cli_text
from ._options import JsonOpt
from ._output import console, human_bytes, print_json, shown

EPILOG = """\
Examples:

  ema-ckpt inspect ckpts/step_1000

  ema-ckpt inspect ckpts/ema --json | jq .manifest
"""
MAX_ROWS = 40


@reports_errors
def inspect_command(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory (or file).")],
    all_keys: Annotated[bool, typer.Option("--all", help=f"List every key (default: the first {MAX_ROWS}).")] = False,
    json_output: JsonOpt = False,
) -> None:
    """Show format, step, keys, dtypes, bytes and chunk layout (reads no tensor)."""
    from ..commands.inspect import (
        inspect_checkpoint,  # here: the library loads on use, so --help and --version stay fast
    )
    report = inspect_checkpoint(path)
    if json_output:
        print_json(report.to_dict())
        return
    summary = Table.grid(padding=(0, 2))
    summary.add_column(no_wrap=True)
    summary.add_column(overflow="fold")  # paths and notes fold onto more lines, never cut
    summary.add_row("path", str(report.path))
    summary.add_row("format", report.format_name)
    if report.trainer is not None and report.model_path is not None:
        summary.add_row("model", f"{report.model_path} (nested by {report.trainer})")
    step = "unknown" if report.step is None else f"{report.step} (from {cli_text(report.step_source or '')})"
    summary.add_row("step", step)
    summary.add_row("keys", str(report.key_count))
    summary.add_row("bytes", f"{human_bytes(report.total_bytes)} ({report.total_bytes:,})")
    summary.add_row("dtypes", ", ".join(f"{d} ×{n}" for d, n in sorted(report.dtypes.items())))
    for name, value in report.details.items():
        if isinstance(value, list):
            value = ", ".join(map(str, value)) if value else "-"
        summary.add_row(name.replace("_", " "), str(value))
    if report.container:
        summary.add_row("container", f"{report.container!r}: consolidate writes the keys without it")
    for line in report.notes:
        summary.add_row("note", cli_text(line))
    if report.manifest:
        m = report.manifest
        summary.add_row("ema-ckpt", f"{m['kind']}: {m['description']}, in {m['dtype']}, "
                        f"{m['checkpoints']} checkpoints folded, at step {m['step']}")
    console.print(summary)
    table = Table("key", "shape", "dtype", "bytes", "chunks", show_edge=False)
    rows = report.tensors if all_keys else report.tensors[:MAX_ROWS]
    for t in rows:
        table.add_row(shown(t.key), "×".join(map(str, t.shape)) or "scalar", t.dtype, human_bytes(t.nbytes),
                      str(t.chunks))
    console.print(table)
    if len(rows) < len(report.tensors):
        console.print(f"… {len(report.tensors) - len(rows)} more keys (--all lists them)", style="dim")
