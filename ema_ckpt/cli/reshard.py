"""``ema-ckpt reshard``: a DCP checkpoint laid out for N ranks."""

from __future__ import annotations

from typing import Annotated

import typer

from . import _options as opt
from ._errors import reports_errors
from ._options import library_args
from ._output import console, files_written, note, plural, print_json, progress_bar, shown

EPILOG = """\
Examples (rank r of N then reads only __r_0.distcp):

  ema-ckpt reshard ckpts/ema --world-size 16 --out ema-16

  ema-ckpt reshard ds_ckpt/ema --world-size 8 --out fsdp-ready --dtype bfloat16

  ema-ckpt reshard ckpts/ema --world-size 64 --out ema-64 --workers 2
"""


@reports_errors
def reshard_command(
    src: Annotated[str, typer.Argument(help="Any supported checkpoint.")],
    world_size: Annotated[int, typer.Option("--world-size", "-n", min=1, help="Number of ranks to lay out for.")],
    out: Annotated[str, typer.Option("--out", "-o", metavar="PATH", help="Output DCP directory.")],
    dtype: Annotated[
        str | None, typer.Option(help="Cast floating tensors (bfloat16, float16, float32, float64).")
    ] = None,
    all_keys: Annotated[
        bool, typer.Option("--all-keys", help="Keep optimizer/training state too, not only the model.")
    ] = False,
    include: opt.IncludeOpt = None,
    exclude: opt.ExcludeOpt = None,
    state_key: opt.StateKeyOpt = None,
    inert_global: opt.InertGlobalOpt = None,
    overwrite: opt.OverwriteOpt = False,
    wait: opt.WaitOpt = 0.0,
    workers: opt.WorkersOpt = 1,
    json_output: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Write SRC as a DCP checkpoint sharded on dim 0 like FSDP2, one file per rank."""
    args = library_args(locals())
    from ..commands.reshard import reshard  # imported here: it loads torch, which --help never needs

    with progress_bar("reshard", enabled=not (quiet or json_output)) as on_progress:
        result = reshard(**args, on_progress=on_progress)
    if json_output:
        print_json({"out": str(result.out), "world_size": result.world_size, "keys": result.keys,
                    "files": [{"name": n, "bytes": s} for n, s in result.files],
                    "files_written": len(result.files), "bytes_written": result.bytes_written,
                    "seconds": round(result.seconds, 3),
                    "notes": result.notes})
    elif not quiet:
        note(*result.notes)
        console.print(f"{shown(result.out)}: {plural(result.keys, 'tensor')} for {plural(result.world_size, 'rank')}, "
                      f"{files_written(len(result.files), result.bytes_written)}, {result.seconds:.1f} s",
                      highlight=False)
