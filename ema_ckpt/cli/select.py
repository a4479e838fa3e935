"""``ema-ckpt select``: evaluate candidate averages with the user's command, publish the best."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from ..commands.select import SelectEvent, SelectResult

from ..errors import UsageError
from . import _options as opt
from ._errors import reports_errors
from ._flags import cli_text
from ._options import library_args
from ._output import console, err_console, note, print_json, shown
from ._plan import render_plan
from ._tables import name_table

EPILOG = """\
Examples (the command prints a score; lower is better unless --maximize):

  ema-ckpt select ckpts/ --sigma-rel 0.05:0.25:0.05 --last 4,8 \\
      --eval 'python eval.py --weights {path}' --out best/

  ema-ckpt select ckpts/ --singles all --soup greedy --maximize \\
      --eval 'python eval_acc.py {path}' --metric accuracy --out soup/

  ema-ckpt select ckpts/ --last 8 --weights uniform,minus-sqrt,cosine --dry-run

  {path} is the candidate's directory (model.safetensors inside, or --eval-format
  dcp|hf|torch), {name} its label. The score is the last number printed, or the
  --metric key of the last JSON line. Scores are cached in OUT.select/scores.json:
  a rerun or a widened grid evaluates only new candidates. A failed evaluation is
  reported and skipped; exit 10 when every one fails.
"""


def _split(values: list[str] | None) -> list[str]:
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def _report(event: SelectEvent) -> None:
    """One line on stderr per candidate (evaluated, cached or failed) and per pass written."""
    where = f"[{event.index}/{event.total}]"
    if event.kind == "writing":
        err_console.print(f"{where} writing {cli_text(event.name)}", highlight=False, style="dim")
    elif event.kind == "failed":
        err_console.print(f"{where} {shown(event.name)}: failed ({shown(event.error)})", highlight=False,
                          style="yellow")
    else:
        source = "cached" if event.kind == "cached" else f"{event.seconds:.1f} s"
        err_console.print(f"{where} {shown(event.name)}: {event.score:.6g} ({source})", highlight=False)


def _show(result: SelectResult, maximize: bool) -> None:
    table = name_table("candidate", "score", "vs chosen", "", right=("score", "vs chosen"))
    for item in result.scores:
        if item.score is None:
            table.add_row(shown(item.name), "failed", "", shown(item.error or ""))
            continue
        delta = item.score - result.score
        mark = "← chosen" if item.name == result.chosen else ("cached" if item.cached else "")
        table.add_row(shown(item.name), f"{item.score:.6g}", "" if item.name == result.chosen else f"{delta:+.3g}",
                      mark)
    console.print(table)
    if result.soup is not None:
        kept = ", ".join(result.soup.members)
        console.print(f"greedy soup: {len(result.soup.members)} of {len(result.soup.path)} checkpoints ({kept})",
                      highlight=False)
    better = "highest" if maximize else "lowest"
    console.print(f"chose {shown(result.chosen)} ({better} score, {result.score:.6g}) → {shown(result.out)}; "
                  f"{result.evaluated} evaluated, {sum(s.cached for s in result.scores)} from the cache",
                  highlight=False)
    if result.plot is not None:
        note(f"plot: {shown(result.plot)}")


def _as_json(result: SelectResult) -> dict[str, object]:
    return {
        "chosen": result.chosen, "score": result.score, "out": str(result.out), "evaluated": result.evaluated,
        "cache": str(result.cache), "plot": str(result.plot) if result.plot else None,
        "candidates": [{"name": s.name, "score": s.score, "error": s.error, "cached": s.cached,
                        "terms": [{"path": t.path, "step": t.step, "coefficient": t.coefficient}
                                  for t in s.output.terms]} for s in result.scores],
        "soup": None if result.soup is None else {
            "members": result.soup.members, "score": result.soup.score,
            "path": [{"added": p.added, "score": p.score, "kept": p.kept} for p in result.soup.path]},
        "notes": list(result.plan.notes),
    }


@reports_errors
def select_command(
    checkpoints: Annotated[list[str], typer.Argument(help="A folder of checkpoints (or of snapshots), or paths.")],
    out: Annotated[str | None, typer.Option("--out", "-o", metavar="PATH", help="Where the best average goes.")
                   ] = None,
    eval_command: Annotated[str | None, typer.Option(
        "--eval", metavar="CMD", help="Shell command scoring one candidate: {path} (and {name}) are filled in.")
    ] = None,
    sigma_rel: Annotated[list[str] | None, typer.Option(
        "--sigma-rel", help="Post-hoc EMA candidates: 0.05,0.1 or 0.05:0.25:0.05.")] = None,
    gamma: Annotated[list[str] | None, typer.Option("--gamma", help="Power-EMA exponents instead of σ_rel.")] = None,
    last: Annotated[list[str] | None, typer.Option(
        "--last", help="Averages of the newest K: 4,8,16 or 2:16:2.")] = None,
    every: Annotated[int | None, typer.Option("--every", min=1, help="--last: every N-th checkpoint (LAWA).")
                     ] = None,
    weights: Annotated[list[str] | None, typer.Option(
        "--weights", metavar="SCHEDULE", help="--last weighted by each: uniform, linear, minus-sqrt, cosine, a CSV.")
    ] = None,
    ema: Annotated[list[str] | None, typer.Option("--ema", metavar="DIR", help="An accumulate output, as it is.")
                   ] = None,
    singles: Annotated[str | None, typer.Option(
        "--singles", metavar="K|all", help="Each of the newest K checkpoints alone.")] = None,
    soup: Annotated[str | None, typer.Option(
        "--soup", metavar="greedy", help="A greedy soup of the single checkpoints (all, unless --singles).")] = None,
    at_step: Annotated[int | None, typer.Option("--at-step", help="Post-hoc EMAs end at this step.")] = None,
    metric: Annotated[str | None, typer.Option(
        "--metric", metavar="KEY", help="Score = KEY of the last JSON line (dots reach inside: eval.loss).")] = None,
    maximize: Annotated[bool, typer.Option("--maximize", help="Higher is better (default: lower, a loss).")
                        ] = False,
    eval_format: Annotated[str, typer.Option(
        "--eval-format", help="Candidates as safetensors, dcp, hf or torch.")] = "safetensors",
    out_format: Annotated[str | None, typer.Option(
        "--format", metavar="FORMAT", help="The chosen output's format (default: --eval-format).")] = None,
    dtype: opt.DtypeOpt = "float32",
    average_buffers: opt.AverageBuffersOpt = False,
    include: opt.IncludeOpt = None,
    exclude: opt.ExcludeOpt = None,
    step_regex: opt.StepRegexOpt = None,
    step_from: opt.StepFromOpt = None,
    component: opt.ComponentOpt = None,
    skip: opt.SkipOpt = None,
    state_key: opt.StateKeyOpt = None,
    inert_global: opt.InertGlobalOpt = None,
    per_pass: Annotated[int | None, typer.Option(
        "--per-pass", min=1, help="Candidates written per pass (default: what the scratch disk holds, ≤ 8).")
    ] = None,
    eval_timeout: Annotated[float | None, typer.Option(
        "--eval-timeout", metavar="SECONDS", help="An evaluation running longer fails.")] = None,
    work_dir: Annotated[str | None, typer.Option(
        "--work-dir", metavar="DIR", help="Score cache, logs, scratch (default: OUT.select beside OUT).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the candidates and coefficients; run nothing.")
                       ] = False,
    overwrite: opt.OverwriteOpt = False,
    wait: opt.WaitOpt = 0.0,
    workers: opt.WorkersOpt = 1,
    device: opt.DeviceOpt = "cpu",
    json_output: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Choose the best average by your own evaluation: post-hoc EMAs, latest-K, schedules, soups."""
    args = library_args(locals(), "last") | {"out": out or Path("select"), "lasts": _split(last),
                                             "weights": _split(weights)}
    if out is None and not dry_run:
        raise UsageError("--out is required (unless --dry-run)")
    from ..commands.select import select

    result = select(**args, on_event=None if quiet or json_output else _report)
    from ..plans import Plan

    if isinstance(result, Plan):
        if json_output:
            print_json(result.to_json())
        else:
            render_plan(result)
            note(f"{len(result.outputs)} candidates; each written as {eval_format} and scored by --eval")
        return
    if json_output:
        print_json(_as_json(result))
    elif not quiet:
        note(*result.plan.notes)
        _show(result, maximize)
