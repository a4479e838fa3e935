"""The output lock: removed when a run ends, however it ends, and never held by two runs at once.

The holder unlinks ``.<name>.lock`` before unlocking; a run that wins ``flock`` on a file the
path no longer names starts over. These tests use real processes racing on one output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.errors import OutputError, OutputLockedError
from ema_ckpt.storage.local_publish import OutputLock
from tests.dcp_helpers import write_dcp
from tests.waiting import holds_open, wait_for

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def _seq(root: Path, steps=(10, 20)) -> Path:
    for step in steps:
        write_dcp(root / f"step_{step}", {"model.w": torch.full((6, 3), float(step))}, world_size=2)
    return root


def _locks(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".lock"))


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True, **kwargs)


def test_the_lock_file_is_gone_after_a_run_that_wrote(tmp_path):
    ck = _seq(tmp_path / "ck")
    assert runner.invoke(app, ["accumulate", str(ck), "--decay", "0.9", "--quiet"]).exit_code == 0
    single = runner.invoke(app, ["consolidate", str(ck / "ema"), "--out", str(tmp_path / "ema.safetensors")])
    assert single.exit_code == 0, single.output
    posthoc = runner.invoke(app, ["posthoc", str(ck), "--sigma-rel", "0.1", "--out", str(tmp_path / "ph")])
    assert posthoc.exit_code == 0, posthoc.output
    assert _locks(ck) == [] and _locks(tmp_path) == []
    again = runner.invoke(app, ["accumulate", str(ck), "--decay", "0.9"])  # nothing new: no output written
    assert again.exit_code == 0 and "up to date" in again.stdout
    assert _locks(ck) == []


def test_the_lock_file_is_gone_after_a_run_that_failed(tmp_path):
    ck = _seq(tmp_path / "ck")
    out = tmp_path / "ema.safetensors"
    assert runner.invoke(app, ["consolidate", str(ck / "step_20"), "--out", str(out)]).exit_code == 0
    exists = runner.invoke(app, ["consolidate", str(ck / "step_20"), "--out", str(out)])
    assert exists.exit_code == 2 and "--overwrite" in exists.stderr
    (ck / "step_20" / "__1_0.distcp").write_bytes(b"not a record")
    damaged = runner.invoke(app, ["accumulate", str(ck), "--decay", "0.9"])
    assert damaged.exit_code == 3, damaged.output
    assert _locks(ck) == [] and _locks(tmp_path) == []
    with pytest.raises(RuntimeError), OutputLock(tmp_path / "x"):
        assert _locks(tmp_path) == [".x.lock"]
        raise RuntimeError("the run failed")
    assert _locks(tmp_path) == []


def test_a_lock_file_left_by_a_killed_run_is_taken_over_and_removed(tmp_path):
    holder = _python("import sys, time\nfrom pathlib import Path\n"
                     "from ema_ckpt.storage.local_publish import OutputLock\n"
                     "lock = OutputLock(Path(sys.argv[1])).__enter__()\nprint('held', flush=True)\ntime.sleep(60)\n",
                     str(tmp_path / "ema"), stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    assert _locks(tmp_path) == [".ema.lock"]  # kill -9: the file stays, the kernel dropped the flock
    with OutputLock(tmp_path / "ema"):
        pass
    assert _locks(tmp_path) == []


# Each racer takes the lock ROUNDS times; inside, a file created with O_EXCL and a counter
# updated by read-modify-write show at once if two processes ever hold it together.
RACER = """
import os, sys
from pathlib import Path
from ema_ckpt.storage.local_publish import OutputLock
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
inside, counter = out.parent / "inside", out.parent / "counter"
start = out.parent / "start"
while not start.exists():
    pass
for _ in range(rounds):
    with OutputLock(out, wait_seconds=120):
        os.close(os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # FileExistsError: two holders
        value = int(counter.read_text())
        counter.write_text(str(value + 1))
        os.unlink(inside)
"""


def test_racing_processes_never_hold_the_lock_together(tmp_path):
    racers, rounds = 4, 300
    (tmp_path / "counter").write_text("0")
    procs = [_python(RACER, str(tmp_path / "ema"), str(rounds), stderr=subprocess.PIPE) for _ in range(racers)]
    (tmp_path / "start").touch()
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    assert int((tmp_path / "counter").read_text()) == racers * rounds
    assert _locks(tmp_path) == []


def test_a_waiting_run_gets_the_lock_after_the_holder_removed_the_file(tmp_path):
    out = tmp_path / "ema"
    hold = ("import sys\nfrom pathlib import Path\nfrom ema_ckpt.storage.local_publish import OutputLock\n"
            "with OutputLock(Path(sys.argv[1]), wait_seconds=float(sys.argv[2])):\n"
            "    print('held', flush=True)\n    sys.stdin.readline()\n")
    holder = _python(hold, str(out), "0", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "held"
    waiter = _python(hold, str(out), "120", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    lock_file = tmp_path / ".ema.lock"
    wait_for(lambda: holds_open(waiter.pid, lock_file) or waiter.poll() is not None,
             what="the waiter to open the lock file")
    assert waiter.poll() is None  # waiting on the file the holder locked
    holder.stdin.write("release\n")
    holder.stdin.flush()
    assert holder.wait(timeout=30) == 0
    assert waiter.stdout.readline().strip() == "held"
    # the holder removed its file; the waiter holds the one the path names now
    assert _locks(tmp_path) == [".ema.lock"]
    with pytest.raises(OutputLockedError, match="another ema-ckpt run"), OutputLock(out):
        pass
    waiter.stdin.write("release\n")
    waiter.stdin.flush()
    assert waiter.wait(timeout=30) == 0
    assert _locks(tmp_path) == []


def test_a_foreign_file_in_place_of_the_lock_is_refused(tmp_path):
    (tmp_path / ".ema.lock").mkdir()
    with pytest.raises(OutputError, match="lock file"), OutputLock(tmp_path / "ema"):
        pass
    assert (tmp_path / ".ema.lock").is_dir()  # never removed: it is not ours
