"""``ema-ckpt accumulate``: fold new checkpoints into a running EMA."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from ..commands.accumulate import AccumulateResult

from . import _options as opt
from ._errors import reports_errors
from ._options import library_args
from ._output import console, files_written, folded, human_bytes, note, plural, print_json, progress_bar, shown, warn
from ._plan import plan_warnings, render_plan

EPILOG = """\
Examples:

  ema-ckpt accumulate ckpts/ --decay 0.999              # EMA in ckpts/ema

  ema-ckpt accumulate ckpts/ --half-life 2000 --out ema/   # by half-life

  ema-ckpt accumulate ckpts/ --decay 0.999 --dry-run    # weights, no data read

  ema-ckpt accumulate ckpts/ --sigma-rel 0.05,0.1 --snapshot-every 10000

  ema-ckpt accumulate ckpts/ --decay 0.999 --skip-nonfinite --workers 2

  ema-ckpt accumulate ckpts/ --decay 0.999 --skip ckpts/step_100  # leave out

  ema-ckpt accumulate ckpts/ --decay 0.999 --average-buffers   # MoE: routers' statistics averaged too

  ema-ckpt accumulate out/ --decay 0.999 --component unet_ema   # diffusers: the trainer's own EMA

  ema-ckpt accumulate runs/ --decay 0.9 --step-regex 'checkpoint-(\\d+)/unet'   # steps from the path

  ema-ckpt accumulate s3://bucket/run/ckpts --decay 0.999 --out s3://bucket/run/ema

  A crontab line (every 30 minutes; a run still going makes the next one wait):

  */30 * * * * ema-ckpt accumulate /ckpts --decay 0.9999 --quiet --wait 600
"""


def _warnings(result: AccumulateResult) -> list[str]:
    """The plan's warnings of the EMAs this run wrote ("name: warning")."""
    return [] if result.plan is None or result.up_to_date else plan_warnings(result.plan)


def _as_json(result: AccumulateResult, dry_run: bool) -> dict[str, Any]:
    if dry_run:
        assert result.plan is not None
        return result.plan.to_json() | {"notes": result.notes}
    return {
        "out": str(result.out), "step": result.step, "up_to_date": result.up_to_date,
        "folded": [asdict(c) for c in result.folded], "terms": [asdict(t) for t in result.terms],
        "terms_by_output": {out: [asdict(t) for t in terms] for out, terms in result.terms_by_output.items()},
        "keys": result.keys, "bytes_read": result.bytes_read, "bytes_written": result.bytes_written,
        "files_written": result.files_written, "seconds": round(result.seconds, 3), "profile": result.profile,
        "notes": result.notes, "warnings": _warnings(result),
        "outputs": [str(p) for p in result.outputs], "snapshots": [str(p) for p in result.snapshots],
        "components": {name: {"out": str(r.out), "step": r.step, "up_to_date": r.up_to_date,
                              "folded": [asdict(c) for c in r.folded]} for name, r in result.components.items()},
    }


@reports_errors
def accumulate_command(
    checkpoints: Annotated[list[str], typer.Argument(help="A folder of checkpoints, or checkpoint paths.")],
    decay: opt.DecayOpt = None,
    half_life: opt.HalfLifeOpt = None,
    per_checkpoint: opt.PerCheckpointOpt = False,
    warmup: opt.WarmupOpt = False,
    sigma_rel: Annotated[
        list[str] | None,
        typer.Option("--sigma-rel",
                     help="Power-function EMAs instead (EDM2), e.g. 0.05 or 0.05,0.1; each in OUT/sigma_rel_<v>."),
    ] = None,
    gamma: opt.GammaOpt = None,
    snapshot_every: opt.SnapshotEveryOpt = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", metavar="PATH", help="EMA directory (default: CKPTS/ema); a path or a URL (s3://…).")] = None,
    dtype: opt.DtypeOpt = "float32",
    include: opt.IncludeOpt = None,
    exclude: opt.ExcludeOpt = None,
    step_regex: opt.StepRegexOpt = None,
    step_from: opt.StepFromOpt = None,
    component: opt.ComponentOpt = None,
    keep_prefix: opt.KeepPrefixOpt = False,
    restart: Annotated[
        bool, typer.Option("--restart", help="Start over if the EMA at --out has other settings.")
    ] = False,
    allow_new_keys: Annotated[
        bool, typer.Option("--allow-new-keys", help="Accept keys added or removed during training.")
    ] = False,
    average_buffers: opt.AverageBuffersOpt = False,
    skip_nonfinite: opt.SkipNonfiniteOpt = False,
    skip_damaged: opt.SkipDamagedOpt = False,
    skip: opt.SkipOpt = None,
    state_key: opt.StateKeyOpt = None,
    inert_global: opt.InertGlobalOpt = None,
    wait: opt.WaitOpt = 0.0,
    dry_run: opt.DryRunOpt = False,
    workers: opt.WorkersOpt = 1,
    device: opt.DeviceOpt = "cpu",
    json_output: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Fold every checkpoint newer than the EMA into it (incremental, crash-safe)."""
    args = library_args(locals())
    from ..commands.accumulate import accumulate  # imported here: it loads torch, which --help never needs

    with progress_bar("accumulate", enabled=not (quiet or json_output or dry_run)) as on_progress:
        result = accumulate(**args, on_progress=on_progress)
    if json_output:
        print_json(_as_json(result, dry_run))
        return
    if not quiet:
        warn(*[] if dry_run else _warnings(result))
        note(*result.notes)
    if dry_run:
        assert result.plan is not None
        render_plan(result.plan)
    if result.up_to_date and (dry_run or not quiet):
        console.print(f"{shown(result.out)}: up to date at step {result.step}; nothing new to fold", highlight=False)
    elif not (result.up_to_date or dry_run or quiet):
        for snapshot in result.snapshots:
            console.print(f"snapshot {shown(snapshot)}", highlight=False)
        console.print(
            f"{folded(result.out, [c.step for c in result.folded])}; EMA now at step {result.step} "
            f"({plural(result.keys, 'key')}, {human_bytes(result.bytes_read)} of tensors read, "
            f"{files_written(result.files_written, result.bytes_written)}, {result.seconds:.1f} s)\n{result.profile}",
            highlight=False,
        )
