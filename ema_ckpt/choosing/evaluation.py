"""The user's evaluation command, run on one candidate, and the score read from what it prints.

The command is a shell line holding ``{path}`` (the candidate's directory) and optionally
``{name}`` (its label); both are substituted shell-quoted, and nothing else in the line is
touched (braces of a ``jq`` filter or a JSON argument stay as typed). The candidate is also
named in the environment (``EMA_CKPT_CANDIDATE_PATH``, ``EMA_CKPT_CANDIDATE_NAME``).

The score is the last number the command prints on stdout or, with ``metric``, that key of
the last JSON object line holding it (dotted keys reach into nested objects: ``eval.loss``).
A command that exits non-zero, times out, or prints no finite score fails; its reason is one
line, and the whole output is kept in a log.

Example:
    >>> parse_score("step 10\\nheld-out loss: 0.25\\n")
    0.25
    >>> parse_score('{"eval": {"loss": 1.5}, "step": 10}\\n', metric="eval.loss")
    1.5
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import OptionError

__all__ = ["EvalOutcome", "check_command", "evaluate", "parse_score"]

_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])|(?<!\w)[-+]?(?:nan|inf)(?!\w)",
                     re.IGNORECASE)
_TAIL = 64 << 10  # what is kept of a command's output in memory (the log keeps it whole)


@dataclass(frozen=True, slots=True)
class EvalOutcome:
    """One evaluation: the score, or why there is none (one line), and how long it took."""

    score: float | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.score is not None


def check_command(command: str) -> None:
    """Refuse an evaluation command that cannot know which candidate to evaluate.

    Example:
        >>> check_command("python eval.py {path}")
    """
    if "{path}" not in command:
        raise OptionError("eval_command", f"must name the candidate with {{path}} (e.g. 'python eval.py {{path}}'), "
                          f"got {command!r}", value=command)


def parse_score(output: str, metric: str | None = None) -> float:
    """The score in a command's stdout: its last number, or ``metric`` of its last JSON line.

    Raises:
        ValueError: no score (the message is one line, shown as the candidate's failure).
    """
    if metric is None:
        found = _NUMBER.findall(output)
        if not found:
            raise ValueError("printed no number")
        value = float(found[-1])
    else:
        value_found: float | None = None
        for line in reversed(output.splitlines()):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                data = json.loads(line)
            except ValueError:
                continue
            item: object = data
            for part in metric.split("."):
                item = item.get(part) if isinstance(item, dict) else None
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                value_found = float(item)
                break
            if isinstance(item, str):
                try:
                    value_found = float(item)
                    break
                except ValueError:
                    continue
        if value_found is None:
            raise ValueError(f"printed no JSON line with a number at {metric!r}")
        value = value_found
    if not math.isfinite(value):
        raise ValueError(f"scored {value} (not finite)")
    return value


def evaluate(command: str, path: Path, name: str, *, metric: str | None = None, timeout: float | None = None,
             log: Path | None = None) -> EvalOutcome:
    """Run ``command`` on the candidate at ``path`` and read its score; never raises for the
    command's own failures (they are the outcome's ``error``)."""
    line = command.replace("{path}", shlex.quote(str(path))).replace("{name}", shlex.quote(name))
    env = {**os.environ, "EMA_CKPT_CANDIDATE_PATH": str(path), "EMA_CKPT_CANDIDATE_NAME": name}
    start = time.monotonic()
    try:
        proc = subprocess.run(line, shell=True, capture_output=True, text=True, errors="replace", env=env,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as err:
        _write_log(log, line, _text(err.stdout), _text(err.stderr), None)
        return EvalOutcome(None, f"timed out after {timeout:g} s", time.monotonic() - start)
    seconds = time.monotonic() - start
    _write_log(log, line, proc.stdout, proc.stderr, proc.returncode)
    if proc.returncode != 0:
        last = _last_line(proc.stderr) or _last_line(proc.stdout)
        return EvalOutcome(None, f"exit {proc.returncode}" + (f": {last}" if last else ""), seconds)
    try:
        return EvalOutcome(parse_score(proc.stdout[-_TAIL:], metric), None, seconds)
    except ValueError as err:
        return EvalOutcome(None, str(err), seconds)


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _write_log(log: Path | None, line: str, stdout: str, stderr: str, code: int | None) -> None:
    if log is None:
        return
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        status = "timed out" if code is None else f"exit {code}"
        log.write_text(f"$ {line}\n[{status}]\n--- stdout\n{stdout}\n--- stderr\n{stderr}", errors="replace")
    except OSError:
        pass  # a log is a convenience: never a reason to lose the score
