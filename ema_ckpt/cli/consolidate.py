"""``ema-ckpt consolidate``: one loadable file (or the HF sharded layout) from any checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from ..commands.consolidate import ConsolidateResult

from ..writers.base import output_format, path_formats
from . import _options as opt
from ._errors import reports_errors
from ._options import library_args
from ._output import console, human_bytes, note, plural, print_json, progress_bar, shown

EPILOG = """\
Examples:

  ema-ckpt consolidate ckpts/ema --out ema.safetensors --dtype bfloat16

  ema-ckpt consolidate ckpts/step_1000 --out hf/ --max-shard-size 2GB

  ema-ckpt consolidate ds_ckpt/global_step500 --out model.pt

  ema-ckpt consolidate ckpts/ema --out hf/ --max-shard-size 500MB --workers 2

  ema-ckpt consolidate ckpts/ema --out hf_ema          # no suffix: the HF layout

  ema-ckpt consolidate lightning/ema --out ema.ckpt     # Lightning's load_from_checkpoint loads it

  ema-ckpt consolidate checkpoint-12.pth.tar --out ema.pt --state-key state_dict_ema

  ema-ckpt consolidate ckpts/ema --out weights.dat --format torch

  ema-ckpt consolidate s3://bucket/run/ema --out ema.safetensors   # from S3

  A directory output (hf_ema, or hf/) holds model-0000i-of-0000N shards and their
  index, and the files its loaders read beside them (config.json, adapter_config.json).
  An unknown file suffix (ema.safetensor) is refused.
"""
_FORMATS = ", ".join(fmt.name for fmt in path_formats())


@reports_errors
def consolidate_command(
    src: Annotated[
        str, typer.Argument(help="Any supported checkpoint: DCP, ema-ckpt output, DeepSpeed, safetensors, "
                                 "a single file.")
    ],
    out: Annotated[
        str, typer.Option("--out", "-o", metavar="PATH",
                          help="*.safetensors, *.pt/*.bin/*.pth/*.pth.tar, *.ckpt (Lightning), or a directory "
                               "(HF sharded): a name without a suffix, or ending in /.")
    ],
    out_format: Annotated[
        str | None, typer.Option("--format", metavar="NAME",
                                 help=f"The output format, for a path that does not say: {_FORMATS}.")
    ] = None,
    max_shard_size: Annotated[
        str | None, typer.Option("--max-shard-size", metavar="SIZE",
                                 help="Shard limit for a directory output (default 5GB).")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="Cast floating tensors: bfloat16, float16, float32 or float64.")
    ] = None,
    keep_prefix: Annotated[
        bool, typer.Option("--keep-prefix",
                           help="Keep the container level of a DCP {'model': ...} checkpoint ('model.' in keys).")
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
    """Stream a sharded checkpoint into safetensors, the HF sharded layout, or a torch file."""
    args = library_args(locals())
    from ..commands.consolidate import consolidate  # here: the library loads on use, so --help and --version stay fast

    with progress_bar("consolidate", enabled=not (quiet or json_output)) as on_progress:
        result = consolidate(**args, on_progress=on_progress)
    if json_output:
        print_json({"out": str(result.out), "layout": result.layout, "keys": result.keys,
                    "files": [{"name": n, "bytes": s} for n, s in result.files],
                    "bytes_written": result.bytes_written, "seconds": round(result.seconds, 3),
                    "index": result.index, "carried": result.carried, "renamed_prefix": result.renamed_prefix,
                    "notes": result.notes})
    elif not quiet:
        note(*result.notes)
        console.print(f"{shown(result.out)}: {result.layout}, {plural(result.keys, 'tensor')} in {_files(result)}, "
                      f"{human_bytes(result.bytes_written)} written, {result.seconds:.1f} s", highlight=False)


def _files(result: ConsolidateResult) -> str:
    """What was written, named as the layout names it: ``1 file``, ``6 shards + index``."""
    if output_format(result.layout).single_file:
        return plural(len(result.files), "file")
    shards = plural(len(result.files) - (result.index is not None) - len(result.carried), "shard")
    text = f"{shards} + index" if result.index is not None else shards
    return text + "".join(f" + {name}" for name in result.carried)
