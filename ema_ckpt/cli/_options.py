"""Options shared by several commands, declared once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print a JSON document on stdout instead of tables.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no notes.")]
WaitOpt = Annotated[
    float,
    typer.Option(
        "--wait", metavar="SECONDS", min=0,
        help="Wait up to SECONDS for another run holding the output's lock (default: fail at once, exit 75).",
    ),
]
StepRegexOpt = Annotated[
    str | None,
    typer.Option("--step-regex", metavar="REGEX",
                 help="Regex with one group matching the step in checkpoint directory names."),
]
IncludeOpt = Annotated[
    list[str] | None,
    typer.Option("--include", metavar="GLOB", help="Only keys matching GLOB (repeatable)."),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option("--exclude", metavar="GLOB", help="Skip keys matching GLOB (repeatable)."),
]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output (atomically).")]
WorkersOpt = Annotated[
    int,
    typer.Option("--workers", "-j", min=1, metavar="N",
                 help="Split the work over N processes (torch.distributed; under torchrun, its group)."),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="Where the arithmetic runs: cpu or cuda.")]
StateKeyOpt = Annotated[
    str | None,
    typer.Option("--state-key", metavar="KEY",
                 help="Single-file checkpoints: the state dict to read (e.g. state_dict_ema), not the one found."),
]
InertGlobalOpt = Annotated[
    list[str] | None,
    typer.Option("--inert-global", metavar="MODULE.NAME",
                 help="Read pickled objects of this class (or MODULE.*) as inert data; nothing runs (repeatable)."),
]
SkipOpt = Annotated[
    list[Path] | None,
    typer.Option("--skip", metavar="PATH", help="Leave this checkpoint out (repeatable); it is noted, never read."),
]
DtypeOpt = Annotated[str, typer.Option(help="Accumulate and store floats in float32 or float64.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show the plan (coefficients); read no tensor.")]
AverageBuffersOpt = Annotated[bool, typer.Option(
    "--average-buffers",
    help="Average MoE routers' statistics (e_score_correction_bias, expert_bias, tokens_per_expert) too; "
         "default: taken from the newest checkpoint.")]
