"""``ema-ckpt watch s3://…`` beside a saving loop, against moto's S3 server on loopback (the
``s3`` fixture of :mod:`tests.test_object_storage`).

On object storage ``watch`` polls (no inotify) and downloads each complete checkpoint into a
local temporary folder before folding it. The test saves checkpoints as the Hugging Face
Trainer lays them out (``checkpoint-<step>/model.safetensors``, then ``trainer_state.json``,
the file the Trainer writes last), one object after the other as a trainer writing to a bucket
would, and deletes all but the newest few. Every checkpoint must be folded exactly once, in
step order, and the EMA must equal a float64 EMA of the states as saved.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import ema_ckpt
from ema_ckpt.watching import WatchFold
from tests import test_object_storage
from tests.ema_reference import assert_ema_matches, reference_ema
from tests.test_object_storage import BUCKET, download, keys_under
from tests.waiting import wait_for

s3 = test_object_storage.s3  # the moto server (module-scoped fixture)

boto3 = pytest.importorskip("boto3")

DECAY = 0.9
INTERVAL = 0.5
EMA_CKPT = Path(sys.executable).with_name("ema-ckpt")


def _state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=generator), "b": torch.randn(16, generator=generator)}


class Trainer:
    """Saves ``checkpoint-<step>`` under ``s3://ckpts/<prefix>`` every ``every`` seconds, keeping
    the newest ``keep``; records when each checkpoint became complete and when it was deleted.
    ``seen``: an old checkpoint is deleted only once it holds (the watcher staged or folded it)."""

    def __init__(self, prefix: str, every: float, keep: int, seen: Callable[[int], bool] | None = None) -> None:
        self.client = boto3.client("s3")
        self.prefix, self.every, self.keep, self.seen = prefix, every, keep, seen
        self.complete: dict[int, float] = {}
        self.deleted: dict[int, float] = {}

    def save(self, step: int) -> None:
        key = f"{self.prefix}/checkpoint-{step}"
        # the data file first, the file that says the save is finished last (the Trainer's order)
        self.client.put_object(Bucket=BUCKET, Key=f"{key}/model.safetensors", Body=save(_state(step)))
        self.client.put_object(Bucket=BUCKET, Key=f"{key}/trainer_state.json",
                               Body=json.dumps({"global_step": step}).encode())
        self.complete[step] = time.monotonic()
        for old in sorted(self.complete)[:-self.keep]:
            if old not in self.deleted:
                if self.seen is not None:  # a lifetime in the watcher's looks, not in seconds
                    wait_for(lambda old=old: self.seen(old), what=f"the watcher to take checkpoint-{old}")
                self.delete(old)

    def delete(self, step: int) -> None:
        key = f"{self.prefix}/checkpoint-{step}"
        self.client.delete_objects(Bucket=BUCKET, Delete={"Objects": [
            {"Key": f"{key}/trainer_state.json"}, {"Key": f"{key}/model.safetensors"}]})
        self.deleted[step] = time.monotonic()

    def run(self, steps: list[int]) -> None:
        for step in steps:
            self.save(step)
            time.sleep(self.every)

    def lived(self, step: int) -> float:
        return self.deleted.get(step, float("inf")) - self.complete[step]


def _expected(steps: list[int]) -> dict[str, torch.Tensor]:
    return reference_ema([_state(s) for s in steps], steps, lambda prev, step: DECAY ** (step - prev))


def _assert_ema(out: str, steps: list[int], tmp_path: Path) -> None:
    assert_ema_matches(out, _expected(steps), tmp_path)


def _watch(url: str, tmp: Path, *args: str) -> subprocess.Popen[str]:
    """``ema-ckpt watch`` (the installed entry point; the emulator's endpoint and credentials come
    from the environment the ``s3`` fixture set), its temporary files under ``tmp``."""
    tmp.mkdir()
    return subprocess.Popen([str(EMA_CKPT), "watch", url, "--decay", str(DECAY), "--interval", str(INTERVAL),
                             "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(tmp)))


class Events:
    """The JSON lines a watch prints, read as they come."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[dict] = []
        assert process.stdout is not None
        self._thread = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self.lines.append(json.loads(line))

    def folded(self) -> list[int]:
        return [s for e in self.lines if e["event"] == "fold" for s in e["steps"]]

    def wait_for_step(self, step: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while step not in self.folded() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert step in self.folded(), self.lines

    def join(self) -> list[dict]:
        self._thread.join(timeout=30)
        return self.lines


def test_watch_polls_a_bucket_folds_each_checkpoint_once_and_sigterm_exits_0(s3, tmp_path):
    """Saves every 2.5 intervals, 2 kept: each checkpoint lives about 5 intervals (on 2 busy cores
    one look at the bucket, which reads each checkpoint's markers, can take 2 or 3). After the
    last fold one more save, and SIGTERM about an interval later: a fold under way then finishes,
    and the watch exits 0."""
    prefix = f"watch-{uuid.uuid4().hex[:8]}"
    url, out = f"s3://{BUCKET}/{prefix}/ckpts", f"s3://{BUCKET}/{prefix}/ema"
    steps, last = list(range(100, 900, 100)), 900
    reader: Events | None = None

    def seen(step: int) -> bool:  # staged into the watcher's temporary folder, or folded
        staged = any((tmp_path / "tmp").glob(f"ema-ckpt-incoming-*/checkpoint-{step}"))
        return staged or (reader is not None and step in reader.folded())

    trainer = Trainer(f"{prefix}/ckpts", every=2.5 * INTERVAL, keep=2, seen=seen)
    trainer.save(steps[0])  # there before the watch starts
    watcher = _watch(url, tmp_path / "tmp", "--out", out)
    try:
        reader = Events(watcher)
        reader.wait_for_step(steps[0], 120)  # the watch is up (a process that imports torch)
        trainer.run(steps[1:])
        reader.wait_for_step(steps[-1], 120)
        trainer.save(last)
        time.sleep(INTERVAL)
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(timeout=30)
        events = reader.join()
        stderr = watcher.stderr.read() if watcher.stderr else ""
    finally:
        watcher.kill()
    assert watcher.returncode == 0, stderr
    assert events[-1]["event"] == "stopped" and events[-1]["why"] == "signal", events
    assert not [e for e in events if e["event"] == "error"], events
    deleted = sorted(trainer.deleted)
    assert deleted == steps[:-1] and min(trainer.lived(s) for s in deleted) >= INTERVAL  # retention ran
    folded = [s for e in events if e["event"] == "fold" for s in e["steps"]]
    assert folded in (steps, [*steps, last]), folded  # each once, in step order: none missed, none twice
    assert events[-1]["step"] == folded[-1]
    _assert_ema(out, folded, tmp_path)
    # the EMA is whole where it was published: its manifest names every fold, nothing is left
    # half-published in the bucket, and the local folder the checkpoints were staged in is gone
    manifest = json.loads((download(out, tmp_path / "ema") / "ema-ckpt.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == folded
    assert not [k for k in keys_under(out) if k.startswith(".ema-ckpt")], keys_under(out)
    assert not list((tmp_path / "tmp").glob("ema-ckpt-incoming-*"))


def test_checkpoints_saved_and_deleted_during_a_long_fold_are_folded(s3, tmp_path):
    """While a fold runs (here ``on_fold`` holds the loop for 3 saves), the trainer saves 3
    checkpoints and deletes each at the next save (4 intervals later): the scanner looks every
    interval whatever the folds do, and stages each, so none is missed."""
    prefix = f"long-{uuid.uuid4().hex[:8]}"
    trainer = Trainer(f"{prefix}/ckpts", every=4 * INTERVAL, keep=1)
    trainer.save(100)
    stop = threading.Event()
    folded: list[int] = []

    def on_fold(fold: WatchFold) -> None:
        folded.extend(fold.steps)
        if fold.steps == [100]:
            trainer.run([200, 300, 400])
        if 400 in fold.steps:
            stop.set()

    timer = threading.Timer(60, stop.set)  # never a test that hangs: stopped even if 400 is never folded
    timer.start()
    try:
        result = ema_ckpt.watch(f"s3://{BUCKET}/{prefix}/ckpts", out=tmp_path / "ema", decay=DECAY,
                                interval=INTERVAL, stop=stop, on_fold=on_fold)
    finally:
        timer.cancel()
    assert sorted(trainer.deleted) == [100, 200, 300]
    assert folded == [100, 200, 300, 400] and result.errors == [] and result.stopped == "stop", result
    _assert_ema(str(tmp_path / "ema"), folded, tmp_path)


def test_stop_when_idle_ends_the_watch_of_a_bucket_with_exit_0(s3, tmp_path):
    prefix = f"idle-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{prefix}/ckpts"
    trainer = Trainer(f"{prefix}/ckpts", every=0.0, keep=3)
    for step in (1, 2):
        trainer.save(step)
    started = time.monotonic()
    watcher = _watch(url, tmp_path / "tmp", "--out", str(tmp_path / "ema"), "--stop-when-idle", "2")
    stdout, stderr = watcher.communicate(timeout=60)
    took = time.monotonic() - started
    assert watcher.returncode == 0, stderr
    events = [json.loads(line) for line in stdout.splitlines()]
    assert [e["steps"] for e in events if e["event"] == "fold"] == [[1, 2]]
    assert events[-1] == {**events[-1], "event": "stopped", "why": "idle", "step": 2, "folds": 1, "errors": 0}
    assert took < 30, took
    _assert_ema(str(tmp_path / "ema"), [1, 2], tmp_path)
    assert not list((tmp_path / "tmp").glob("ema-ckpt-incoming-*"))
