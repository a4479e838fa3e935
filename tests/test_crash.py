"""kill -9 at many moments of a run: the previous output stays intact, the next run finishes the job."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.dcp_helpers import write_dcp

EMA_CKPT = str(Path(sys.executable).with_name("ema-ckpt"))


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())} if path.exists() else {}


def _sequence(root: Path, steps: list[int]) -> None:
    g = torch.Generator().manual_seed(1)
    for step in steps:
        tensors = {f"model.layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(8)}
        tensors["model.count"] = torch.tensor(step)
        write_dcp(root / f"step_{step}", tensors, world_size=2)


def test_kill_at_any_moment_keeps_the_previous_ema(tmp_path):
    live = tmp_path / "ckpts"
    _sequence(live, [100, 200])
    out = tmp_path / "ema"
    cmd = [EMA_CKPT, "accumulate", str(live), "--decay", "0.99", "--out", str(out), "--quiet"]
    subprocess.run(cmd, check=True)
    previous = _files(out)
    _sequence(live, [300, 450])

    reference = tmp_path / "reference"
    shutil.copytree(out, reference)
    timed = time.perf_counter()
    subprocess.run([*cmd[:5], "--out", str(reference), "--quiet"], check=True)
    duration = time.perf_counter() - timed
    expected = _files(reference)

    killed = 0
    for delay in [0.05, 0.2, 0.4, 0.6, 0.8, 1.0, 1.3, 1.6, 2.0]:
        proc = subprocess.Popen(cmd)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        proc.wait()
        now = _files(out)
        assert now in (previous, expected), f"output damaged after a kill at {delay}s"
        if now == expected:
            break
    assert killed >= 2, f"the run finished too fast to be killed ({duration:.2f}s)"
    subprocess.run(cmd, check=True)
    assert _files(out) == expected
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ema.") and p.name != ".ema.lock"]
    assert leftovers == []
    assert expected["ema-ckpt.json"] != previous["ema-ckpt.json"]
