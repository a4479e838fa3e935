"""The callbacks' fold worker (``ema_ckpt.integrations._worker``) as its own process: a SIGTERM
that comes while it still imports (training that ended just after a save) is a request for the
last pass, never the default action that kills it before that pass.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

from ema_ckpt.watching import INCOMING, ema_step
from tests.waiting import ending

# The worker, run as BackgroundFolds runs it, but with the import of ema_ckpt.watching (torch:
# the seconds in which a SIGTERM used to kill it) held until the file HELD_UNTIL exists (the test
# makes it once it has sent the SIGTERM), said on stdout first.
_IMPORT_HELD = textwrap.dedent("""
    import importlib.abc, os, runpy, sys, time

    class HoldWatching(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "ema_ckpt.watching":
                sys.stdout.write('{"event": "importing"}\\n')
                sys.stdout.flush()
                end = time.monotonic() + 120
                while not os.path.exists(os.environ["HELD_UNTIL"]) and time.monotonic() < end:
                    time.sleep(0.01)  # the SIGTERM comes now, inside the import
            return None

    sys.meta_path.insert(0, HoldWatching())
    runpy.run_module("ema_ckpt.integrations._worker", run_name="__main__", alter_sys=True)
""")


def test_a_sigterm_during_the_workers_imports_gets_the_last_pass_and_exit_0(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    (folder / "checkpoint-10").mkdir(parents=True)
    save_file({"w": torch.full((4,), 3.0)}, str(folder / "checkpoint-10" / "model.safetensors"))
    out = tmp_path / "ema"
    # idle: a worker that missed the signal would wait ten minutes, far past the timeout below
    job = {"folder": str(folder), "out": str(out), "options": {"decay": 0.9}, "idle": 600.0, "ignore": []}
    sent = tmp_path / "sigterm-sent"
    process = subprocess.Popen([sys.executable, "-c", _IMPORT_HELD, json.dumps(job)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "HELD_UNTIL": str(sent)})
    with ending(process):
        assert process.stdout is not None
        assert json.loads(process.stdout.readline()) == {"event": "importing"}
        process.send_signal(signal.SIGTERM)
        sent.touch()
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, (process.returncode, stderr)
    events = [json.loads(line) for line in stdout.splitlines()]
    assert [(e["event"], e.get("steps"), e["step"]) for e in events] == [("fold", [10], 10), ("stopped", None, 10)]
    assert ema_step(out) == 10
    assert list((folder / INCOMING).iterdir()) == []  # the staged copy went once folded
