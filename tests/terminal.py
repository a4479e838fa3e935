"""A real terminal for screen tests: a detached tmux session of a chosen size.

The command runs in tmux's pseudo-terminal, so the program sees a terminal (colours, progress
bars, its width from the tty) exactly as a user's shell would give it; ``capture-pane`` reads
back what the screen shows. Frames are sampled while the command runs, so transient output
(a progress bar that is cleared at the end) can be checked too.

Example:
    >>> screen = run_in_terminal(["ema-ckpt", "inspect", "ckpt"], width=80)  # doctest: +SKIP
    >>> screen.exit_code, screen.lines[0]                                     # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

_EXIT_MARK = "__screen_exit__"
_sessions = itertools.count()


@dataclass
class Screen:
    """What a command left on a terminal: every line it printed (scrollback included), its exit
    code, and the distinct frames seen while it ran."""

    lines: list[str]
    exit_code: int
    frames: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def tmux_or_skip() -> str:
    """tmux's path; a skip where it is missing (CI installs it and sets EMA_CKPT_REQUIRE_TMUX=1,
    which makes a missing tmux a failure instead)."""
    found = shutil.which("tmux")
    if found is None:
        if os.environ.get("EMA_CKPT_REQUIRE_TMUX"):
            pytest.fail("tmux is required for the screen tests (EMA_CKPT_REQUIRE_TMUX is set)")
        pytest.skip("tmux is not installed")
    return found


def run_in_terminal(argv: Sequence[str], *, width: int, height: int = 50, cwd: Path | None = None,
                    env: Mapping[str, str] | None = None, timeout: float = 120.0,
                    sample_every: float | None = None) -> Screen:
    """Run ``argv`` in a fresh ``width`` × ``height`` terminal and read its screen back.

    With ``sample_every`` (seconds), the visible screen is also captured that often while the
    command runs (``Screen.frames``); without it the command runs unobserved until it exits.
    """
    tmux = tmux_or_skip()
    socket = f"ema-ckpt-test-{os.getpid()}-{next(_sessions)}"
    variables = {"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **(env or {})}
    variables.pop("COLUMNS", None)  # the width comes from the terminal itself
    variables.pop("LINES", None)
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items())
    scratch = Path(os.environ.get("TMPDIR", "/tmp"))
    config, exited = scratch / f"{socket}.conf", scratch / f"{socket}.exited"
    # the exit is known from a file (no tmux call per poll); the mark splits the screen's lines
    script = (f"cd {shlex.quote(str(cwd or Path.cwd()))} && env -u COLUMNS -u LINES {exports} "
              f"{shlex.join(argv)}; code=$?; echo {_EXIT_MARK} $code; touch {shlex.quote(str(exited))}; "
              "sleep 3600")
    config.write_text("set -g history-limit 100000\nset -g status off\n")
    base = [tmux, "-L", socket, "-f", str(config)]
    try:
        subprocess.run([*base, "new-session", "-d", "-s", "main", "-x", str(width), "-y", str(height),
                        "--", "sh", "-c", script], check=True, timeout=30)
        frames: list[str] = []
        deadline = time.monotonic() + timeout
        while not exited.exists():
            if sample_every is not None:
                frame = _capture(base, history=False)
                if not frames or frame != frames[-1]:
                    frames.append(frame)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{shlex.join(argv)} still running after {timeout:.0f} s:\n"
                                   f"{_capture(base, history=False)}")
            time.sleep(sample_every or 0.02)
        everything = _capture(base, history=True).rstrip("\n").split("\n")
        while not any(line.startswith(_EXIT_MARK) for line in everything):  # tmux may not have drawn it yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"{shlex.join(argv)}: its exit never reached the screen:\n{everything[-5:]}")
            time.sleep(0.02)
            everything = _capture(base, history=True).rstrip("\n").split("\n")
        marker = max(i for i, line in enumerate(everything) if line.startswith(_EXIT_MARK))
        code = int(everything[marker].split()[1])
        lines = [line.rstrip() for line in everything[:marker]]
        while lines and not lines[-1]:
            lines.pop()
        return Screen(lines, code, frames)
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True, timeout=30)
        config.unlink(missing_ok=True)
        exited.unlink(missing_ok=True)


def _capture(base: list[str], *, history: bool) -> str:
    span = ["-S", "-", "-E", "-"] if history else []
    return subprocess.run([*base, "capture-pane", "-p", "-t", "main", *span], check=True, capture_output=True,
                          text=True, timeout=30).stdout
