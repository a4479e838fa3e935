"""``select`` under hostile conditions: evaluations that leave processes behind or print without
end, inputs rewritten between scoring and publishing, score caches edited by hand. Every wait is
for a condition, with a deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ema_ckpt.choosing import evaluation
from ema_ckpt.choosing.evaluation import Tail, evaluate
from ema_ckpt.commands import select as select_module
from ema_ckpt.commands.select import select
from ema_ckpt.errors import EvaluationError, IncompatibleCheckpointError
from tests.test_select import EVAL_SCRIPT, _sequence
from tests.waiting import ending, wait_for

# An evaluation that starts a grandchild (its pid written to a file) and then scores or hangs.
SPAWNER = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(sys.argv[1], "w") as f:
    f.write(str(child.pid))
if sys.argv[2] == "hang":
    time.sleep(300)
print(0.5)
"""


def _gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for its reaper counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _pid(path: Path) -> int:
    wait_for(lambda: path.is_file() and path.read_text().strip().isdigit(), what=f"{path}")
    return int(path.read_text())


@pytest.fixture
def ckpts(tmp_path):
    root, _weights, _target = _sequence(tmp_path / "ckpts")
    return root


@pytest.fixture
def scorer(tmp_path):
    """A real evaluation (the planted loss), as in test_select."""
    _root, _w, target = (None, None, np.zeros(48))
    np.save(tmp_path / "target.npy", target)
    script = tmp_path / "eval.py"
    script.write_text(EVAL_SCRIPT)
    return f"{sys.executable} {script} {{path}} {tmp_path / 'calls.txt'} {tmp_path / 'target.npy'}"


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ema_ckpt", "select", *args], capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


# 1. every process of an evaluation ends with it

def test_a_timed_out_evaluation_leaves_no_grandchild(ckpts, tmp_path):
    script = tmp_path / "spawn.py"
    script.write_text(SPAWNER)
    pid_file = tmp_path / "grandchild.pid"
    # the timeout leaves the evaluation (a Python process) time to start its grandchild on a loaded machine
    with pytest.raises(EvaluationError, match="timed out after 5 s"):
        select(ckpts, out=tmp_path / "best", lasts=[2], eval_timeout=5.0,
               eval_command=f"{sys.executable} {script} {pid_file} hang # {{path}}")
    grandchild = _pid(pid_file)
    wait_for(lambda: _gone(grandchild), what=f"grandchild {grandchild} to end")
    assert not (tmp_path / "best").exists()
    log = (tmp_path / "best.select" / "logs" / "last_2.log").read_text()
    assert log.rstrip().endswith("[timed out]")


def test_an_evaluation_that_exits_leaves_no_background_process(ckpts, tmp_path):
    script = tmp_path / "spawn.py"
    script.write_text(SPAWNER)
    pid_file = tmp_path / "grandchild.pid"
    result = select(ckpts, out=tmp_path / "best", lasts=[2],
                    eval_command=f"{sys.executable} {script} {pid_file} exit # {{path}}")
    assert not isinstance(result, select_module.Plan) and result.score == 0.5
    grandchild = _pid(pid_file)
    wait_for(lambda: _gone(grandchild), what=f"grandchild {grandchild} to end")


def test_sigterm_to_select_ends_the_evaluation_and_its_grandchild(ckpts, tmp_path):
    script = tmp_path / "spawn.py"
    script.write_text(SPAWNER)
    pid_file = tmp_path / "grandchild.pid"
    proc = subprocess.Popen([sys.executable, "-m", "ema_ckpt", "select", str(ckpts), "--last", "2", "--eval",
                             f"{sys.executable} {script} {pid_file} hang # {{path}}", "--out", str(tmp_path / "best")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with ending(proc):
        grandchild = _pid(pid_file)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    wait_for(lambda: _gone(grandchild), what=f"grandchild {grandchild} to end")
    assert not (tmp_path / "best").exists()


# 2. output is streamed; a bounded tail finds the score

def test_the_tail_never_holds_more_than_its_cap():
    rng = np.random.default_rng(1)
    tail, whole = Tail(1000), bytearray()
    for _ in range(500):
        chunk = bytes(rng.integers(32, 127, int(rng.integers(0, 3000))).astype(np.uint8))
        tail.add(chunk)
        whole += chunk
        assert len(tail.data) <= 1000 and tail.data == whole[-1000:]
    assert tail.peak <= 1000 and tail.dropped


def test_a_score_after_a_large_output_is_found_with_a_small_tail(tmp_path, monkeypatch):
    held: list[Tail] = []

    class Recording(Tail):
        def __init__(self, cap: int = evaluation.TAIL_BYTES) -> None:
            super().__init__(cap)
            held.append(self)

    monkeypatch.setattr(evaluation, "Tail", Recording)
    noisy = ("import sys\nline = b'x 12345 ' * 64 + b'\\n'\nfor _ in range(40000):\n"
             "    sys.stdout.buffer.write(line)\nsys.stderr.write('warn 7\\n' * 10000)\n"
             "print('{\"loss\": 0.125}')\nprint('done', 99)\n")
    (tmp_path / "noisy.py").write_text(noisy)
    log = tmp_path / "c.log"
    got = evaluate(f"{sys.executable} {tmp_path / 'noisy.py'} {{path}}", tmp_path, "c", log=log, tail_bytes=4096)
    assert got.score == 99
    keyed = evaluate(f"{sys.executable} {tmp_path / 'noisy.py'} {{path}}", tmp_path, "c", metric="loss",
                     tail_bytes=4096)
    assert keyed.score == 0.125
    assert held and all(t.peak <= 4096 and t.cap == 4096 for t in held)
    assert log.stat().st_size > 40000 * 512  # the whole output is in the log, stderr and status after it
    with log.open("rb") as f:
        f.seek(-200, os.SEEK_END)
        end = f.read().decode()
    assert end.rstrip().endswith("[exit 0]") and "warn 7" in end
    assert not log.with_name("c.log.stderr").exists()


# 3. only what was scored is published

REWRITER = """\
import subprocess, sys
import numpy as np
from safetensors.numpy import save_file
subprocess.run(sys.argv[3:], check=True)
save_file({"w": np.full(48, 7.0, dtype=np.float32)}, sys.argv[2] + "/model.safetensors")
"""


def test_an_input_rewritten_after_scoring_is_refused_and_nothing_published(ckpts, scorer, tmp_path):
    script = tmp_path / "rewrite.py"
    script.write_text(REWRITER)
    newest = ckpts / "step_800"
    line = f"{sys.executable} {script} {{path}} {newest} {scorer}"
    cli = _cli(str(ckpts), "--last", "2", "--eval", line, "--out", str(tmp_path / "best"))
    assert cli.returncode == 4, cli.stderr
    message = [line for line in cli.stderr.splitlines() if line.startswith("error:")]  # progress lines aside
    assert len(message) == 1 and cli.stderr.strip().splitlines()[-1] == message[0]
    assert str(newest) in message[0] and "run select again" in message[0]
    assert "Traceback" not in cli.stderr and not (tmp_path / "best").exists()
    # run again: the rewritten checkpoint is a new key, scored as it is now, then published
    again = select(ckpts, out=tmp_path / "best", lasts=[2], eval_command=scorer)
    assert not isinstance(again, select_module.Plan) and again.evaluated == 1
    assert (tmp_path / "best" / "model.safetensors").is_file()


def test_an_input_rewritten_while_the_choice_is_written_is_refused(ckpts, scorer, tmp_path, monkeypatch):
    compute = select_module._ChosenJob.compute

    def rewrite_after_read(self, plan, context):
        computed = compute(self, plan, context)
        save_file({"w": np.full(48, 3.0, dtype=np.float32)}, str(ckpts / "step_700" / "model.safetensors"))
        return computed

    monkeypatch.setattr(select_module._ChosenJob, "compute", rewrite_after_read)
    with pytest.raises(IncompatibleCheckpointError, match="step_700 was rewritten after it was scored") as err:
        select(ckpts, out=tmp_path / "best", lasts=[2], eval_command=scorer)
    assert err.value.exit_code == 4 and not (tmp_path / "best").exists()


def test_a_cached_score_whose_input_was_rewritten_is_not_published(ckpts, scorer, tmp_path):
    first = select(ckpts, out=tmp_path / "best", lasts=[2], eval_command=scorer)
    assert not isinstance(first, select_module.Plan)
    cache = tmp_path / "best.select" / "scores.json"
    data = json.loads(cache.read_text())
    # an entry that claims other inputs than the key's (a cache carried over, or written by a race)
    for entry in data["entries"].values():
        entry["inputs"] = {path: "sha256:" + "0" * 32 for path in entry["inputs"]}
    cache.write_text(json.dumps(data))
    with pytest.raises(IncompatibleCheckpointError, match="run select again") as err:
        select(ckpts, out=tmp_path / "other", lasts=[2], eval_command=scorer, work_dir=tmp_path / "best.select")
    assert err.value.exit_code == 4 and not (tmp_path / "other").exists()


# 4. a hand-edited score cache is refused in one line

@pytest.mark.parametrize("edit, why", [
    (lambda text, key: text.replace('"score": SCORE', '"score": "0.5"'), "score '0.5' is not a finite number"),
    (lambda text, key: text.replace('"score": SCORE', '"score": -Infinity'), "score -Infinity is not a finite number"),
    (lambda text, key: text.replace('"score": SCORE', '"score": NaN'), "score NaN is not a finite number"),
    (lambda text, key: text.replace('"score": SCORE', '"score": [1.0]'), "score [1.0] is not a finite number"),
    (lambda text, key: text.replace('"score": SCORE', '"score": null'), "neither a score nor a recorded failure"),
    (lambda text, key: text.replace('"score": SCORE,', ""), "has no 'score'"),
    (lambda text, key: text.replace('"entries": {', '"entries": {"x": 3, '), "entry 'x': is a JSON int"),
    (lambda text, key: text[: len(text) // 2], "not a score cache"),
], ids=["string", "-Infinity", "NaN", "list", "no-failure", "missing", "not-object", "not-json"])
def test_a_hand_edited_cache_is_refused_in_one_line(ckpts, scorer, tmp_path, edit, why):
    first = select(ckpts, out=tmp_path / "best", lasts=[2], eval_command=scorer)
    assert not isinstance(first, select_module.Plan)
    cache = tmp_path / "best.select" / "scores.json"
    data = json.loads(cache.read_text())
    (key, entry), = data["entries"].items()
    text = json.dumps(data).replace(f'"score": {json.dumps(entry["score"])}', '"score": SCORE')
    cache.write_text(edit(text, key).replace('"score": SCORE', f'"score": {json.dumps(entry["score"])}'))
    cli = _cli(str(ckpts), "--last", "2", "--eval", scorer, "--work-dir", str(tmp_path / "best.select"),
               "--out", str(tmp_path / "other"))
    assert cli.returncode == 2, cli.stderr
    lines = cli.stderr.strip().splitlines()
    assert len(lines) == 1 and str(cache) in lines[0] and why in lines[0], lines
    if why not in ("not a score cache", "entry 'x': is a JSON int"):
        assert key in lines[0]
    assert "Traceback" not in cli.stderr and not (tmp_path / "other").exists()
