"""Rendering of plans (``--dry-run``): a table of terms with a bar chart of the weights."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from ._flags import cli_text
from ._output import console, note, shown, warn

if TYPE_CHECKING:
    from ..commands.averaging import Plan

BAR_WIDTH = 32


def _bar(value: float, scale: float) -> Text:
    cells = 0 if scale == 0 else value / scale * BAR_WIDTH
    full = int(abs(cells))
    partial = " ▏▎▍▌▋▊▉"[int((abs(cells) - full) * 8)]
    text = "█" * full + (partial if partial != " " else "")
    return Text(text or "·", style="red" if value < 0 else "green")


def _number(value: float | None, fmt: str = ".4g") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def _common_folder(paths: list[str]) -> str | None:
    """The folder every input sits in, when there are several inputs and they share one."""
    if len(paths) < 2:
        return None
    try:
        common = os.path.commonpath(paths)
    except ValueError:
        return None
    return common if common and common not in paths else None


def render_plan(plan: Plan) -> None:
    """Print each output's terms, weights and summary; warnings go to stderr."""
    for output in plan.outputs:
        snapshot_inputs = any(t.sigma_rel is not None for t in output.terms)
        columns = ["input", "step"] + (["σ_rel"] if snapshot_inputs else []) + ["coefficient", "weight"]
        title = f"{output.name} at step {output.step}"
        if output.gamma is not None:
            title += f"  (σ_rel {_number(output.sigma_rel)}, γ {_number(output.gamma)})"
        common = _common_folder([str(t.path) for t in output.terms])
        if common is not None:
            title += f"\ninputs in {shown(common)}{os.sep}"
        table = Table(title=title, title_justify="left", show_edge=False)
        for column in columns:  # a path is folded onto more lines, never cut to look like another
            table.add_column(column, overflow="fold")
        scale = max((abs(t.coefficient) for t in output.terms), default=0.0)
        for term in output.terms:
            name = os.path.relpath(str(term.path), common) if common is not None else str(term.path)
            row: list[str | Text] = [shown(name), str(term.step)]
            if snapshot_inputs:
                row.append(_number(term.sigma_rel))
            row += [f"{term.coefficient:+.6g}", _bar(term.coefficient, scale)]
            table.add_row(*row)
        console.print(table)
        stats = output.stats
        parts = [f"Σc = {sum(t.coefficient for t in output.terms):.12g}"]
        if stats.get("sigma_rel") is not None:
            parts.append(f"effective σ_rel {_number(stats['sigma_rel'])}")
        if stats.get("half_life") is not None:
            parts.append(f"half-life {_number(stats['half_life'])} steps")
        if stats.get("mean_age") is not None:
            parts.append(f"mean age {_number(stats['mean_age'])} steps")
        if stats.get("n_eff") is not None:
            parts.append(f"N_eff {_number(stats['n_eff'], '.3g')}")
        if stats.get("condition") is not None:
            parts.append(f"cond(A) {_number(stats['condition'], '.2e')}, "
                         f"fit error {_number(stats['rel_error'], '.2e')}")
        console.print("  " + ", ".join(parts), highlight=False)
        for warning in output.warnings:
            warn(f"{output.name}: {cli_text(warning)}")
    for line in plan.notes:
        note(line)
