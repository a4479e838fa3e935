"""Folds of a training job's checkpoints in a separate process: what every callback shares.

:class:`BackgroundFolds` stages each checkpoint the moment the trainer says it saved it
(:func:`~ema_ckpt.watching.stage`) and keeps at most one worker process running
:func:`~ema_ckpt.watch` over the folder until nothing is left to fold. Training waits for a
fold only in :meth:`BackgroundFolds.finish`, at its end.

Example:
    >>> folds = BackgroundFolds("out", out="out/ema", options={"decay": 0.999})   # doctest: +SKIP
    >>> folds.saved("out/checkpoint-500")                                          # doctest: +SKIP
    >>> folds.finish().step                                                        # doctest: +SKIP
    500
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FoldError
from ..watching import incoming_dir, stage

logger = logging.getLogger("ema_ckpt")

WORKER_IDLE_SECONDS = 20.0
"""A worker stays this long after its last fold, so that saves a few seconds apart do not pay
a new process (Python and torch starting) each."""
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                       "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
"""torchrun's variables: a worker that inherited them would join the training's process group."""


@dataclass(slots=True)
class FoldsDone:
    """What the folds of a training run did: the EMA's step and where it is, and the failures."""

    out: str
    step: int | None = None
    folded: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Raise :class:`~ema_ckpt.errors.FoldError` if a fold failed."""
        if self.errors:
            raise FoldError(f"{self.out}: {len(self.errors)} fold(s) failed; the first: {self.errors[0]}")


class BackgroundFolds:
    """One worker process at a time folding the checkpoints of ``folder`` into ``out``.

    ``options``: :func:`ema_ckpt.accumulate`'s profile options (``decay``, ``half_life``,
    ``sigma_rels``, ``snapshot_every``, ``warmup``, ...), passed to :func:`ema_ckpt.watch`;
    ``ignore``: checkpoints of ``folder`` the worker never stages (see its ``ignore``).
    """

    def __init__(self, folder: str | os.PathLike[str], *, out: str | os.PathLike[str],
                 options: dict[str, Any], ignore: Sequence[str] = ()) -> None:
        self.folder = Path(folder)
        self.out = str(out)
        self.options = dict(options)
        self.ignore = list(ignore)
        self.done = FoldsDone(out=self.out)
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._pending = False
        self._stopping = False  # finish() asked the worker to stop: its SIGTERM is no failure
        self._lock = threading.Lock()

    def saved(self, checkpoint: str | os.PathLike[str]) -> None:
        """The trainer saved ``checkpoint``: stage it now, fold it soon."""
        try:
            stage(checkpoint, incoming_dir(self.folder))
        except FileNotFoundError:
            logger.warning("ema-ckpt: %s was gone before it could be staged; not folded", checkpoint)
            return
        with self._lock:
            self._pending = True
        self.poll()

    def poll(self) -> None:
        """Start a worker if checkpoints wait and none runs (cheap: call it from any hook)."""
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                return
            self._join_reader()
            if self._pending:
                self._pending = False
                self._start()

    def finish(self, timeout: float | None = None) -> FoldsDone:
        """Wait for every staged checkpoint to be folded; the outcome, each failure logged."""
        with self._lock:
            process = self._process
        if process is not None and process.poll() is None:
            self._stopping = True
            process.terminate()  # the worker makes a last pass over what is staged, then exits
            process.wait(timeout=timeout)
        with self._lock:
            self._join_reader()
            self._pending = False
            if self._waiting():  # staged after the worker's last pass began
                self._start(idle=0.0)
            process = self._process
        if process is not None:
            process.wait(timeout=timeout)
            with self._lock:
                self._join_reader()
        for message in self.done.errors:
            logger.error("ema-ckpt: a fold failed: %s", message)
        logger.info("ema-ckpt: the EMA at %s is at step %s", self.out, self.done.step)
        return self.done

    def _waiting(self) -> bool:
        """Staged checkpoints are left (a worker's last pass came before their save)."""
        incoming = incoming_dir(self.folder)
        return incoming.is_dir() and any(not p.name.startswith(".") for p in incoming.iterdir())

    def _start(self, idle: float = WORKER_IDLE_SECONDS) -> None:
        job = {"folder": str(self.folder), "out": self.out, "options": self.options, "idle": idle,
               "ignore": self.ignore}
        env = {k: v for k, v in os.environ.items()
               if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "ema_ckpt.integrations._worker", json.dumps(job)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
        self._reader = threading.Thread(target=self._read, args=(self._process,), daemon=True,
                                        name="ema-ckpt-fold-reader")
        self._reader.start()

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join()
            self._reader = None
            self._process = None

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None and process.stderr is not None
        said = False
        for line in process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "fold":
                self.done.folded.extend(int(s) for s in event["steps"])
                self.done.step = event["step"]
                logger.info("ema-ckpt: folded step(s) %s into %s", ", ".join(map(str, event["steps"])), self.out)
            elif event.get("event") == "error":
                said = True
                if str(event["message"]) in self.done.errors:  # a checkpoint that stays bad: said once
                    continue
                self.done.errors.append(str(event["message"]))
                logger.warning("ema-ckpt: a fold failed (training goes on): %s", event["message"])
            elif event.get("event") == "stopped":
                self.done.step = event.get("step", self.done.step)
        stderr = process.stderr.read()
        stopped = self._stopping and process.wait() == -signal.SIGTERM  # killed as Python started, before its handler
        if process.wait() != 0 and not said and not stopped:
            last = (stderr.strip().splitlines() or ["the fold worker exited with " + str(process.returncode)])[-1]
            self.done.errors.append(last)
            logger.warning("ema-ckpt: a fold failed (training goes on): %s", last)


__all__ = ["BackgroundFolds", "FoldsDone"]
