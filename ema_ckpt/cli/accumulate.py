"""``ema-ckpt accumulate``: fold new checkpoints into a running EMA."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from ..accumulate import accumulate
from ._errors import reports_errors
from ._options import ExcludeOpt, IncludeOpt, JsonOpt, QuietOpt, StepRegexOpt, WaitOpt
from ._output import console, human_bytes, note, print_json, progress_bar

EPILOG = """\
Examples:

  ema-ckpt accumulate ckpts/ --decay 0.999                 # EMA in ckpts/ema

  ema-ckpt accumulate ckpts/ --half-life 2000 --out /ema   # same, by half-life in steps

  */30 * * * * ema-ckpt accumulate /ckpts --decay 0.9999 --quiet --wait 600   # crontab
"""


@reports_errors
def accumulate_command(
    checkpoints: Annotated[list[Path], typer.Argument(help="A folder of checkpoints, or checkpoint paths.")],
    decay: Annotated[float | None, typer.Option(help="Decay per optimizer step, e.g. 0.999.")] = None,
    half_life: Annotated[
        float | None, typer.Option("--half-life", metavar="STEPS", help="Half-life in steps (decay 2^(-1/N)).")
    ] = None,
    per_checkpoint: Annotated[
        bool, typer.Option("--per-checkpoint", help="Apply --decay once per checkpoint, not per step.")
    ] = False,
    warmup: Annotated[bool, typer.Option("--warmup", help="Decay at step n is min(decay, (1+n)/(10+n)).")] = False,
    out: Annotated[Path | None, typer.Option(help="EMA directory (default: CKPTS/ema).")] = None,
    dtype: Annotated[str, typer.Option(help="Accumulate and store floats in float32 or float64.")] = "float32",
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    step_regex: StepRegexOpt = None,
    restart: Annotated[bool, typer.Option("--restart", help="Start over if the EMA at --out has other settings.")] = False,
    wait: WaitOpt = 0.0,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Fold every checkpoint newer than the EMA into it (incremental, crash-safe)."""
    with progress_bar("accumulate", enabled=not (quiet or json_output)) as on_progress:
        result = accumulate(
            checkpoints, decay=decay, half_life=half_life, per_checkpoint=per_checkpoint, warmup=warmup,
            out=out, dtype=dtype, include=include or (), exclude=exclude or (), step_regex=step_regex,
            restart=restart, wait_seconds=wait, on_progress=on_progress,
        )
    if json_output:
        print_json({
            "out": str(result.out), "step": result.step, "up_to_date": result.up_to_date,
            "folded": [asdict(c) for c in result.folded], "terms": [asdict(t) for t in result.terms],
            "keys": result.keys, "bytes_read": result.bytes_read, "bytes_written": result.bytes_written,
            "seconds": round(result.seconds, 3), "profile": result.profile, "notes": result.notes,
        })
        return
    if not quiet:
        for line in result.notes:
            note(line)
    if result.up_to_date:
        if not quiet:
            console.print(f"{result.out}: up to date at step {result.step}; nothing new to fold", highlight=False)
        return
    if quiet:
        return
    steps = ", ".join(str(c.step) for c in result.folded)
    console.print(
        f"{result.out}: folded step(s) {steps}; EMA now at step {result.step} "
        f"({result.keys} keys, {human_bytes(result.bytes_read)} read, "
        f"{human_bytes(result.bytes_written)} written, {result.seconds:.1f} s)\n{result.profile}",
        highlight=False,
    )
