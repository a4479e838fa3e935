"""Fold each checkpoint as soon as it is complete: the loop behind ``ema-ckpt watch`` and the
training callbacks.

A trainer with tight retention (``save_total_limit=1``) deletes each checkpoint one save
interval after writing it. So a scanner, every interval (at once on an inotify event) whatever
the folds are doing, *stages* each complete checkpoint (:mod:`ema_ckpt.staging`) into
``CKPTS/.ema-ckpt-incoming/``, which retention never touches; on object storage it polls and
downloads each into a local temporary folder instead. The folds take the staged checkpoints in
step order with :func:`~ema_ckpt.accumulate`, and a staged checkpoint goes once the EMA holds it.

Example:
    >>> result = watch("ckpts", out="ckpts/ema", decay=0.999, stop_when_idle=600)   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._inotify import Watcher
from .discovery import Discovery, discover
from .errors import CheckpointError, CheckpointNotFoundError, EmaCkptError, OptionError, UsageError, one_line
from .manifest import Manifest
from .staging import (
    INCOMING,
    file_identity,
    incoming_dir,
    record_path,
    records_dir,
    remove_staged,
    rewritten_since_staged,
    stage,
    staged_record,
    staged_target,
)
from .storage import Location, as_path, local_file

if TYPE_CHECKING:
    from .commands.accumulate import AccumulateOptions


@dataclass(frozen=True, slots=True)
class WatchFold:
    """One fold of :func:`watch`: the steps it folded into the EMA at ``out``."""

    out: str
    steps: list[int]
    step: int
    seconds: float
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class WatchResult:
    """What a :func:`watch` did before it stopped (``stopped``: ``"signal"``, ``"idle"``, ``"stop"``)."""

    out: Location
    folds: list[WatchFold] = field(default_factory=list)
    step: int | None = None
    stopped: str = ""
    staged: int = 0
    errors: list[str] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    """Steps whose staged copy changed before it was folded (-1: not known): never folded."""
    unstaged: list[str] = field(default_factory=list)
    """Checkpoints a look could not stage and no later look staged: never folded."""


def ema_step(out: str | Location) -> int | None:
    """The step the EMA at ``out`` holds (None: no EMA yet)."""
    out = as_path(out)
    manifest = Manifest.read(out, check=False)
    if manifest is not None:
        return manifest.step
    # one EMA per component (or per power profile), each in a folder of OUT: the oldest of them
    manifests = [Manifest.read(d, check=False) for d in _folders(out)]
    steps = [m.step for m in manifests if m is not None and m.kind == "ema"]
    return min(steps) if steps else None


def _folders(out: Location) -> list[Location]:
    try:
        return [d for d in out.iterdir() if d.is_dir() and not d.name.startswith(".")] if out.is_dir() else []
    except OSError:
        return []


def stage_new(folder: str | os.PathLike[str] | Location, *, after: int | Callable[[], int | None] | None = None,
              step_regex: str | None = None, step_from: str | None = None,
              incoming: str | os.PathLike[str] | None = None,
              ignore: Sequence[str | os.PathLike[str] | Location] = (),
              on_failure: Callable[[Location, OSError], None] | None = None) -> list[Path]:
    """Stage every complete checkpoint of ``folder`` newer than step ``after`` (or ``after()``, the
    EMA's step asked as each is looked at), not staged yet and not in ``ignore``, into ``incoming``
    (default :func:`incoming_dir`; required on object storage). A checkpoint that cannot be staged
    goes to ``on_failure``, or without it the first such error is raised once the others are staged."""
    source = as_path(folder)
    if incoming is None:
        local = local_file(source)
        if local is None:
            raise UsageError(f"{source} is in object storage: pass incoming=, a local folder to stage in")
        incoming = incoming_dir(local)
    into = Path(incoming)
    found = _discover_settled(source, step_regex, step_from)
    left_out = {str(as_path(path)) for path in ignore}
    staged = []
    failed: OSError | None = None
    for checkpoint in found.checkpoints:
        entry = checkpoint.entry  # the whole checkpoint (its components, its step records), never one file of it
        if str(entry) in left_out or _is_staged(entry, into):
            continue
        newest = after() if callable(after) else after  # after the look: a fold removes its copies last
        if newest is not None and checkpoint.step <= newest:
            continue
        try:
            staged.append(stage(entry, into, step=checkpoint.step))
        except FileNotFoundError:  # gone before all of it could be staged
            continue
        except OSError as err:
            if on_failure is not None:
                on_failure(entry, err)
            elif failed is None:
                failed = err
    if failed is not None:
        raise failed
    return staged


def _is_staged(entry: Location, into: Path) -> bool:
    """Whether ``entry`` is staged in ``into`` already (a file written again in place since it
    was staged is not: its new bytes are staged beside the old)."""
    local = local_file(entry)
    seen = file_identity(local) if local is not None and local.is_file() else None
    return staged_target(entry.name, into, seen).exists()


def _discover_settled(folder: Location, step_regex: str | None, step_from: str | None = None,
                      attempts: int = 3) -> Discovery:
    """:func:`~ema_ckpt.discovery.discover` of ``folder``, looked at again (from a new listing)
    when a checkpoint went as it was read: retention deleting one must not hide the others."""
    for attempt in range(1, attempts + 1):
        try:
            return discover([folder], step_regex=step_regex, step_from=step_from, all_components=True, require=False)
        except EmaCkptError as err:
            if isinstance(err, CheckpointNotFoundError) or attempt == attempts:
                raise
    raise AssertionError("attempts must be 1 or more")


def _drop_folded(incoming: Path, step: int, step_regex: str | None) -> None:
    if not incoming.is_dir():
        return
    # only the entries' steps are wanted: no copies compared byte for byte (compare=False)
    found = discover([incoming], step_regex=step_regex, all_components=True, require=False, compare=False)
    for entry in found.entries:  # every entry with a step: a copy of a folded one left out counts too
        if entry.step is not None and entry.step <= step:
            _unstage(Path(str(entry.path)))


def _unstage(staged: Path) -> None:
    remove_staged(staged)
    with contextlib.suppress(FileNotFoundError):
        record_path(staged.parent, staged.name).unlink()


def _check_staged(incoming: Path, result: WatchResult, on_error: Callable[[str], None] | None) -> None:
    """Before a fold: drop every staged copy whose bytes changed since they were staged (a
    trainer writing into shared storage), each said as a step lost; without ``on_error``, raise."""
    if not incoming.is_dir():
        return
    for staged in sorted(incoming.iterdir(), key=lambda p: record_path(incoming, p.name)):  # in records' order
        name = staged.name
        record = staged_record(incoming, name)  # none: being staged, or not a staged copy
        if record is None or not rewritten_since_staged(incoming, name):
            continue
        _unstage(staged)
        step = record.get("step")
        what = f"step {step}" if step is not None else "a checkpoint"
        message = (f"{what} was rewritten before it was folded: lost ({record.get('name', name)} changed in "
                   f"{incoming} after it was staged)")
        result.lost.append(step if isinstance(step, int) else -1)
        if on_error is None:
            raise CheckpointError(incoming / name, f"{what} was rewritten before it was folded: lost")
        _say_once(message, result, on_error)


_WATCH_ONLY = {"checkpoints", "out", "interval", "stop_when_idle", "stop", "on_fold", "on_error", "use_inotify",
               "ignore"}


def fold_options(args: dict[str, Any], out: str | Location | None = None) -> AccumulateOptions:
    """:func:`~ema_ckpt.accumulate`'s options ``args`` for folds into ``out``, checked now by its
    own rules (the profile, the dtype, the device, ``out``): a bad one would fail every fold.

    >>> fold_options({"decay": 0.9, "include": ["*.weight"]}).include
    ('*.weight',)
    """
    from .commands.accumulate import AccumulateOptions
    from .options import command_options

    return AccumulateOptions(**command_options({"checkpoints": (), "out": out, **args}))


def watch(checkpoints: str | Location, *, out: str | Location | None = None, interval: float = 30.0,
          stop_when_idle: float | None = None, stop: threading.Event | None = None,
          on_fold: Callable[[WatchFold], None] | None = None, on_error: Callable[[str], None] | None = None,
          use_inotify: bool = True, ignore: Sequence[str | Location] = (),
          decay: float | None = None, half_life: float | None = None, per_checkpoint: bool = False,
          warmup: bool = False, sigma_rels: Sequence[str] = (), gammas: Sequence[str] = (),
          snapshot_every: int | None = None, dtype: str = "float32", include: Sequence[str] = (),
          exclude: Sequence[str] = (), step_regex: str | None = None, step_from: str | None = None,
          component: str | None = None, keep_prefix: bool = False, restart: bool = False,
          allow_new_keys: bool = False, average_buffers: bool = False, skip_nonfinite: bool = False,
          skip_damaged: bool = False, skip: Sequence[str | Location] = (), state_key: str | None = None,
          inert_globals: Sequence[str] = (), workers: int = 1, device: str = "cpu",
          wait_seconds: float = 0.0) -> WatchResult:
    """Fold each checkpoint of the folder ``checkpoints`` into the EMA at ``out`` as soon as it
    is complete, until ``stop`` is set, or until ``stop_when_idle`` seconds pass with nothing
    new (``0``: fold what is there, then return). The other keyword arguments, from ``decay`` on,
    are :func:`~ema_ckpt.accumulate`'s, for every fold.

    Args:
        checkpoints: the folder the trainer saves into (local, or on object storage).
        out: the EMA directory (default ``<checkpoints>/ema``).
        interval: seconds between looks at the folder (a checkpoint that lives this long is
            never missed; on object storage, plus one look at the bucket and its download).
        stop_when_idle: return once this many seconds pass without a new checkpoint.
        stop: set it to stop after the fold in progress (what SIGTERM does to ``ema-ckpt watch``).
        on_fold: called after each fold that folded something.
        on_error: called with the one-line message of a failed fold or look at the folder (the
            loop goes on; each message is said once); without it, the error is raised.
        use_inotify: wake on the folder's changes where the platform has inotify.
        ignore: checkpoints of the folder never staged nor folded: files the trainer writes
            again in place (Lightning's ``last.ckpt``, which its callback stages as copies).

    A staged copy whose bytes changed before it was folded is not folded: it is said as ``step N
    was rewritten before it was folded: lost`` and its step is in ``result.lost``. A checkpoint
    that no look could stage is in ``result.unstaged``.

    Raises:
        OptionError: a bad ``interval`` or ``stop_when_idle``, or an option that
            :func:`~ema_ckpt.accumulate` refuses (checked before anything is watched).

    Example:
        >>> done = watch("ckpts", decay=0.999, stop_when_idle=3600)   # doctest: +SKIP
        >>> done.step, [fold.steps for fold in done.folds]            # doctest: +SKIP
        (5000, [[1000, 2000], [3000], [4000, 5000]])
    """
    fold_args = {name: value for name, value in locals().items() if name not in _WATCH_ONLY}
    if not interval > 0:
        raise OptionError("interval", f"must be a number of seconds above 0, got {interval}", value=interval)
    if stop_when_idle is not None and stop_when_idle < 0:
        raise OptionError("stop_when_idle", f"must be 0 or more seconds, got {stop_when_idle}", value=stop_when_idle)
    folder = as_path(checkpoints)
    target = as_path(out) if out is not None else folder / "ema"
    fold_options(fold_args, target)
    stop = stop or threading.Event()
    result = WatchResult(out=target, step=ema_step(target))
    local = local_file(folder)
    # object storage: each checkpoint is downloaded into a temporary folder, removed at the end
    incoming = incoming_dir(local) if local is not None else Path(tempfile.mkdtemp(prefix="ema-ckpt-incoming-"))
    wake = threading.Event()
    scanner_done = threading.Event()
    failures: list[BaseException] = []  # the scanning thread's, said by the main loop

    unstaged: set[str] = set()  # checkpoints whose last look failed to stage them
    unstaged_lock = threading.Lock()  # the scanner's looks and the main loop's last one

    def scan() -> None:
        failed: set[str] = set()

        def not_staged(checkpoint: Location, err: OSError) -> None:
            failed.add(str(checkpoint))
            failures.append(OSError(f"{checkpoint} could not be staged ({err.strerror or err})"))

        try:
            staged = stage_new(folder, after=lambda: result.step, step_regex=step_regex, step_from=step_from,
                               incoming=incoming, ignore=ignore, on_failure=not_staged)
        except CheckpointNotFoundError:
            return
        with unstaged_lock:  # one this look staged is no longer missing (one passed over for the EMA's step is)
            unstaged.difference_update({c for c in unstaged - failed if _is_staged(as_path(c), incoming)})
            unstaged.update(failed)
        result.staged += len(staged)
        if staged:
            wake.set()

    def scanner() -> None:
        while not scanner_done.is_set():
            started = time.monotonic()
            try:
                scan()
            except Exception as err:  # a scan that failed is tried again at the next look
                failures.append(err)
            changes.wait(max(0.0, started + interval - time.monotonic()))  # a look every interval

    changes = Watcher(local if use_inotify else None)  # object storage: polled
    thread = threading.Thread(target=scanner, name="ema-ckpt-watch-scanner", daemon=True)
    try:
        scan()  # before the first fold: nothing of what is there now can be missed
        thread.start()
        idle_since = time.monotonic()
        while True:
            staged_before = result.staged
            _check_staged(incoming, result, on_error)
            fold = _fold_once(incoming, target, fold_args, result, on_error)
            if fold is not None:
                idle_since = time.monotonic()
                result.folds.append(fold)
                if on_fold is not None:
                    on_fold(fold)
            if result.step is not None:
                _drop_folded(incoming, result.step, step_regex)
            _say_scan_failures(folder, failures, result, on_error)
            if stop.is_set():
                result.stopped = "signal" if getattr(stop, "signalled", False) else "stop"
                break
            if stop_when_idle is not None and time.monotonic() - idle_since >= stop_when_idle:
                try:
                    scan()
                except Exception as err:
                    failures.append(err)
                    continue
                if result.staged == staged_before:  # nothing staged since the fold began
                    result.stopped = "idle"
                    break
                continue
            pause = interval if stop_when_idle is None else min(interval, max(0.05, stop_when_idle))
            _wait_any(stop, wake, pause)
            wake.clear()
    finally:
        scanner_done.set()
        changes.interrupt()
        if thread.ident is not None:
            thread.join()
        changes.close()
        if local is None:
            shutil.rmtree(incoming, ignore_errors=True)
            shutil.rmtree(records_dir(incoming), ignore_errors=True)
    _say_scan_failures(folder, failures, result, on_error)  # the scanner's last look
    result.unstaged = sorted(unstaged)
    return result


def _fold_once(source: Path, target: Location, options: dict[str, Any], result: WatchResult,
               on_error: Callable[[str], None] | None) -> WatchFold | None:
    """One :func:`~ema_ckpt.accumulate` over the staged checkpoints in ``source``; the fold it made, if any."""
    from .commands.accumulate import accumulate

    if not source.is_dir() or not any(not p.name.startswith(".") for p in source.iterdir()):
        return None
    started = time.monotonic()
    try:
        done = accumulate(source, out=target, **options)
    except CheckpointNotFoundError:
        return None  # nothing complete yet
    except Exception as err:
        if on_error is None:
            raise
        _say_once(one_line(err), result, on_error)
        return None
    result.step = done.step
    if not done.folded:
        return None
    return WatchFold(out=str(done.out), steps=[c.step for c in done.folded], step=done.step,
                     seconds=time.monotonic() - started, notes=list(done.notes))


def _say_once(message: str, result: WatchResult, on_error: Callable[[str], None]) -> None:
    """Record and say ``message`` unless it was said already: a checkpoint that stays bad, or a
    folder that stays unreadable, is said once, not at every pass."""
    if message not in result.errors:
        result.errors.append(message)
        on_error(message)


def _say_scan_failures(folder: Location, failures: list[BaseException], result: WatchResult,
                       on_error: Callable[[str], None] | None) -> None:
    """Say the looks at ``folder`` that failed since the last pass (each is tried again at the
    next look); without ``on_error``, raise the first."""
    while failures:
        err = failures.pop(0)
        if on_error is None:
            raise err
        _say_once(f"looking for new checkpoints in {folder} failed ({one_line(err)}); trying again", result,
                  on_error)


def _wait_any(stop: threading.Event, wake: threading.Event, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not stop.is_set() and not wake.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        wake.wait(min(left, 0.2))


__all__ = ["INCOMING", "WatchFold", "WatchResult", "ema_step", "fold_options", "incoming_dir", "records_dir",
           "rewritten_since_staged", "stage", "stage_new", "staged_record", "watch"]
