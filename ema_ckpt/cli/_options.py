"""Options shared by several commands, declared once, and a command's parameters as the library takes them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

_LIBRARY_NAMES = {"sigma_rel": "sigma_rels", "gamma": "gammas", "ema": "emas", "out_format": "format",
                  "wait": "wait_seconds", "inert_global": "inert_globals"}
"""The parameters of commands that the library functions name otherwise (a list's flag is given once per item)."""
_LISTS = {"include", "exclude", "skip", "inert_globals", "sigma_rels", "gammas", "emas"}


def library_args(given: dict[str, Any], *leave: str) -> dict[str, Any]:
    """A command's parameters as its library function's keyword arguments: named as the library
    names them, a list flag not given ``()``, without
    ``--json``, ``--quiet`` and the parameters ``leave`` names.

    >>> library_args({"inert_global": None, "wait": 5.0, "decay": None, "json_output": True, "quiet": False})
    {'inert_globals': (), 'wait_seconds': 5.0, 'decay': None}
    """
    args = {_LIBRARY_NAMES.get(name, name): value for name, value in given.items()
            if name not in ("json_output", "quiet", *leave)}
    return {name: () if value is None and name in _LISTS else value for name, value in args.items()}

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
                 help="Regex with one group matching the step in each checkpoint's path from the folder given "
                      r"(e.g. 'checkpoint-(\d+)/unet')."),
]
StepFromOpt = Annotated[
    str | None,
    typer.Option("--step-from", metavar="RECORD",
                 help="Take the steps from this record: global_step, a safetensors metadata key, a dotted path "
                      "into the file (state.timestamp.batch); 'epoch' counts epochs."),
]
ComponentOpt = Annotated[
    str | None,
    typer.Option("--component", metavar="NAME",
                 help="The model read inside checkpoints that hold several (unet, model_1, unet_ema); "
                      "default: each trained one, into OUT/NAME."),
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

# the kept EMA's profile: accumulate and watch
DecayOpt = Annotated[float | None, typer.Option(help="Decay per optimizer step, e.g. 0.999.")]
HalfLifeOpt = Annotated[
    float | None, typer.Option("--half-life", metavar="STEPS", help="Half-life in steps (decay 2^(-1/N)).")]
PerCheckpointOpt = Annotated[
    bool, typer.Option("--per-checkpoint", help="Apply --decay once per checkpoint, not per step.")]
WarmupOpt = Annotated[bool, typer.Option("--warmup", help="Decay at step n is min(decay, (1+n)/(10+n)).")]
GammaOpt = Annotated[
    list[str] | None, typer.Option("--gamma", help="Power-EMA exponents instead of σ_rel (one or more).")]
SnapshotEveryOpt = Annotated[
    int | None, typer.Option("--snapshot-every", metavar="STEPS", min=1,
                             help="With power EMAs: keep a snapshot of each every STEPS steps (for posthoc).")]
SkipNonfiniteOpt = Annotated[
    bool, typer.Option("--skip-nonfinite", help="Skip (and record) a checkpoint holding NaN/Inf instead of failing.")]
SkipDamagedOpt = Annotated[
    bool, typer.Option("--skip-damaged",
                       help="Skip (and record) a truncated or corrupt checkpoint (bytes that do not match "
                            "their CRC-32) instead of failing.")]
KeepPrefixOpt = Annotated[bool, typer.Option(
    "--keep-prefix", help="Keep every key's prefix: a DCP {'model': ...} container level ('model.') and a "
                          "wrapper's (DDP's 'module.') that the trainer's own loader would drop.")]
