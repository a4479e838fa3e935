"""The one table that words library parameters as this CLI's flags.

Library errors, notes and warnings name library parameters (``at_step``, ``restart=True``);
the CLI shows them through :func:`cli_text` (see :mod:`ema_ckpt.errors`):

    >>> from ema_ckpt.errors import Note
    >>> cli_text(Note("skipped ckpts/step_3: left out ({skip})", mentions=("skip",)))
    'skipped ckpts/step_3: left out (--skip)'
    >>> cli_json({"notes": [Note("see {step_regex}", mentions=("step_regex",))], "step": 3})
    {'notes': ['see --step-regex'], 'step': 3}
"""

from __future__ import annotations

from typing import Any

from ..errors import worded
from ..streamed import StreamedList

FLAGS: dict[str, str] = {
    # accumulate: the kept EMAs
    "decay": "--decay",
    "half_life": "--half-life",
    "per_checkpoint": "--per-checkpoint",
    "warmup": "--warmup",
    "sigma_rel": "--sigma-rel",
    "sigma_rels": "--sigma-rel",
    "gamma": "--gamma",
    "gammas": "--gamma",
    "snapshot_every": "--snapshot-every",
    "restart": "--restart",
    "skip_nonfinite": "--skip-nonfinite",
    "skip_damaged": "--skip-damaged",
    # posthoc / average: where the output ends, which checkpoints
    "at_step": "--at-step",
    "last": "--last",
    "from_step": "--from-step",
    "to_step": "--to-step",
    "every": "--every",
    "weights": "--weights",
    # select: the candidates and the evaluation
    "eval_command": "--eval",
    "lasts": "--last",
    "emas": "--ema",
    "singles": "--singles",
    "soup": "--soup",
    "metric": "--metric",
    "maximize": "--maximize",
    "eval_format": "--eval-format",
    "eval_timeout": "--eval-timeout",
    "per_pass": "--per-pass",
    "work_dir": "--work-dir",
    "cache": "--work-dir",
    # inputs and outputs, shared by several commands
    "out": "--out",
    "format": "--format",
    "dtype": "--dtype",
    "include": "--include",
    "exclude": "--exclude",
    "step_regex": "--step-regex",
    "step_from": "--step-from",
    "component": "--component",
    "skip": "--skip",
    "allow_new_keys": "--allow-new-keys",
    "average_buffers": "--average-buffers",
    "overwrite": "--overwrite",
    "wait_seconds": "--wait",
    "workers": "--workers",
    "device": "--device",
    "max_shard_size": "--max-shard-size",
    "keep_prefix": "--keep-prefix",
    "state_key": "--state-key",
    "inert_globals": "--inert-global",
    "world_size": "--world-size",
    "dry_run": "--dry-run",
    # watch
    "interval": "--interval",
    "stop_when_idle": "--stop-when-idle",
    "use_inotify": "--no-inotify",
}
"""Library parameter → the flag that sets it: the one place where errors learn flag names."""


def flag_for(parameter: str) -> str:
    """The flag of a library parameter (``at_step`` → ``--at-step``).

    A parameter missing from :data:`FLAGS` is spelt the usual way (a test keeps the table whole).
    """
    return FLAGS.get(parameter, "--" + parameter.replace("_", "-"))


def cli_text(text: str) -> str:
    """A note or warning of a result (or plain text) as this CLI words it: flags, not parameters."""
    return worded(text, flag_for)


def cli_json(data: Any) -> Any:
    """``data`` for ``--json``: every note or warning in it worded by :func:`cli_text`."""
    if isinstance(data, str):
        return cli_text(data)
    if isinstance(data, StreamedList):
        return data.mapped(cli_json)
    if isinstance(data, dict):
        return {key: cli_json(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [cli_json(value) for value in data]
    return data
