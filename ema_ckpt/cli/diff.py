"""``ema-ckpt diff``: compare two checkpoints key by key (any formats)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from ..errors import IncompatibleCheckpointError
from ._errors import reports_errors
from ._options import ExcludeOpt, IncludeOpt, JsonOpt
from ._output import console, err_console, print_json, shown

if TYPE_CHECKING:
    from ..commands.diff import KeyDiff

EPILOG = """\
Examples:

  ema-ckpt diff ckpts/ema ema.safetensors             # exact? (model. prefix handled)

  ema-ckpt diff ckpts/ema other/ema --atol 1e-6 --include 'model.layers.*'

  ema-ckpt diff a b --json | jq '.keys[] | select(.matches | not)'

Exit codes: 0 the same keys, shapes and values (within --atol); 4 they differ;
3 a checkpoint is missing or unreadable. Dtypes are shown but do not count: values
are compared in float64 (integers exactly).
"""


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _status(k: KeyDiff, atol: float) -> Text:
    if not k.same_shape:
        return Text("shape", style="red")
    return Text("=", style="green") if k.matches(atol) else Text("differs", style="red")


@reports_errors
def diff_command(
    a: Annotated[Path, typer.Argument(help="The first checkpoint (directory or file).")],
    b: Annotated[Path, typer.Argument(help="The second checkpoint.")],
    atol: Annotated[
        float,
        typer.Option("--atol", min=0.0, help="Largest absolute difference that still matches (0: exact)."),
    ] = 0.0,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Max abs / rel difference per key; exit 0 when equal (within --atol), 4 when not."""
    from ..commands.diff import diff  # imported here: it loads torch, which --help never needs

    result = diff(a, b, include=include or (), exclude=exclude or ())
    if json_output:
        print_json(result.to_dict(atol))
    else:
        table = Table("key", "shape", "dtype", "max abs", "max rel", "differ", "", show_edge=False)
        for k in result.keys:
            shape = "×".join(map(str, k.shape_a)) or "scalar"
            if not k.same_shape:
                shape += " / " + ("×".join(map(str, k.shape_b)) or "scalar")
            dtype = k.dtype_a if k.same_dtype else f"{k.dtype_a} / {k.dtype_b}"
            name = k.key_a if k.key_a == k.key_b else f"{k.key_a} ~ {k.key_b}"
            table.add_row(Text(shown(name)), shape, dtype, _fmt(k.max_abs), _fmt(k.max_rel),
                          f"{k.mismatched:,}" if k.same_shape else "-", _status(k, atol))
        console.print(table)
        for label, keys in (("only in A", result.only_in_a), ("only in B", result.only_in_b)):
            if keys:
                names = ", ".join(map(shown, keys[:10])) + (f", … ({len(keys) - 10} more)" if len(keys) > 10 else "")
                console.print(f"{label} ({len(keys)}): {names}", highlight=False)
        if result.pairing != "exact":
            console.print(f"keys paired after stripping 'model.' ({result.pairing})", style="dim")
    if not result.equal(atol):
        differing = len(result.differing(atol))
        beyond = f" beyond --atol {atol:g}" if atol else ""
        parts = [f"{differing} of {len(result.keys)} keys differ{beyond}"]
        if result.only_in_a:
            parts.append(f"{len(result.only_in_a)} only in {a}")
        if result.only_in_b:
            parts.append(f"{len(result.only_in_b)} only in {b}")
        err_console.print(f"error: {a} and {b} differ: {'; '.join(parts)}", style="red", highlight=False,
                          soft_wrap=True, markup=False)
        raise typer.Exit(IncompatibleCheckpointError.exit_code)
    if not json_output:
        console.print(f"{len(result.keys)} keys equal" + (f" within --atol {atol:g}" if atol else ""),
                      highlight=False)
