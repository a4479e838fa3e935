"""``ema-ckpt watch`` / :func:`ema_ckpt.watch` beside a saving loop that keeps few checkpoints.

A thread (or a process) saves safetensors checkpoints as the Hugging Face Trainer lays them
out (``checkpoint-<step>/model.safetensors``), writing each one under a temporary name and
renaming it into place, and deletes all but the newest ``keep``. The EMA must hold every
saved step and equal a float64 EMA of the states as they were saved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ema_ckpt
from ema_ckpt.watching import INCOMING, stage
from tests.ema_reference import assert_close_relative, reference_ema
from tests.waiting import wait_for

DECAY = 0.9


def _state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=generator), "b": torch.randn(16, generator=generator)}


def _save(folder: Path, step: int) -> Path:
    tmp = folder / f".tmp-checkpoint-{step}"
    tmp.mkdir(parents=True)
    save_file(_state(step), tmp / "model.safetensors")
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    final = folder / f"checkpoint-{step}"
    os.replace(tmp, final)
    return final


def saving_loop(folder: Path, steps: list[int], every: float, keep: int, seen: Callable[[str], bool] | None = None,
                ) -> None:
    """Save each step ``every`` seconds apart, keeping the newest ``keep`` checkpoints.

    ``seen``: delete an old checkpoint only once it holds for it (the watcher staged it); the
    lifetime the watcher needs is then counted in its scans, not in seconds a loaded machine
    may not give it.
    """
    for step in steps:
        _save(folder, step)
        saved = sorted((p for p in folder.glob("checkpoint-*")), key=lambda p: int(p.name.split("-")[1]))
        for old in saved[:-keep]:
            if seen is not None:
                wait_for(lambda name=old.name: seen(name), what=f"the watcher to stage {old.name}")
            shutil.rmtree(old)
        time.sleep(every)


def staged_or_folded(folder: Path, out: Path) -> Callable[[str], bool]:
    """``seen`` for :func:`saving_loop` when the watcher is another process: the checkpoint is
    staged in the folder's staging area, or the EMA's manifest at ``out`` lists its step."""

    def seen(name: str) -> bool:
        if (folder / INCOMING / name).exists():
            return True
        try:
            manifest = json.loads((out / "ema-ckpt.json").read_text())
        except (OSError, ValueError):
            return False
        return int(name.split("-")[1]) in [c["step"] for c in manifest["checkpoints"]]

    return seen


def _expected(steps: list[int]) -> dict[str, torch.Tensor]:
    return reference_ema([_state(s) for s in steps], steps, lambda prev, step: DECAY ** (step - prev))


def _ema(out: Path) -> dict[str, torch.Tensor]:
    converted = out.parent / "ema.safetensors"
    ema_ckpt.consolidate(out, converted, overwrite=True)
    return load_file(converted)


def _assert_ema(out: Path, steps: list[int]) -> None:
    got, want = _ema(out), _expected(steps)
    for key, value in want.items():
        assert_close_relative(got[key].double(), value)


@pytest.mark.parametrize("use_inotify", [True, False], ids=["inotify", "polling"])
def test_every_checkpoint_that_lives_an_interval_is_folded_with_retention_of_one(tmp_path, use_inotify):
    folder = tmp_path / "run"
    folder.mkdir()
    steps = [10, 20, 30, 40, 50, 60]
    folds = []

    def staged(name: str) -> bool:  # staged aside, or folded already
        step = int(name.split("-")[1])
        return (folder / INCOMING / name).exists() or any(step in fold.steps for fold in list(folds))

    saver = threading.Thread(target=saving_loop, args=(folder, steps, 0.6, 1, staged))
    saver.start()
    result = ema_ckpt.watch(folder, out=tmp_path / "ema", decay=DECAY, interval=0.5, stop_when_idle=3.0,
                            on_fold=folds.append, use_inotify=use_inotify)
    saver.join()
    assert result.stopped == "idle" and result.step == 60 and result.errors == []
    assert sorted(s for fold in folds for s in fold.steps) == steps
    _assert_ema(tmp_path / "ema", steps)
    assert not [p for p in (folder / INCOMING).iterdir() if not p.name.startswith(".")]  # folded, then removed
    manifest = json.loads((tmp_path / "ema" / "ema-ckpt.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == steps


def test_a_stop_request_ends_after_the_fold_in_progress_and_a_rerun_continues(tmp_path):
    folder = tmp_path / "run"
    for step in (1, 2, 3):
        _save(folder, step)
    stop = threading.Event()
    folds = []

    def fold_then_stop(fold) -> None:
        folds.append(fold)
        stop.set()

    result = ema_ckpt.watch(folder, out=tmp_path / "ema", decay=DECAY, interval=0.2, stop=stop,
                            on_fold=fold_then_stop)
    assert result.stopped == "stop" and result.step == 3 and len(folds) == 1
    _save(folder, 4)
    again = ema_ckpt.watch(folder, out=tmp_path / "ema", decay=DECAY, interval=0.2, stop_when_idle=0)
    assert again.step == 4 and [f.steps for f in again.folds] == [[4]]
    _assert_ema(tmp_path / "ema", [1, 2, 3, 4])


def test_a_damaged_checkpoint_is_reported_and_the_watch_goes_on(tmp_path):
    folder = tmp_path / "run"
    _save(folder, 1)
    bad = _save(folder, 2)
    data = bytearray((bad / "model.safetensors").read_bytes())
    (bad / "model.safetensors").write_bytes(bytes(data[:40]))  # a torn file
    errors: list[str] = []
    result = ema_ckpt.watch(folder, out=tmp_path / "ema", decay=DECAY, interval=0.2, stop_when_idle=0,
                            on_error=errors.append)
    assert errors and "checkpoint-2" in errors[0] and len(errors[0].splitlines()) == 1
    assert result.errors == errors
    skipping = ema_ckpt.watch(folder, out=tmp_path / "ema2", decay=DECAY, interval=0.2, stop_when_idle=0,
                              skip_damaged=True)
    assert skipping.step == 1 and skipping.errors == []  # the damaged one skipped, and recorded
    skipped = json.loads((tmp_path / "ema2" / "ema-ckpt.json").read_text())["skipped"]
    assert [entry["step"] for entry in skipped] == [2]


@pytest.mark.fast
def test_staging_links_the_files_and_survives_the_originals_deletion(tmp_path):
    ckpt = _save(tmp_path / "run", 5)
    staged = stage(ckpt, tmp_path / "run" / INCOMING)
    assert os.stat(staged / "model.safetensors").st_ino == os.stat(ckpt / "model.safetensors").st_ino
    shutil.rmtree(ckpt)
    assert torch.equal(load_file(staged / "model.safetensors")["w"], _state(5)["w"])
    assert stage(tmp_path / "run" / INCOMING / "checkpoint-5", tmp_path / "run" / INCOMING) == staged


SAVER = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from tests.test_watch import saving_loop, staged_or_folded
folder = Path({folder!r})
saving_loop(folder, list(range(100, 100 + 100 * {count}, 100)), {every}, 2, staged_or_folded(folder, Path({out!r})))
"""


def test_the_sidecar_folds_beside_a_saving_process_and_sigterm_exits_0(tmp_path):
    """``ema-ckpt watch --json`` beside a process that saves every 0.8 s and keeps 2 checkpoints
    (an old one is deleted once the watcher staged it: the watcher, a process that imports torch,
    may take longer than a save interval to start on a loaded machine); SIGTERM after the saver
    is done: the fold in progress finishes, exit 0."""
    folder = tmp_path / "run"
    folder.mkdir()
    root = str(Path(__file__).resolve().parents[1])
    saver = subprocess.Popen([sys.executable, "-c", SAVER.format(root=root, folder=str(folder), count=5, every=0.8,
                                                                 out=str(tmp_path / "ema"))])
    watcher = subprocess.Popen(
        [str(Path(sys.executable).with_name("ema-ckpt")), "watch", str(folder), "--out", str(tmp_path / "ema"),
         "--decay", str(DECAY), "--interval", "0.5", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert saver.wait(timeout=300) == 0
        manifest = tmp_path / "ema" / "ema-ckpt.json"
        wait_for(lambda: manifest.exists() and json.loads(manifest.read_text())["step"] == 500,
                 what="step 500 to be folded")
        watcher.send_signal(signal.SIGTERM)
        stdout, stderr = watcher.communicate(timeout=60)
    finally:
        saver.kill()
        watcher.kill()
    assert watcher.returncode == 0, stderr
    events = [json.loads(line) for line in stdout.splitlines()]
    assert events[-1]["event"] == "stopped" and events[-1]["why"] == "signal" and events[-1]["step"] == 500
    folded = [s for e in events if e["event"] == "fold" for s in e["steps"]]
    assert folded == [100, 200, 300, 400, 500]
    _assert_ema(tmp_path / "ema", folded)


def test_checkpoints_rewritten_in_place_are_never_staged(tmp_path):
    """A file the trainer writes again under one name (Lightning's ``last.ckpt``) would change
    under its hard link: ``ignore`` leaves it out of staging (the callback stages copies)."""
    from ema_ckpt.watching import stage_new

    ckpts = tmp_path / "ckpts"
    first, second = _save(ckpts, 1), _save(ckpts, 2)
    staged = stage_new(ckpts, ignore=[second])
    assert [p.name for p in staged] == [first.name]
    assert sorted(p.name for p in (ckpts / INCOMING).iterdir()) == [first.name]


def test_a_look_at_the_folder_that_fails_is_said_once_and_tried_again(tmp_path, monkeypatch):
    """The scanning thread's failures (here: the staging folder turned into a file) reach
    ``on_error`` once each, and the watch goes on to fold what is saved once looks work again."""
    from ema_ckpt import watching

    folder = tmp_path / "run"
    _save(folder, 1)
    incoming = folder / INCOMING
    errors: list[str] = []
    looks = [0]
    real_stage_new = watching.stage_new

    def counting_stage_new(*args, **kwargs):
        try:
            return real_stage_new(*args, **kwargs)
        finally:
            looks[0] += 1

    monkeypatch.setattr(watching, "stage_new", counting_stage_new)

    def mend_later() -> None:
        _save(folder, 2)  # not staged while the staging folder is a file
        broken_from = looks[0]
        try:  # several looks fail (each the same error) before the folder is mended, well within the idle time
            wait_for(lambda: looks[0] >= broken_from + 3, what="three looks at the broken folder")
        finally:
            incoming.unlink()

    mender = threading.Thread(target=mend_later)

    def break_staging(fold) -> None:
        if not mender.is_alive() and fold.step == 1:
            shutil.rmtree(incoming)
            incoming.write_text("not a folder")
            mender.start()

    result = ema_ckpt.watch(folder, out=tmp_path / "ema", decay=DECAY, interval=0.1, stop_when_idle=2.5,
                            on_fold=break_staging, on_error=errors.append, use_inotify=False)
    mender.join()
    assert len(errors) == 1 and errors[0].startswith(f"looking for new checkpoints in {folder} failed (")
    assert len(errors[0].splitlines()) == 1 and result.errors == errors
    assert result.step == 2 and [f.steps for f in result.folds] == [[1], [2]]
    _assert_ema(tmp_path / "ema", [1, 2])


@pytest.mark.fast
def test_a_checkpoint_that_cannot_be_staged_does_not_hold_up_the_others(tmp_path, monkeypatch):
    from ema_ckpt import watching

    ckpts = tmp_path / "ckpts"
    for step in (1, 2, 3):
        _save(ckpts, step)
    real_stage = watching.stage

    def refusing(checkpoint, incoming, **options):
        if Path(str(checkpoint)).name == "checkpoint-2":
            raise PermissionError(13, "Permission denied", str(checkpoint))
        return real_stage(checkpoint, incoming, **options)

    monkeypatch.setattr(watching, "stage", refusing)
    failed = []
    staged = watching.stage_new(ckpts, on_failure=lambda path, err: failed.append((path.name, err.errno)))
    assert [p.name for p in staged] == ["checkpoint-1", "checkpoint-3"] and failed == [("checkpoint-2", 13)]
    shutil.rmtree(ckpts / INCOMING)
    with pytest.raises(PermissionError):
        watching.stage_new(ckpts)  # without on_failure: raised once the others are staged
    assert sorted(p.name for p in (ckpts / INCOMING).iterdir()) == ["checkpoint-1", "checkpoint-3"]


@pytest.mark.parametrize("refusals", [1, None], ids=["staged-at-the-next-look", "never-staged"])
def test_a_checkpoint_never_staged_is_no_exit_0(tmp_path, monkeypatch, refusals):
    """A checkpoint refused at a look is tried again at the next; one no look stages (never
    folded: refused each time, or passed by a newer step) is in ``result.unstaged``, and the CLI
    exits 3."""
    from ema_ckpt import watching
    from ema_ckpt.cli import run

    folder = tmp_path / "run"
    steps = (1, 2) if refusals else (1, 2, 3)  # once: nothing newer, so the EMA never passes step 2 first
    for step in steps:
        _save(folder, step)
    real_stage, refused = watching.stage, []

    def refusing(checkpoint, incoming, **options):
        if Path(str(checkpoint)).name == "checkpoint-2" and (refusals is None or len(refused) < refusals):
            refused.append(checkpoint)
            raise PermissionError(13, "Permission denied", str(checkpoint))
        return real_stage(checkpoint, incoming, **options)

    monkeypatch.setattr(watching, "stage", refusing)
    errors: list[str] = []
    result = ema_ckpt.watch(folder, out=tmp_path / "ema", decay=DECAY, interval=0.1, stop_when_idle=1.0,
                            on_error=errors.append, use_inotify=False)
    assert refused and any("checkpoint-2 could not be staged" in e for e in errors)
    if refusals is None:
        assert result.unstaged == [str(folder / "checkpoint-2")] and result.step == 3
        assert 2 not in [s for f in result.folds for s in f.steps]
    else:
        assert result.unstaged == [] and sorted(s for f in result.folds for s in f.steps) == [1, 2]
    refused.clear()
    code = run(["watch", str(folder), "--out", str(tmp_path / "ema-cli"), "--decay", str(DECAY), "--interval",
                "0.1", "--stop-when-idle", "1", "--no-inotify", "--quiet"])
    assert code == (3 if refusals is None else 0)
