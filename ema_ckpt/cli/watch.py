"""``ema-ckpt watch``: a sidecar that folds each checkpoint as soon as it is complete."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from ..watching import WatchFold

from .. import _signals
from ..errors import CheckpointError
from . import _options as opt
from ._errors import reports_errors
from ._flags import cli_text
from ._options import library_args
from ._output import console, err_console, error, folded, print_json, shown

EPILOG = """\
Examples:

  ema-ckpt watch ckpts/ --decay 0.999                    # beside the training job; EMA in ckpts/ema

  ema-ckpt watch ckpts/ --half-life 2000 --out ema/ --interval 10

  ema-ckpt watch ckpts/ --sigma-rel 0.05,0.1 --snapshot-every 10000 --json

  ema-ckpt watch ckpts/ --decay 0.999 --stop-when-idle 3600   # ends an hour after the last save

  ema-ckpt watch s3://bucket/run/ckpts --decay 0.999 --out s3://bucket/run/ema --interval 60

  Each complete checkpoint is staged into CKPTS/.ema-ckpt-incoming the moment it is seen
  (a single file reflinked or copied, a folder's files reflinked or hard-linked; on object
  storage: polled every interval and downloaded into a local temporary folder), so retention
  (save_total_limit=1, save_top_k=1) cannot take it before it is folded. The options are
  checked before anything is watched (exit 2). SIGTERM or Ctrl-C: the fold in progress
  finishes, then exit 0 (a second one stops at once). A fold, or a look at the folder, that
  fails is said in one line (once) and watching goes on; a staged step whose bytes changed
  before it was folded is said as lost, and the exit status is then 3; so is a checkpoint
  that could not be staged and that no later look staged.
"""


@reports_errors
def watch_command(
    checkpoints: Annotated[str, typer.Argument(help="The folder the training job saves checkpoints into.")],
    decay: opt.DecayOpt = None,
    half_life: opt.HalfLifeOpt = None,
    per_checkpoint: opt.PerCheckpointOpt = False,
    warmup: opt.WarmupOpt = False,
    sigma_rel: Annotated[
        list[str] | None, typer.Option("--sigma-rel", help="Power-function EMAs instead (EDM2), e.g. 0.05,0.1.")
    ] = None,
    gamma: opt.GammaOpt = None,
    snapshot_every: opt.SnapshotEveryOpt = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", metavar="PATH", help="EMA directory (default: CKPTS/ema); a path or a URL.")] = None,
    interval: Annotated[float, typer.Option(
        "--interval", metavar="SECONDS", help="Seconds between looks at the folder (inotify wakes it sooner).")] = 30.0,
    stop_when_idle: Annotated[float | None, typer.Option(
        "--stop-when-idle", metavar="SECONDS", help="Exit 0 once this long passes with no new checkpoint.")] = None,
    no_inotify: Annotated[bool, typer.Option("--no-inotify", help="Poll every --interval only.")] = False,
    dtype: opt.DtypeOpt = "float32",
    include: opt.IncludeOpt = None,
    exclude: opt.ExcludeOpt = None,
    step_regex: opt.StepRegexOpt = None,
    step_from: opt.StepFromOpt = None,
    component: opt.ComponentOpt = None,
    average_buffers: opt.AverageBuffersOpt = False,
    skip_nonfinite: opt.SkipNonfiniteOpt = False,
    skip_damaged: opt.SkipDamagedOpt = False,
    state_key: opt.StateKeyOpt = None,
    workers: opt.WorkersOpt = 1,
    device: opt.DeviceOpt = "cpu",
    json_output: Annotated[
        bool, typer.Option("--json", help="One JSON line per fold or error, and one at the end.")
    ] = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Fold each new checkpoint into the EMA as soon as it is complete, until stopped."""
    args = library_args(locals(), "no_inotify") | {"use_inotify": not no_inotify, "wait_seconds": interval}
    from ..watching import watch  # imported here: it loads torch, which --help never needs

    stop = threading.Event()

    def on_signal(signum: int) -> None:
        stop.signalled = True  # type: ignore[attr-defined]
        stop.set()
        if not json_output and not quiet:
            err_console.print("stopping after the fold in progress (again: stop now)", style="yellow")

    def on_fold(fold: WatchFold) -> None:
        if json_output:
            print_json({"event": "fold", "out": fold.out, "steps": fold.steps, "step": fold.step,
                        "seconds": round(fold.seconds, 3), "notes": fold.notes}, compact=True)
        elif not quiet:
            console.print(f"{folded(fold.out, fold.steps)}; EMA now at step {fold.step} ({fold.seconds:.1f} s)",
                          highlight=False)

    def on_error(message: str) -> None:
        if json_output:
            print_json({"event": "error", "message": message}, compact=True)
        else:
            error(f"{cli_text(message)} (watching goes on)")

    with _signals.deferring(on_signal):
        result = watch(**args, stop=stop, on_fold=on_fold, on_error=on_error)
    lost = sorted(result.lost)
    if json_output:
        print_json({"event": "stopped", "why": result.stopped, "out": str(result.out), "step": result.step,
                    "folds": len(result.folds), "errors": len(result.errors), "lost": lost,
                    "unstaged": [str(c) for c in result.unstaged]}, compact=True)
    elif not quiet:
        console.print(f"{shown(result.out)}: stopped ({result.stopped}); EMA at step {result.step}, "
                      f"{len(result.folds)} folds", highlight=False)
    if lost or result.unstaged:  # a checkpoint seen and never folded: never an exit 0
        if not json_output and lost:
            error(f"{len(lost)} staged step(s) were rewritten before they were folded and are lost to the EMA "
                  "(see above)")
        if not json_output and result.unstaged:
            error(f"{len(result.unstaged)} checkpoint(s) could not be staged and were never folded: "
                  f"{', '.join(shown(c) for c in result.unstaged)}")
        raise typer.Exit(CheckpointError.exit_code)
