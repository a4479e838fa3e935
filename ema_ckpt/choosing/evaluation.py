"""The user's evaluation command, run on one candidate, and the score read from what it prints.

The command is a shell line holding ``{path}`` (the candidate's directory) and optionally
``{name}``, substituted shell-quoted (nothing else in the line is touched: a ``jq`` filter's
braces stay); the environment names them too (``EMA_CKPT_CANDIDATE_PATH``, ``…_NAME``). The
score is the last number printed on stdout or, with ``metric``, that (dotted) key of the last
JSON line holding it. A command that exits non-zero, times out or prints no finite score fails,
its reason one line, its whole output in a log.

The command runs in a session of its own, whose every process is ended however it ends
(SIGTERM, then SIGKILL after :data:`GRACE_SECONDS`); only the last :data:`TAIL_BYTES` of each
stream are kept in memory, so a command printing gigabytes costs no memory.

Example:
    >>> parse_score("step 10\\nheld-out loss: 0.25\\n")
    0.25
    >>> parse_score('{"eval": {"loss": 1.5}, "step": 10}\\n', metric="eval.loss")
    1.5
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import selectors
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import OptionError

__all__ = ["GRACE_SECONDS", "TAIL_BYTES", "EvalOutcome", "Tail", "check_command", "end_group", "evaluate",
           "parse_score"]

_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])|(?<!\w)[-+]?(?:nan|inf)(?!\w)",
                     re.IGNORECASE)
TAIL_BYTES = 64 << 10
"""What is kept in memory of each of a command's streams (the log keeps them whole)."""
GRACE_SECONDS = 3.0
"""How long an evaluation's processes have to end after SIGTERM before they are killed."""
_CHUNK = 16 << 10
_DRAIN_SECONDS = 2.0  # after the group is ended: output still buffered in a pipe is read this long at most


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
    if metric is not None:
        value = next((v for line in reversed(output.splitlines()) if (v := _metric(line, metric)) is not None), None)
        if value is None:
            raise ValueError(f"printed no JSON line with a number at {metric!r}")
    else:
        found = _NUMBER.findall(output)
        if not found:
            raise ValueError("printed no number")
        value = float(found[-1])
    if not math.isfinite(value):
        raise ValueError(f"scored {value} (not finite)")
    return value


def _metric(line: str, metric: str) -> float | None:
    """``metric`` (dotted) of a JSON object line, as a number, or None."""
    try:
        item: object = json.loads(line) if line.strip().startswith("{") else None
    except ValueError:
        return None
    for part in metric.split("."):
        item = item.get(part) if isinstance(item, dict) else None
    if isinstance(item, bool) or not isinstance(item, (int, float, str)):
        return None
    try:
        return float(item)
    except ValueError:
        return None


class Tail:
    """The last ``cap`` bytes of a stream, and whether anything before them was dropped."""

    def __init__(self, cap: int = TAIL_BYTES) -> None:
        self.cap = cap
        self.data = bytearray()
        self.dropped = False
        self.peak = 0  # the most bytes held at once (tests: never above ``cap``)

    def add(self, chunk: bytes) -> None:
        if len(chunk) >= self.cap:
            self.dropped = self.dropped or bool(self.data) or len(chunk) > self.cap
            self.data = bytearray(chunk[-self.cap:])
        else:
            self.data += chunk
            excess = len(self.data) - self.cap
            if excess > 0:
                del self.data[:excess]
                self.dropped = True
        self.peak = max(self.peak, len(self.data))

    def text(self) -> str:
        """The tail as text; when the start was dropped, from its first whole line on."""
        data = bytes(self.data)
        if self.dropped:
            data = data[data.find(b"\n") + 1:]  # none: -1, the whole tail
        return data.decode(errors="replace")


def evaluate(command: str, path: Path, name: str, *, metric: str | None = None, timeout: float | None = None,
             log: Path | None = None, tail_bytes: int = TAIL_BYTES) -> EvalOutcome:
    """Run ``command`` on the candidate at ``path`` and read its score; never raises for the
    command's own failures (they are the outcome's ``error``).

    The command's group is ended however this returns or raises (Ctrl-C, SIGTERM)."""
    line = command.replace("{path}", shlex.quote(str(path))).replace("{name}", shlex.quote(name))
    env = {**os.environ, "EMA_CKPT_CANDIDATE_PATH": str(path), "EMA_CKPT_CANDIDATE_NAME": name}
    out, err = Tail(tail_bytes), Tail(tail_bytes)
    start = time.monotonic()
    with _log_files(log, line) as (log_out, log_err):
        proc = subprocess.Popen(line, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, start_new_session=True)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            timed_out = _pump(proc, {proc.stdout.fileno(): [out, log_out], proc.stderr.fileno(): [err, log_err]},
                              None if timeout is None else start + timeout)
            code = None if timed_out else proc.wait()
        finally:
            end_group(proc)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        seconds = time.monotonic() - start
        _finish_log(log, log_out, log_err, code)
    if code is None:
        return EvalOutcome(None, f"timed out after {timeout:g} s", seconds)
    if code != 0:
        last = _last_line(err.text()) or _last_line(out.text())
        return EvalOutcome(None, f"exit {code}" + (f": {last}" if last else ""), seconds)
    try:
        return EvalOutcome(parse_score(out.text(), metric), None, seconds)
    except ValueError as error:
        return EvalOutcome(None, str(error), seconds)


def _pump(proc: subprocess.Popen[bytes], streams: dict[int, list[Any]],
          deadline: float | None) -> bool:
    """Copy the command's output into the tails and the log until both streams close; True
    when ``deadline`` passed first. Once the command's shell has exited, what it left running
    is ended (it would hold the pipes open) and the rest of the output drained briefly."""
    with selectors.DefaultSelector() as sel:
        for stream in streams:
            sel.register(stream, selectors.EVENT_READ)
        drain_until: float | None = None
        while sel.get_map():
            now = time.monotonic()
            if deadline is not None and now >= deadline and drain_until is None:
                return True
            if drain_until is not None and now >= drain_until:
                return False  # an escaped process holds a pipe: its output is not waited for
            if drain_until is None and proc.poll() is not None:
                end_group(proc)
                drain_until = time.monotonic() + _DRAIN_SECONDS
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - now))
            for key, _ in sel.select(wait):
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                tail, sink = streams[key.fd]
                tail.add(chunk)
                if sink is not None:
                    try:
                        sink.write(chunk)
                    except OSError:
                        streams[key.fd][1] = None  # a full disk: the log stops, not the score
    return False


def end_group(proc: subprocess.Popen[bytes], grace: float = GRACE_SECONDS) -> None:
    """End every process of ``proc``'s group (its own session): SIGTERM, then SIGKILL after
    ``grace`` seconds to whatever is left; reap ``proc``."""
    pgid = proc.pid  # start_new_session: the group is the command's pid, alive while any member is
    if not _signal_group(pgid, signal.SIGTERM):
        proc.poll()
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reap the shell so that it does not count as alive
        if not _group_alive(pgid):
            break
        time.sleep(0.02)
    else:
        _signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


def _signal_group(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies of others' children do not count)."""
    if not os.path.isdir("/proc"):
        return _signal_group(pgid, 0)
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # not a process, or one gone
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


@contextlib.contextmanager
def _log_files(log: Path | None, line: str) -> Iterator[tuple[BinaryIO | None, BinaryIO | None]]:
    """The log (its command line written) for stdout, and a file beside it for stderr, joined at the end."""
    if log is None:
        yield None, None
        return
    out = err = None
    with contextlib.suppress(OSError):  # a log is a convenience: never a reason to lose the score
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "wb")  # noqa: SIM115  (closed below)
        out.write(f"$ {line}\n--- stdout\n".encode(errors="replace"))
        err = open(log.with_name(log.name + ".stderr"), "w+b")  # noqa: SIM115
    try:
        yield out, err
    finally:
        for f in (out, err):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        with contextlib.suppress(OSError):
            log.with_name(log.name + ".stderr").unlink(missing_ok=True)


def _finish_log(log: Path | None, out: BinaryIO | None, err: BinaryIO | None, code: int | None) -> None:
    """Append the stderr and the status to the log."""
    if log is None or out is None:
        return
    with contextlib.suppress(OSError):
        out.write(b"\n--- stderr\n")
        if err is not None:
            err.seek(0)
            while chunk := err.read(1 << 20):
                out.write(chunk)
        status = "timed out" if code is None else f"exit {code}"
        out.write(f"\n[{status}]\n".encode())
        out.flush()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""
