"""Faults and bad inputs from the issue's list: each gets one clear line, a documented exit code,
and leaves the previous output untouched; kills at any moment of every command lose nothing."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.errors import NonFiniteError
from ema_ckpt.formats.dcp import DcpReader
from ema_ckpt.formats.dcp import writer as dcp_writer
from ema_ckpt.layout import Box
from ema_ckpt.manifest import Manifest
from tests.dcp_helpers import write_dcp
from tests.waiting import holds_open, wait_for

EMA_CKPT = str(Path(sys.executable).with_name("ema-ckpt"))
runner = CliRunner()


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()} \
        if path.exists() else {}


def _seq(root: Path, steps, **extra) -> Path:
    for step in steps:
        tensors = {"model.w": torch.full((6, 4), float(step)), "model.b": torch.full((4,), -float(step)),
                   "model.n": torch.tensor(step)}
        tensors.update({k: v(step) for k, v in extra.items()})
        write_dcp(root / f"step_{step}", tensors, world_size=2)
    return root


def _invoke(*args: str):
    return runner.invoke(app, [*args])


def test_nan_is_refused_naming_the_key_and_skip_records_it(tmp_path):
    ck = _seq(tmp_path / "ck", [1, 2])
    nan = torch.full((6, 4), 3.0)
    nan[2, 1] = float("nan")
    write_dcp(ck / "step_3", {"model.w": nan, "model.b": torch.zeros(4), "model.n": torch.tensor(3)}, world_size=2)
    _seq(ck, [4])
    result = _invoke("accumulate", str(ck), "--decay", "0.5", "--out", str(tmp_path / "ema"))
    assert result.exit_code == 6 and "step_3: key 'model.w' holds NaN or Inf" in result.stderr
    assert not (tmp_path / "ema").exists()
    with pytest.raises(NonFiniteError):
        accumulate(ck, decay=0.5, out=tmp_path / "ema")
    ok = accumulate(ck, decay=0.5, out=tmp_path / "ema", skip_nonfinite=True)
    assert [c.step for c in ok.folded] == [1, 2, 4] and any("skipped" in n for n in ok.notes)
    manifest = Manifest.read(tmp_path / "ema")
    assert [s["step"] for s in manifest.skipped] == [3]
    assert accumulate(ck, decay=0.5, out=tmp_path / "ema", skip_nonfinite=True).up_to_date


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("culprit", "where"), [(0, 0), (1, 2**19 + 3), (2, -1)])
def test_a_nonfinite_value_anywhere_names_its_checkpoint(tmp_path, bad, culprit, where):
    from ema_ckpt.commands.averaging import posthoc

    g = torch.Generator().manual_seed(culprit)
    for i, step in enumerate((10, 20, 30)):
        w = torch.randn(2**20 + 7, generator=g)  # several row blocks
        if i == culprit:
            w[where] = bad
        write_dcp(tmp_path / "ck" / f"step_{step}", {"model.w": w, "model.b": torch.ones(3)}, world_size=2)
    name = f"step_{(10, 20, 30)[culprit]}: key 'model.w' holds NaN or Inf"
    with pytest.raises(NonFiniteError, match=name):
        accumulate(tmp_path / "ck", decay=0.999999, out=tmp_path / "ema")  # weights near 0 still count
    with pytest.raises(NonFiniteError, match=name):
        posthoc(tmp_path / "ck", out=tmp_path / "ph", sigma_rels=["0.05", "0.25"])


def test_keys_added_or_removed_need_allow_new_keys(tmp_path):
    ck = _seq(tmp_path / "ck", [1, 2])
    _seq(ck, [3], **{"model.new": lambda s: torch.full((3,), float(s))})
    result = _invoke("accumulate", str(ck), "--decay", "0.5", "--out", str(tmp_path / "ema"))
    assert result.exit_code == 4 and "'model.new'" in result.stderr and "--allow-new-keys" in result.stderr
    accumulate(ck, decay=0.5, out=tmp_path / "ema", allow_new_keys=True)
    with DcpReader(tmp_path / "ema") as reader:
        assert torch.equal(reader.read("model.new", Box((0,), (3,))), torch.full((3,), 3.0))  # starts at step 3
        w = reader.read("model.w", Box((0, 0), (6, 4)))
    assert torch.equal(w, torch.full((6, 4), 2.25))  # ((1·½ + 2·½)·½ + 3·½), decay ½ per step


def test_steps_going_backwards_are_refused(tmp_path):
    ck = _seq(tmp_path / "ck", [10, 20])
    accumulate(ck, decay=0.9)
    before = _tree(ck / "ema")
    _seq(ck, [15])  # a restarted job writes an older step into the same folder
    result = _invoke("accumulate", str(ck), "--decay", "0.9")
    assert result.exit_code == 4 and "steps went backwards" in result.stderr and "step_15" in result.stderr
    assert _tree(ck / "ema") == before


def test_a_checkpoint_of_a_different_model(tmp_path):
    ck = _seq(tmp_path / "ck", [1])
    write_dcp(ck / "step_2", {"model.w": torch.zeros(5, 4), "model.b": torch.zeros(4), "model.n": torch.tensor(2)})
    result = _invoke("accumulate", str(ck), "--decay", "0.9")
    assert result.exit_code == 4 and "has shape [6, 4]" in result.stderr


def test_disk_full_while_writing_keeps_the_previous_output(tmp_path, monkeypatch):
    ck = _seq(tmp_path / "ck", [1, 2])
    accumulate(ck, decay=0.9)
    before = _tree(ck / "ema")
    _seq(ck, [3])
    real = dcp_writer._write_tensor_record
    calls = {"n": 0}

    def full_disk(out, tensor, **alignment):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(out, tensor, **alignment)

    monkeypatch.setattr(dcp_writer, "_write_tensor_record", full_disk)
    result = _invoke("accumulate", str(ck), "--decay", "0.9")
    assert result.exit_code == 7 and "No space left on device" in result.stderr
    assert _tree(ck / "ema") == before
    assert not [p for p in ck.iterdir() if p.name.startswith(".ema.tmp")]
    monkeypatch.setattr(dcp_writer, "_write_tensor_record", real)
    assert accumulate(ck, decay=0.9).step == 3


def test_disk_full_on_one_of_several_outputs_written_side_by_side(tmp_path, monkeypatch):
    """A sweep writes its outputs on parallel threads: one failing is one clean error, no output."""
    ck = tmp_path / "ck"
    for step in (10, 20, 30):
        write_dcp(ck / f"step_{step}", {"model.big": torch.full((512, 1024), float(step)),  # 2 MiB
                                        "model.b": torch.full((4,), -float(step))}, world_size=2)
    real = dcp_writer._write_tensor_record
    calls = {"n": 0}

    def full_disk(out, tensor, **alignment):
        calls["n"] += 1
        if tensor.numel() >= 256 * 1024 and calls["n"] > 4:  # a 1 MiB chunk, written in the background
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(out, tensor, **alignment)

    monkeypatch.setattr(dcp_writer, "_write_tensor_record", full_disk)
    out = tmp_path / "sweep"
    result = _invoke("posthoc", str(ck), "--sigma-rel", "0.05,0.1,0.2", "--out", str(out))
    assert result.exit_code == 7 and "No space left on device" in result.stderr
    assert not out.exists() or not list(out.iterdir())
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    monkeypatch.setattr(dcp_writer, "_write_tensor_record", real)
    assert _invoke("posthoc", str(ck), "--sigma-rel", "0.05,0.1,0.2", "--out", str(out)).exit_code == 0


def test_overlapping_runs_wait_or_exit_75(tmp_path):
    ck = _seq(tmp_path / "ck", [1, 2])
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(ck / '.ema.lock')!r}, os.O_RDONLY | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\nsys.stdin.readline()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    busy = subprocess.run([EMA_CKPT, "accumulate", str(ck), "--decay", "0.9"], capture_output=True, text=True)
    assert busy.returncode == 75 and "another ema-ckpt run" in busy.stderr and "--wait" in busy.stderr
    waiting = subprocess.Popen([EMA_CKPT, "accumulate", str(ck), "--decay", "0.9", "--wait", "120"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: holds_open(waiting.pid, ck / ".ema.lock") or waiting.poll() is not None,
             what="the second run to open the lock file")
    assert waiting.poll() is None  # still waiting for the lock
    holder.stdin.write("release\n")
    holder.stdin.flush()
    holder.wait()
    assert waiting.wait(timeout=120) == 0, waiting.stderr.read()
    assert not (ck / ".ema.lock").exists()  # the run that waited removed the lock file when done
    # a holder killed with -9 leaves no stale lock: the kernel drops it
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        f"fd = os.open({str(ck / '.ema.lock')!r}, os.O_RDONLY | os.O_CREAT)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\ntime.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    holder.kill()
    holder.wait()
    again = subprocess.run([EMA_CKPT, "accumulate", str(ck), "--decay", "0.9"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert not (ck / ".ema.lock").exists()


def _big_sequence(root: Path, steps) -> Path:
    g = torch.Generator().manual_seed(5)
    for step in steps:
        tensors = {f"model.layer{i}.weight": torch.randn(384, 1024, generator=g) for i in range(6)}
        tensors["model.n"] = torch.tensor(step)
        write_dcp(root / f"step_{step}", tensors, world_size=2)
    return root


@pytest.mark.parametrize(
    "command",
    [
        ["posthoc", "{ck}", "--sigma-rel", "0.05,0.1", "--out", "{out}", "--overwrite", "--quiet"],
        ["average", "{ck}", "--last", "3", "--out", "{out}", "--overwrite", "--quiet"],
        ["consolidate", "{ck}/step_30", "--out", "{out}/", "--max-shard-size", "3MB", "--overwrite", "--quiet"],
        ["reshard", "{ck}/step_30", "--world-size", "3", "--out", "{out}", "--overwrite", "--quiet"],
    ],
    ids=["posthoc", "average", "consolidate", "reshard"],
)
def test_kill_at_any_moment_of_every_command(tmp_path, command):
    ck = _big_sequence(tmp_path / "ck", [10, 20, 30])
    out = tmp_path / "out"
    args = [a.format(ck=ck, out=out) for a in command]
    subprocess.run([EMA_CKPT, *args], check=True)
    previous = _tree(out)
    reference = tmp_path / "reference"
    started = time.perf_counter()
    subprocess.run([EMA_CKPT, *[a.format(ck=ck, out=reference) for a in command]], check=True)
    duration = time.perf_counter() - started
    assert _tree(reference) == previous  # deterministic: a rerun writes the same bytes
    killed = 0
    for fraction in (0.1, 0.3, 0.5, 0.7, 0.9):
        proc = subprocess.Popen([EMA_CKPT, *args])
        time.sleep(duration * fraction)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        proc.wait()
        assert _tree(out) == previous, f"output damaged by a kill at {fraction:.0%}"
    assert killed >= 2
    subprocess.run([EMA_CKPT, *args], check=True)
    assert _tree(out) == previous
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []


def _wait_for_handlers(pid: int, timeout: float = 60.0) -> None:
    """Until the process ``pid`` catches SIGINT and SIGTERM (its ``SigCgt`` mask in ``/proc``):
    before that the interpreter itself is starting, and a signal has its default effect before
    any of ema-ckpt's code (or anything it writes) exists. Where ``/proc`` is missing: 0.1 s."""
    wanted = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            time.sleep(0.1)
            return
        caught = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), None)
        if caught is None:
            time.sleep(0.1)
            return
        if caught & wanted == wanted:
            return
        time.sleep(0.002)


@pytest.mark.parametrize(
    ("sig", "code", "word"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_sigterm_and_sigint_at_any_moment_end_in_one_line(tmp_path, sig, code, word):
    ck = _big_sequence(tmp_path / "ck", [10, 20, 30])
    out = tmp_path / "ema"
    args = [EMA_CKPT, "accumulate", str(ck), "--decay", "0.9", "--out", str(out), "--quiet"]
    started = time.perf_counter()
    subprocess.run(args, check=True)
    duration = time.perf_counter() - started
    previous = _tree(out)

    shutil.rmtree(out)
    stopped = 0
    # Each delay counts from when the process has installed its handlers (on a loaded machine the
    # interpreter alone may take longer than any fixed delay to get there).
    for delay in (0.0, 0.1, 0.25, *(duration * f for f in (0.3, 0.6, 0.9))):
        proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _wait_for_handlers(proc.pid)
        time.sleep(delay)
        proc.send_signal(sig)
        _stdout, stderr = proc.communicate(timeout=120)
        if proc.returncode == 0:
            assert _tree(out) == previous  # finished before the signal: the complete EMA
            shutil.rmtree(out)
            continue
        stopped += 1
        assert proc.returncode == code, (delay, proc.returncode, stderr)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(word) and "Traceback" not in stderr, (delay, stderr)
        assert not out.exists() or _tree(out) == previous
        leftovers = [p.name for p in ck.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
        assert leftovers == [], (delay, leftovers)
    assert stopped >= 2
