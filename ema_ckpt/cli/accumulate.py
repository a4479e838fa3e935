"""``ema-ckpt accumulate``: fold new checkpoints into a running EMA."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from ..commands.accumulate import AccumulateResult

from ._errors import reports_errors
from ._flags import cli_text
from ._options import (
    AverageBuffersOpt,
    ComponentOpt,
    DecayOpt,
    DeviceOpt,
    ExcludeOpt,
    GammaOpt,
    HalfLifeOpt,
    IncludeOpt,
    InertGlobalOpt,
    JsonOpt,
    KeepPrefixOpt,
    PerCheckpointOpt,
    QuietOpt,
    SkipDamagedOpt,
    SkipNonfiniteOpt,
    SkipOpt,
    SnapshotEveryOpt,
    StateKeyOpt,
    StepFromOpt,
    StepRegexOpt,
    WaitOpt,
    WarmupOpt,
    WorkersOpt,
)
from ._output import console, files_written, human_bytes, note, plural, print_json, progress_bar, shown, warn
from ._plan import render_plan

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
    if result.plan is None or result.up_to_date:
        return []
    return [f"{o.name}: {cli_text(w)}" for o in result.plan.outputs for w in o.warnings]


@reports_errors
def accumulate_command(
    checkpoints: Annotated[list[str], typer.Argument(help="A folder of checkpoints, or checkpoint paths.")],
    decay: DecayOpt = None,
    half_life: HalfLifeOpt = None,
    per_checkpoint: PerCheckpointOpt = False,
    warmup: WarmupOpt = False,
    sigma_rel: Annotated[
        list[str] | None,
        typer.Option("--sigma-rel",
                     help="Power-function EMAs instead (EDM2), e.g. 0.05 or 0.05,0.1; each in OUT/sigma_rel_<v>."),
    ] = None,
    gamma: GammaOpt = None,
    snapshot_every: SnapshotEveryOpt = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", metavar="PATH", help="EMA directory (default: CKPTS/ema); a path or a URL (s3://…).")] = None,
    dtype: Annotated[str, typer.Option(help="Accumulate and store floats in float32 or float64.")] = "float32",
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    step_regex: StepRegexOpt = None,
    step_from: StepFromOpt = None,
    component: ComponentOpt = None,
    keep_prefix: KeepPrefixOpt = False,
    restart: Annotated[
        bool, typer.Option("--restart", help="Start over if the EMA at --out has other settings.")
    ] = False,
    allow_new_keys: Annotated[
        bool, typer.Option("--allow-new-keys", help="Accept keys added or removed during training.")
    ] = False,
    average_buffers: AverageBuffersOpt = False,
    skip_nonfinite: SkipNonfiniteOpt = False,
    skip_damaged: SkipDamagedOpt = False,
    skip: SkipOpt = None,
    state_key: StateKeyOpt = None,
    inert_global: InertGlobalOpt = None,
    wait: WaitOpt = 0.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the plan (coefficients); read no tensor.")] = False,
    workers: WorkersOpt = 1,
    device: DeviceOpt = "cpu",
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Fold every checkpoint newer than the EMA into it (incremental, crash-safe)."""
    from ..commands.accumulate import accumulate  # imported here: it loads torch, which --help never needs

    with progress_bar("accumulate", enabled=not (quiet or json_output or dry_run)) as on_progress:
        result = accumulate(
            checkpoints, decay=decay, half_life=half_life, per_checkpoint=per_checkpoint, warmup=warmup,
            sigma_rels=sigma_rel or (), gammas=gamma or (), snapshot_every=snapshot_every,
            out=out, dtype=dtype, include=include or (), exclude=exclude or (), step_regex=step_regex,
            step_from=step_from, component=component, keep_prefix=keep_prefix,
            restart=restart, wait_seconds=wait, dry_run=dry_run, allow_new_keys=allow_new_keys,
            average_buffers=average_buffers,
            skip_nonfinite=skip_nonfinite, skip_damaged=skip_damaged, skip=skip or (), state_key=state_key,
            inert_globals=inert_global or (), workers=workers,
            device=device,
            on_progress=on_progress,
        )
    if dry_run:
        assert result.plan is not None
        if json_output:
            print_json(result.plan.to_json() | {"notes": result.notes})
        else:
            if not quiet:
                for line in result.notes:
                    note(line)
            render_plan(result.plan)
            if result.up_to_date:
                console.print(f"{shown(result.out)}: up to date at step {result.step}; nothing new to fold",
                              highlight=False)
        return
    if json_output:
        print_json({
            "out": str(result.out), "step": result.step, "up_to_date": result.up_to_date,
            "folded": [asdict(c) for c in result.folded], "terms": [asdict(t) for t in result.terms],
            "terms_by_output": {out: [asdict(t) for t in terms] for out, terms in result.terms_by_output.items()},
            "keys": result.keys, "bytes_read": result.bytes_read, "bytes_written": result.bytes_written,
            "files_written": result.files_written,
            "seconds": round(result.seconds, 3), "profile": result.profile, "notes": result.notes,
            "warnings": _warnings(result),
            "outputs": [str(p) for p in result.outputs], "snapshots": [str(p) for p in result.snapshots],
            "components": {name: {"out": str(r.out), "step": r.step, "up_to_date": r.up_to_date,
                                  "folded": [asdict(c) for c in r.folded]} for name, r in result.components.items()},
        })
        return
    if not quiet:
        for line in _warnings(result):
            warn(line)
        for line in result.notes:
            note(line)
    if result.up_to_date:
        if not quiet:
            console.print(f"{shown(result.out)}: up to date at step {result.step}; nothing new to fold",
                          highlight=False)
        return
    if quiet:
        return
    steps = ", ".join(str(c.step) for c in result.folded)
    for snapshot in result.snapshots:
        console.print(f"snapshot {shown(snapshot)}", highlight=False)
    console.print(
        f"{shown(result.out)}: folded {'step' if len(result.folded) == 1 else 'steps'} {steps}; "
        f"EMA now at step {result.step} ({plural(result.keys, 'key')}, {human_bytes(result.bytes_read)} of tensors "
        f"read, {files_written(result.files_written, result.bytes_written)}, {result.seconds:.1f} s)\n"
        f"{result.profile}",
        highlight=False,
    )
