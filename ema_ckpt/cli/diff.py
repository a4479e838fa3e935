"""``ema-ckpt diff``: compare two checkpoints key by key (any formats)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from ..errors import IncompatibleCheckpointError
from . import _options as opt
from ._errors import reports_errors
from ._options import library_args
from ._output import console, error, print_json, progress_bar, shown
from ._tables import Name, name_table

if TYPE_CHECKING:
    from ..commands.diff import DiffResult, KeyDiff

EPILOG = """\
Examples:

  ema-ckpt diff ckpts/ema ema.safetensors             # exact? (model. prefix handled)

  ema-ckpt diff ckpts/ema other/ema --atol 1e-6 --include 'model.layers.*'

  ema-ckpt diff a b --json | jq '.keys[] | select(.matches | not)'

  ema-ckpt diff ckpts/ema ema.pt --quiet --workers 4  # exit code only; keys shared out among 4 processes

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


def _name(k: KeyDiff) -> str:
    """The name a row is known by: the key, or, where names were paired without a leading
    ``model.``, the shorter of the two (the other is it with the prefix)."""
    return k.key_a if k.key_a == k.key_b else min(k.key_a, k.key_b, key=len)


_PAIRING = {
    "strip-a": "keys in A start with model., keys in B do not: paired without it (rows show the names in B)",
    "strip-b": "keys in B start with model., keys in A do not: paired without it (rows show the names in A)",
    "strip-both": "keys in A and B paired without their leading model. (rows show them without it)",
}


def render_diff(result: DiffResult, atol: float) -> None:
    """The table of compared keys, the keys only one side holds, and how names were paired."""
    table = name_table("key", "shape", "dtype", "max abs", "max rel", "differ", "",
                       right={"max abs", "max rel", "differ"})
    for k in result.keys:
        shape = "×".join(map(str, k.shape_a)) or "scalar"
        if not k.same_shape:
            shape += " / " + ("×".join(map(str, k.shape_b)) or "scalar")
        dtype = k.dtype_a if k.same_dtype else f"{k.dtype_a} / {k.dtype_b}"
        table.add_row(Name(_name(k)), shape, dtype, _fmt(k.max_abs), _fmt(k.max_rel),
                      f"{k.mismatched:,}" if k.same_shape else "-", _status(k, atol))
    console.print(table)
    for label, keys in (("only in A", result.only_in_a), ("only in B", result.only_in_b)):
        if keys:
            names = ", ".join(map(shown, keys[:10])) + (f", … ({len(keys) - 10:,} more)" if len(keys) > 10 else "")
            console.print(f"{label} ({len(keys):,}): {names}", highlight=False)
    if result.pairing in _PAIRING:
        console.print(_PAIRING[result.pairing], style="dim", highlight=False)


@reports_errors
def diff_command(
    a: Annotated[str, typer.Argument(help="The first checkpoint (directory or file).")],
    b: Annotated[str, typer.Argument(help="The second checkpoint.")],
    atol: Annotated[
        float,
        typer.Option("--atol", min=0.0, help="Largest absolute difference that still matches (0: exact)."),
    ] = 0.0,
    include: opt.IncludeOpt = None,
    exclude: opt.ExcludeOpt = None,
    state_key: opt.StateKeyOpt = None,
    inert_global: opt.InertGlobalOpt = None,
    workers: opt.WorkersOpt = 1,
    json_output: opt.JsonOpt = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print nothing but errors; the exit code says equal (0) or not (4).")
    ] = False,
) -> None:
    """Max abs / rel difference per key; exit 0 when equal (within --atol), 4 when not."""
    args = library_args(locals(), "atol")
    from ..commands.diff import diff  # imported here: it loads torch, which --help never needs

    with progress_bar("diff", enabled=not (quiet or json_output)) as on_progress:
        result = diff(**args, on_progress=on_progress)
    if json_output:
        print_json(result.to_dict(atol))
    elif not quiet:
        render_diff(result, atol)
    if not result.equal(atol):
        differing = len(result.differing(atol))
        beyond = f" beyond --atol {atol:g}" if atol else ""
        parts = [f"{differing:,} of {len(result.keys):,} keys differ{beyond}"]
        parts += [f"{len(keys):,} only in {name}" for name, keys in ((a, result.only_in_a), (b, result.only_in_b))
                  if keys]
        error(f"{a} and {b} differ: {'; '.join(parts)}", soft_wrap=True)
        raise typer.Exit(IncompatibleCheckpointError.exit_code)
    if not (json_output or quiet):
        console.print(f"{len(result.keys):,} keys equal" + (f" within --atol {atol:g}" if atol else ""),
                      highlight=False)
