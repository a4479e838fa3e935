"""``ema-ckpt posthoc`` and ``ema-ckpt average``: weighted sums planned from steps alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from ..commands.averaging import Plan

from ..errors import UsageError
from . import _options as opt
from ._errors import reports_errors
from ._options import library_args
from ._output import console, files_written, human_bytes, note, plural, print_json, progress_bar, shown, warn
from ._plan import plan_warnings, render_plan

POSTHOC_EPILOG = """\
Examples (outputs go to OUT/sigma_rel_<value>):

  ema-ckpt posthoc ckpts/ --sigma-rel 0.05,0.10 --out posthoc/

  ema-ckpt posthoc ckpts/ --sigma-rel 0.05,0.10 --out sweep/ --format safetensors
  # → sweep/sigma_rel_0.05/model.safetensors, …

  ema-ckpt posthoc ckpts/ --sigma-rel 0.010:0.250:0.005 --dry-run   # a range

  ema-ckpt posthoc ema/ --sigma-rel 0.07 --out posthoc/   # from snapshots

  The last reads the snapshots of accumulate --snapshot-every, so it works after
  the raw checkpoints are gone.
"""
AVERAGE_EPILOG = """\
Examples:

  ema-ckpt average ckpts/ --last 5 --out avg-last5

  ema-ckpt average ckpts/ --from-step 90000 --to-step 100000 --out avg/

  ema-ckpt average ckpts/ --last 5 --dry-run --json   # the plan, as JSON

  ema-ckpt average ckpts/ --last 8 --weights minus-sqrt --out wsm/   # WSM's 1-sqrt decay

  ema-ckpt average ckpts/ --last 6 --every 2 --out lawa/   # 6 checkpoints, 2 apart

  ema-ckpt average ckpts/ --last 4 --format hf --out avg-hf/   # from_pretrained loads it

  --weights: uniform (default), linear (the same as uniform), minus-sqrt, cosine
  (Megatron-LM weighted_merge's definitions), or a CSV of step,learning_rate rows:
  the decay schedule to emulate, turned into merge weights (WSM).
"""

FormatOpt = Annotated[str | None, typer.Option(
    "--format", metavar="FORMAT",
    help="Each output as dcp, safetensors (OUT/…/model.safetensors), hf (the Hugging Face sharded layout) or "
         "torch (OUT/…/model.pt); default: safetensors for safetensors inputs, else dcp.")]
WeightsOpt = Annotated[str | None, typer.Option(
    "--weights", metavar="SCHEDULE",
    help="uniform, linear, minus-sqrt, cosine, or a CSV of step,learning_rate (a decay schedule as merge "
         "weights, WSM).")]


def _format_line(plan: Plan, out: str | Path | None) -> str:
    """What a dry run would write: the format and where its files go."""
    from ..sums import SAFETENSORS_FILE, TORCH_FILE

    fmt = getattr(plan, "format", "dcp")
    data = {"safetensors": SAFETENSORS_FILE, "torch": TORCH_FILE}.get(fmt, "")
    where = shown(out) if out is not None else "OUT"
    each = "" if len(plan.outputs) == 1 and plan.kind != "posthoc" else f"<name>{os.sep}"
    return f"output format {fmt}: {where}{os.sep}{each}{data}"


def _run(kind: str, args: dict[str, Any], json_output: bool, quiet: bool) -> None:
    """Run ``posthoc`` or ``average`` (``kind``) and show its result."""
    out, dry_run = args["out"], args["dry_run"]
    if out is None and not dry_run:
        raise UsageError("--out is required (unless --dry-run)")
    from ..commands.averaging import Plan, average, posthoc

    with progress_bar(kind, enabled=not (quiet or json_output or dry_run)) as on_progress:
        result = (posthoc if kind == "posthoc" else average)(**args | {"out": out or Path(kind)},
                                                              on_progress=on_progress)
    if isinstance(result, Plan):
        if json_output:
            print_json(result.to_json())
        else:
            render_plan(result)
            note(_format_line(result, out))
    elif json_output:
        print_json(result.plan.to_json() | {
            "format": result.format, "paths": [str(p) for p in result.outputs],
            "files": [str(p) for p in result.files], "bytes_read": result.bytes_read,
            "bytes_written": result.bytes_written, "files_written": result.files_written,
            "seconds": round(result.seconds, 3)})
    elif not quiet:
        warn(*plan_warnings(result.plan))
        note(*result.plan.notes)
        for output, path in zip(result.plan.outputs, result.outputs, strict=True):
            console.print(f"{shown(path)}: step {output.step}, {plural(len(output.terms), 'input')}", highlight=False)
        console.print(f"{human_bytes(result.bytes_read)} of tensors read once for "
                      f"{plural(len(result.outputs), 'output')}, "
                      f"{files_written(result.files_written, result.bytes_written)}, {result.seconds:.1f} s",
                      highlight=False)


@reports_errors
def posthoc_command(
    checkpoints: Annotated[list[str], typer.Argument(help="Raw checkpoints (a folder) or a snapshot folder.")],
    out: Annotated[str | None, typer.Option("--out", "-o", metavar="PATH",
                                            help="Outputs go to OUT/sigma_rel_<value>.")] = None,
    sigma_rel: Annotated[
        list[str] | None, typer.Option("--sigma-rel", help="Relative EMA widths: 0.05, 0.05,0.1 or 0.01:0.25:0.01.")
    ] = None,
    gamma: opt.GammaOpt = None,
    at_step: Annotated[int | None, typer.Option("--at-step", help="End time T (default: the newest step).")] = None,
    dtype: opt.DtypeOpt = "float32",
    out_format: FormatOpt = None,
    keep_prefix: opt.KeepPrefixOpt = False,
    average_buffers: opt.AverageBuffersOpt = False,
    include: opt.IncludeOpt = None,
    exclude: opt.ExcludeOpt = None,
    step_regex: opt.StepRegexOpt = None,
    step_from: opt.StepFromOpt = None,
    component: opt.ComponentOpt = None,
    skip: opt.SkipOpt = None,
    state_key: opt.StateKeyOpt = None,
    inert_global: opt.InertGlobalOpt = None,
    overwrite: opt.OverwriteOpt = False,
    wait: opt.WaitOpt = 0.0,
    dry_run: opt.DryRunOpt = False,
    workers: opt.WorkersOpt = 1,
    device: opt.DeviceOpt = "cpu",
    json_output: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Post-hoc power-function EMAs (EDM2): choose the EMA length after training."""
    _run("posthoc", library_args(locals()), json_output, quiet)


@reports_errors
def average_command(
    checkpoints: Annotated[list[str], typer.Argument(help="A folder of checkpoints, or checkpoint paths.")],
    out: Annotated[str | None, typer.Option("--out", "-o", metavar="PATH", help="Output directory.")] = None,
    last: Annotated[int | None, typer.Option("--last", min=1, help="Average the newest K checkpoints.")] = None,
    from_step: Annotated[int | None, typer.Option("--from-step", help="First step to include.")] = None,
    to_step: Annotated[int | None, typer.Option("--to-step", help="Last step to include.")] = None,
    every: Annotated[int | None, typer.Option(
        "--every", min=1, help="Every N-th checkpoint, counted back from the newest (LAWA's spacing).")] = None,
    weights: WeightsOpt = None,
    dtype: opt.DtypeOpt = "float32",
    out_format: FormatOpt = None,
    keep_prefix: opt.KeepPrefixOpt = False,
    average_buffers: opt.AverageBuffersOpt = False,
    include: opt.IncludeOpt = None,
    exclude: opt.ExcludeOpt = None,
    step_regex: opt.StepRegexOpt = None,
    step_from: opt.StepFromOpt = None,
    component: opt.ComponentOpt = None,
    skip: opt.SkipOpt = None,
    state_key: opt.StateKeyOpt = None,
    inert_global: opt.InertGlobalOpt = None,
    overwrite: opt.OverwriteOpt = False,
    wait: opt.WaitOpt = 0.0,
    dry_run: opt.DryRunOpt = False,
    workers: opt.WorkersOpt = 1,
    device: opt.DeviceOpt = "cpu",
    json_output: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Average of checkpoints: uniform (fairseq, LAWA) or schedule-weighted (WSM)."""
    _run("average", library_args(locals()), json_output, quiet)
