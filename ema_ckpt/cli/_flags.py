"""Library parameters worded as this CLI's flags, read from the commands' own options.

Library errors, notes and warnings name library parameters (``at_step``, ``restart=True``);
the CLI shows them through :func:`cli_text` (see :mod:`ema_ckpt.errors`):

    >>> from ema_ckpt.errors import Note
    >>> cli_text(Note("skipped ckpts/step_3: left out ({skip})", mentions=("skip",)))
    'skipped ckpts/step_3: left out (--skip)'
    >>> cli_json({"notes": [Note("see {step_regex}", mentions=("step_regex",))], "step": 3})
    {'notes': ['see --step-regex'], 'step': 3}
"""

from __future__ import annotations

import functools
from typing import Any

import typer
import typer.core
import typer.main

from ..errors import worded
from ..streamed import StreamedList

CLI_NAMES: dict[str, str] = {
    "sigma_rels": "sigma_rel",
    "gammas": "gamma",
    "lasts": "last",
    "emas": "ema",
    "cache": "work_dir",
    "format": "out_format",
    "wait_seconds": "wait",
    "inert_globals": "inert_global",
    "use_inotify": "no_inotify",
}
"""Library parameters whose command-line parameter has another name (a list's flag is given once per
item; ``format`` would shadow the builtin). Every other parameter has the name of its flag's parameter."""


@functools.cache
def flags() -> dict[str, str]:
    """Library parameter → the flag that sets it, read from the commands' own options.

    A parameter that two commands spell differently is left out (:func:`flag_for` spells it).

        >>> flags()["wait_seconds"], flags()["at_step"]
        ('--wait', '--at-step')
    """
    from . import app

    spelt: dict[str, set[str]] = {}
    for command in typer.main.get_command(app).commands.values():  # type: ignore[attr-defined]
        for param in command.params:
            if isinstance(param, typer.core.TyperOption) and param.name:
                long = [opt for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")]
                spelt.setdefault(param.name, set()).update(long[:1])
    table = {name: next(iter(opts)) for name, opts in spelt.items() if len(opts) == 1}
    table.update({library: table[cli] for library, cli in CLI_NAMES.items() if cli in table})
    return table


def flag_for(parameter: str) -> str:
    """The flag of a library parameter (``at_step`` → ``--at-step``).

    A parameter no command has is spelt the usual way (a test checks that every parameter an
    error names has a flag).
    """
    return flags().get(parameter, "--" + parameter.replace("_", "-"))


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
