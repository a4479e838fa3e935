"""Rendering of plans (``--dry-run``): a table of terms with a bar chart of the weights."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rich.console import Console, ConsoleOptions
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ._flags import cli_text
from ._output import console, note, shown, warn
from ._tables import Name, name_table

if TYPE_CHECKING:
    from ..commands.averaging import Plan
    from ..plans import Term

BAR_WIDTH = 32
MIN_BAR_WIDTH = 8


class _Bar:
    """A coefficient as a bar, the largest filling the column; red when negative."""

    def __init__(self, value: float, scale: float) -> None:
        self.value, self.scale = value, scale

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        width = max(1, min(BAR_WIDTH, options.max_width))
        cells = 0 if self.scale == 0 else abs(self.value) / self.scale * width
        full = int(cells)
        partial = " ▏▎▍▌▋▊▉"[int((cells - full) * 8)]
        text = "█" * full + (partial if partial != " " else "")
        yield Text(text or "·", style="red" if self.value < 0 else "green", no_wrap=True, overflow="crop")


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


def _terms_table(terms: list[Term], names: list[str], snapshot_inputs: bool, title: str) -> Table:
    """The inputs, steps and coefficients, with a bar as wide as the terminal leaves room for
    (at least ``MIN_BAR_WIDTH``); past that the input names fold."""

    def table(bar_width: int | None) -> Table:
        out = name_table("input", "step", *(["σ_rel"] if snapshot_inputs else []), "coefficient",
                         right={"step", "σ_rel", "coefficient"}, title=title, title_justify="left")
        if bar_width is not None:
            out.add_column("weight", width=bar_width, no_wrap=True)
        scale = max((abs(t.coefficient) for t in terms), default=0.0)
        for term, name in zip(terms, names, strict=True):
            row: list[str | Name | _Bar] = [Name(name), str(term.step)]
            if snapshot_inputs:
                row.append(_number(term.sigma_rel))
            row.append(f"{term.coefficient:+.6g}")
            if bar_width is not None:
                row.append(_Bar(term.coefficient, scale))
            out.add_row(*row)
        return out

    natural = Measurement.get(console, console.options, table(None)).maximum
    room = console.width - natural - 3  # the bar column's separator and padding
    return table(max(MIN_BAR_WIDTH, min(BAR_WIDTH, room)))


_STATS = (("sigma_rel", "effective σ_rel {}", ".4g"), ("half_life", "half-life {} steps", ".4g"),
          ("mean_age", "mean age {} steps", ".4g"), ("n_eff", "N_eff {}", ".3g"), ("condition", "cond(A) {}", ".2e"),
          ("rel_error", "fit error {}", ".2e"))
"""A plan's statistics as its summary line shows them, in order (the post-hoc solve's last)."""


def plan_warnings(plan: Plan) -> list[str]:
    """Each output's warnings, ``name: warning``, worded with flags."""
    return [f"{o.name}: {cli_text(w)}" for o in plan.outputs for w in o.warnings]


def render_plan(plan: Plan) -> None:
    """Print each output's terms, weights and summary; warnings go to stderr."""
    for output in plan.outputs:
        snapshot_inputs = any(t.sigma_rel is not None for t in output.terms)
        title = f"{output.name} at step {output.step}"
        if output.gamma is not None:
            title += f"  (σ_rel {_number(output.sigma_rel)}, γ {_number(output.gamma)})"
        common = _common_folder([str(t.path) for t in output.terms])
        if common is not None:
            title += f"\ninputs in {shown(common)}{os.sep}"
        names = [os.path.relpath(str(t.path), common) if common is not None else str(t.path) for t in output.terms]
        console.print(_terms_table(output.terms, names, snapshot_inputs, title))
        parts = [f"Σc = {sum(t.coefficient for t in output.terms):.12g}"]
        parts += [label.format(_number(output.stats[name], fmt)) for name, label, fmt in _STATS
                  if output.stats.get(name) is not None]
        console.print("  " + ", ".join(parts), highlight=False)
        for warning in output.warnings:
            warn(f"{output.name}: {cli_text(warning)}")
    note(*plan.notes)
