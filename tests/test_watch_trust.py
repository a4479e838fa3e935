"""``ema-ckpt watch`` under hostile conditions: bad options, a trainer that rewrites its one
file in place, a checkpoint name at NAME_MAX, and a cron ``accumulate`` on watch's ``--out``.

Every wait here is for a condition (with a generous deadline), never a fixed sleep.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_bytes

import ema_ckpt
from ema_ckpt import staging, watching
from ema_ckpt.errors import OptionError
from ema_ckpt.watching import INCOMING, stage, staged_record
from tests.ema_reference import assert_close_relative, reference_ema
from tests.test_watch import DECAY, _assert_ema, _ema, _save, _state
from tests.waiting import DEADLINE, wait_for

CLI = str(Path(sys.executable).with_name("ema-ckpt"))


def _cli(*args: str, timeout: float = DEADLINE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout)


# ---- 1. options checked before anything is watched ----------------------------------------------


@pytest.mark.parametrize("bad", [["--decay", "nan"], ["--decay", "1.0"], ["--sigma-rel", "0.5"],
                                 ["--half-life", "0"]], ids=["decay-nan", "decay-1", "sigma-rel-0.5", "half-life-0"])
def test_watch_refuses_a_bad_option_before_watching(tmp_path, bad):
    folder = tmp_path / "run"
    _save(folder, 1)
    done = _cli("watch", str(folder), *bad, "--interval", "0.1", timeout=60)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and bad[0] in done.stderr
    assert not (folder / INCOMING).exists() and not (folder / "ema").exists()  # nothing staged nor folded


def test_the_library_watch_raises_option_error_before_the_first_look(tmp_path):
    folder = tmp_path / "run"
    _save(folder, 1)
    with pytest.raises(OptionError):
        ema_ckpt.watch(folder, decay=float("nan"), stop_when_idle=0, on_error=lambda message: None)
    assert not (folder / INCOMING).exists()


@pytest.mark.parametrize("bad", [{"decay": float("nan")}, {"decay": 1.0}, {"sigma_rel": 0.5}])
def test_callbacks_refuse_a_bad_profile_at_construction(tmp_path, bad):
    from ema_ckpt.integrations._lightning_core import LightningEmaCore

    with pytest.raises(OptionError):
        LightningEmaCore(tmp_path / "ema", **bad)
    transformers = pytest.importorskip("ema_ckpt.integrations.transformers", exc_type=ImportError)
    with pytest.raises(OptionError):
        transformers.EmaCkptCallback(tmp_path / "ema", **bad)


# ---- 2. a staged copy never shares storage the trainer writes into -----------------------------


def _nanogpt_bytes(step: int) -> bytes:
    data = io.BytesIO()
    torch.save({"model": _state(step), "model_args": {"n_layer": 1}, "iter_num": step}, data)
    return data.getvalue()


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Write ``data`` over ``path`` as ``torch.save(obj, path)`` does: the same inode, truncated
    and written again; done again until the file's identity changed (a coarse clock)."""
    before = os.stat(path) if path.exists() else None
    while True:
        with open(path, "r+b" if path.exists() else "wb") as file:
            file.truncate(0)
            file.write(data)
        after = os.stat(path)
        if before is None or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            assert before is None or after.st_ino == before.st_ino
            return
        time.sleep(0.001)


def test_a_file_rewritten_in_place_while_a_fold_is_slow_loses_no_step(tmp_path, monkeypatch):
    """nanoGPT's loop: one ``ckpt.pt`` written over in place (same inode) at each save, while each
    fold waits until the trainer has written over the file again. Every staged step is folded
    (the staged copy is the trainer's no longer), none silently dropped."""
    from ema_ckpt.commands import accumulate as accumulate_module

    folder = tmp_path / "run"
    folder.mkdir()
    ckpt = folder / "ckpt.pt"
    steps = [1, 2, 3, 4, 5]
    staged_steps: list[int] = []
    rewrites = [0]
    trainer_done = threading.Event()
    real_stage, real_accumulate = watching.stage, accumulate_module.accumulate

    def recording_stage(checkpoint, incoming, **options):
        path = real_stage(checkpoint, incoming, **options)
        staged_steps.append(torch.load(path, weights_only=True)["iter_num"])  # the step staged: its bytes
        return path

    def slow_accumulate(*args, **kwargs):
        started = rewrites[0]
        wait_for(lambda: rewrites[0] > started or trainer_done.is_set(), what="the trainer to write over ckpt.pt",
                 every=0.01)
        return real_accumulate(*args, **kwargs)

    monkeypatch.setattr(watching, "stage", recording_stage)
    monkeypatch.setattr(accumulate_module, "accumulate", slow_accumulate)

    def trainer() -> None:
        try:
            for step in steps:
                _rewrite_in_place(ckpt, _nanogpt_bytes(step))
                rewrites[0] += 1
                wait_for(lambda step=step: step in staged_steps, what=f"step {step} to be staged", every=0.01)
        finally:
            trainer_done.set()

    stop = threading.Event()
    errors: list[str] = []
    folds = []

    def on_fold(fold) -> None:
        folds.append(fold)
        if fold.step == steps[-1]:
            stop.set()

    saver = threading.Thread(target=trainer)
    watchdog = threading.Timer(DEADLINE, stop.set)
    watchdog.start()
    saver.start()
    try:
        result = ema_ckpt.watch(folder, out=tmp_path / "ema", decay=DECAY, interval=0.05, stop=stop,
                                on_fold=on_fold, on_error=errors.append, use_inotify=False)
    finally:
        watchdog.cancel()
        trainer_done.set()
        saver.join()
    folded = [s for fold in folds for s in fold.steps]
    assert result.stopped == "stop" and result.step == steps[-1], (errors, folded)
    assert sorted(set(staged_steps)) == steps
    assert folded == steps and result.lost == [] and errors == []  # every staged step folded
    got = _ema(tmp_path / "ema")
    want = reference_ema([_state(s) for s in folded], folded, lambda prev, step: DECAY ** (step - prev))
    for key, value in want.items():
        assert_close_relative(got[key].double(), value)


@pytest.mark.fast
def test_a_single_file_is_staged_as_a_copy_never_a_link(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    ckpt = folder / "ckpt.pt"
    _rewrite_in_place(ckpt, _nanogpt_bytes(1))
    staged = stage(ckpt, folder / INCOMING, step=1)
    assert os.stat(staged).st_ino != os.stat(ckpt).st_ino
    _rewrite_in_place(ckpt, _nanogpt_bytes(2))
    assert torch.load(staged, weights_only=True)["iter_num"] == 1  # the staged step kept its bytes
    again = stage(ckpt, folder / INCOMING, step=2)  # the new bytes staged beside the old
    assert again != staged and torch.load(again, weights_only=True)["iter_num"] == 2
    assert staged_record(folder / INCOMING, again.name)["name"] == "ckpt.pt"


def test_a_staged_step_rewritten_before_its_fold_is_reported_lost_and_exits_3(tmp_path, monkeypatch):
    """A folder's files are hard links (where no reflink): a trainer rewriting one in place
    changes the staged copy. The fold sees it, says the step is lost, and the watch exits 3."""
    folder = tmp_path / "run"
    ckpt = _save(folder, 1)
    monkeypatch.setattr(staging, "_clone", lambda src, dst: False)  # no reflink: hard links
    staged = stage(ckpt, folder / INCOMING, step=1)
    weights = ckpt / "model.safetensors"
    assert os.stat(staged / "model.safetensors").st_ino == os.stat(weights).st_ino
    _rewrite_in_place(weights, save_bytes(_state(7)))
    done = _cli("watch", str(folder), "--out", str(tmp_path / "ema"), "--decay", str(DECAY), "--interval", "0.1",
                "--stop-when-idle", "0", "--json")
    assert done.returncode == 3, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    errors = [e["message"] for e in events if e["event"] == "error"]
    assert any(m.startswith("step 1 was rewritten before it was folded: lost") for m in errors), events
    assert events[-1]["event"] == "stopped" and events[-1]["lost"] == [1]


# ---- 3. staging names fit NAME_MAX -------------------------------------------------------------


def test_a_checkpoint_named_with_250_bytes_is_staged_and_folded(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    name = "n" * 247 + ".pt"  # the step is in the file (nanoGPT's iter_num)
    assert len(name.encode()) == 250
    (folder / name).write_bytes(_nanogpt_bytes(1))
    direct = ema_ckpt.accumulate(folder, out=tmp_path / "direct", decay=DECAY)  # accumulate accepts it
    assert direct.step == 1
    result = ema_ckpt.watch(folder, out=tmp_path / "ema", decay=DECAY, interval=0.1, stop_when_idle=0)
    assert result.errors == [] and result.staged == 1 and [f.steps for f in result.folds] == [[1]]
    _assert_ema(tmp_path / "ema", [1])


@pytest.mark.fast
def test_a_long_name_written_again_is_staged_under_a_short_name_that_keeps_the_original(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    name = "c" * 247 + ".pt"
    ckpt = folder / name
    _rewrite_in_place(ckpt, _nanogpt_bytes(1))
    first = stage(ckpt, folder / INCOMING, step=1)
    _rewrite_in_place(ckpt, _nanogpt_bytes(2))
    second = stage(ckpt, folder / INCOMING, step=2)
    assert first.name == name and second != first and len(second.name.encode()) <= 255
    assert staged_record(folder / INCOMING, second.name)["name"] == name


# ---- 4. watch and a cron accumulate on one --out -----------------------------------------------


def _watch_with_retention(folder: Path, out: Path) -> None:
    """watch folds steps 1..4 while retention keeps the newest two checkpoints."""
    for batch in ([1, 2], [3, 4]):
        for step in batch:
            _save(folder, step)
        for old in sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
            import shutil

            shutil.rmtree(old)
        ema_ckpt.watch(folder, out=out, decay=DECAY, interval=0.1, stop_when_idle=0)
    assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


def test_a_cron_accumulate_after_watch_folded_everything_exits_0_nothing_new(tmp_path):
    folder, out = tmp_path / "run", tmp_path / "ema"
    _watch_with_retention(folder, out)
    manifest = json.loads((out / "ema-ckpt.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == [1, 2, 3, 4]
    done = _cli("accumulate", str(folder), "--out", str(out), "--decay", str(DECAY))
    assert done.returncode == 0, done.stderr
    assert "nothing new" in (done.stdout + done.stderr).lower()
    _assert_ema(out, [1, 2, 3, 4])


def test_a_refusal_never_offers_a_restart_that_would_lose_folded_steps(tmp_path):
    """A checkpoint at a folded step that was never folded (another run's) is refused; since
    steps 1 and 2 are gone from disk, the message says rebuilding would lose them."""
    folder, out = tmp_path / "run", tmp_path / "ema"
    _watch_with_retention(folder, out)
    other = tmp_path / "other"
    _save(other, 2)
    os.replace(other / "checkpoint-2", folder / "checkpoint-2")
    done = _cli("accumulate", str(folder), "--out", str(out), "--decay", str(DECAY))
    assert done.returncode == 4, done.stderr
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1
    assert "would lose the 2 folded step(s) whose checkpoints are gone (steps 1, 2)" in line
    assert "pass --restart" not in line
