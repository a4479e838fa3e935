"""``select``: a planted optimum found, scores cached and resumed, failures reported, soups
never worse than their best checkpoint; the evaluation is a real command run per candidate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from ema_ckpt.choosing.evaluation import evaluate, parse_score
from ema_ckpt.choosing.soup import greedy_soup
from ema_ckpt.commands.select import select
from ema_ckpt.errors import EvaluationError, OptionError, UsageError
from ema_ckpt.manifest import Manifest
from ema_ckpt.plans import Plan
from tests.test_object_storage import BUCKET, download, s3, upload  # noqa: F401  (s3: a fixture)

STEPS = [100, 200, 300, 400, 500, 600, 700, 800]
# The held-out loss of a candidate: mean((w − target)²), in float64 (numpy only: a fast command).
EVAL_SCRIPT = """\
import json, pathlib, sys
import numpy as np
from safetensors.numpy import load_file
folder = pathlib.Path(sys.argv[1])
with open(sys.argv[2], "a") as calls:
    calls.write(folder.name + "\\n")
w = np.concatenate([v.astype(np.float64).ravel() for f in sorted(folder.glob("*.safetensors"))
                    for k, v in sorted(load_file(f).items())])
target = np.load(sys.argv[3])
print("evaluating", folder)
print(json.dumps({"eval": {"loss": float(((w - target) ** 2).mean())}}))
"""


def _sequence(root: Path) -> tuple[Path, dict[int, np.ndarray], np.ndarray]:
    """Noisy checkpoints converging to a target: the best average lies strictly inside the grids."""
    rng = np.random.default_rng(0)
    target = rng.standard_normal(48)
    theta, weights = np.zeros(48), {}
    for step in STEPS:
        theta = theta + 0.35 * (target - theta) + 0.25 * rng.standard_normal(48)
        weights[step] = theta.astype(np.float32)
        (root / f"step_{step}").mkdir(parents=True)
        save_file({"w": weights[step]}, str(root / f"step_{step}" / "model.safetensors"))
    return root, weights, target


@pytest.fixture
def planted(tmp_path):
    ckpts, weights, target = _sequence(tmp_path / "ckpts")
    np.save(tmp_path / "target.npy", target.astype(np.float32).astype(np.float64))
    script = tmp_path / "eval.py"
    script.write_text(EVAL_SCRIPT)
    calls = tmp_path / "calls.txt"
    command = f"{sys.executable} {script} {{path}} {calls} {tmp_path / 'target.npy'}"
    return ckpts, weights, command, calls


def _loss(plan_output, weights: dict[int, np.ndarray]) -> float:
    """The closed form: Σ cᵢ θᵢ in float64 against the target, as the command computes it."""
    target = np.load(Path(os.environ["SELECT_TARGET"]))
    mix = sum(t.coefficient * weights[t.step].astype(np.float64) for t in plan_output.terms)
    return float(((mix - target) ** 2).mean())


def _calls(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_select_finds_the_planted_optimum_and_publishes_it(planted, tmp_path, monkeypatch):
    ckpts, weights, command, calls = planted
    monkeypatch.setenv("SELECT_TARGET", str(tmp_path / "target.npy"))
    grid = {"sigma_rels": ["0.05:0.25:0.05"], "lasts": ["2,3,4,6,8"], "weights": ["uniform", "minus-sqrt"]}
    plan = select(ckpts, out=tmp_path / "best", eval_command=None, dry_run=True, **grid)
    assert isinstance(plan, Plan) and not _calls(calls)
    expected = {o.name: _loss(o, weights) for o in plan.outputs}
    want = min(expected, key=expected.__getitem__)
    events = []
    result = select(ckpts, out=tmp_path / "best", eval_command=command, metric="eval.loss", on_event=events.append,
                    **grid)
    assert result.chosen == want and result.score == pytest.approx(expected[want], rel=1e-5)
    for item in result.scores:
        assert item.score == pytest.approx(expected[item.name], rel=1e-5, abs=1e-9)
    assert sorted(_calls(calls)) == sorted(expected) and result.evaluated == len(expected)
    assert {e.kind for e in events} == {"writing", "evaluated"}
    # the output is the chosen candidate, with its manifest naming it and every score
    got = load_file(str(tmp_path / "best" / "model.safetensors"))["w"].astype(np.float64)
    chosen = next(o for o in plan.outputs if o.name == want)
    mix = sum(t.coefficient * weights[t.step].astype(np.float64) for t in chosen.terms)
    np.testing.assert_allclose(got, mix, rtol=1e-6, atol=1e-6)
    selected = Manifest.read(tmp_path / "best").options["selected"]  # type: ignore[union-attr]
    assert selected["candidate"] == want and len(selected["scores"]) == len(expected)
    assert not (tmp_path / "best.select" / "scratch").exists()  # candidates cleaned up
    assert (tmp_path / "best.select" / "logs" / f"{want}.log").is_file()


def test_a_second_run_evaluates_nothing_and_a_wider_grid_only_the_new(planted, tmp_path):
    ckpts, _weights, command, calls = planted
    first = select(ckpts, out=tmp_path / "best", eval_command=command, sigma_rels=["0.1,0.2"], lasts=[4])
    assert first.evaluated == 3 and len(_calls(calls)) == 3
    again = select(ckpts, out=tmp_path / "best", eval_command=command, sigma_rels=["0.1,0.2"], lasts=[4])
    assert again.evaluated == 0 and len(_calls(calls)) == 3 and again.chosen == first.chosen
    assert all(s.cached for s in again.scores)
    wider = select(ckpts, out=tmp_path / "best", eval_command=command, sigma_rels=["0.1,0.15,0.2"], lasts=[4, 6])
    assert wider.evaluated == 2 and sorted(_calls(calls)[3:]) == ["last_6", "sigma_rel_0.15"]
    # another command is another score: nothing is reused across commands
    other = select(ckpts, out=tmp_path / "best", eval_command=command + " --again", sigma_rels=["0.1"])
    assert other.evaluated == 1


def test_a_killed_selection_resumes_with_what_it_had_scored(planted, tmp_path):
    ckpts, _weights, command, calls = planted
    killer = tmp_path / "kill.py"
    killer.write_text("import os, signal, sys\n"
                      "n = len(open(sys.argv[1]).read().split()) if os.path.exists(sys.argv[1]) else 0\n"
                      "if n == 3 and not os.path.exists(sys.argv[2]):\n"
                      "    open(sys.argv[2], 'w').close()\n"
                      "    pid = os.getppid()\n"  # the evaluation runs in a group of its own: find select's
                      "    while os.getpgid(pid) == os.getpgid(0):\n"
                      "        pid = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])\n"
                      "    os.killpg(os.getpgid(pid), signal.SIGKILL)\n"  # once: the selection's own group
                      "    os.killpg(os.getpgid(0), signal.SIGKILL)\n")  # and the evaluation, orphaned by it
    line = f"{sys.executable} {killer} {calls} {tmp_path / 'killed'} && {command}"
    args = [sys.executable, "-m", "ema_ckpt", "select", str(ckpts), "--sigma-rel", "0.05:0.25:0.05",
            "--last", "4", "--per-pass", "2", "--eval", line, "--out", str(tmp_path / "best")]
    proc = subprocess.run(args, start_new_session=True, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL and len(_calls(calls)) == 3
    assert not (tmp_path / "best").exists()
    resumed = subprocess.run([*args[:-2], "--json", "--out", str(tmp_path / "best")], capture_output=True, text=True,
                             timeout=300, start_new_session=True)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["evaluated"] == 3 and len(_calls(calls)) == 6  # 6 candidates: 3 scored before the kill
    assert sum(c["cached"] for c in report["candidates"]) == 3 and (tmp_path / "best" / "ema-ckpt.json").is_file()


def test_failures_are_reported_and_only_all_failing_is_fatal(planted, tmp_path):
    ckpts, _weights, command, _calls_file = planted
    flaky = f"case {{name}} in last_*) echo broken >&2; exit 3;; esac; {command}"
    result = select(ckpts, out=tmp_path / "best", eval_command=flaky, sigma_rels=["0.1"], lasts=[2, 4])
    failed = {s.name: s.error for s in result.scores if s.score is None}
    assert failed == {"last_2": "exit 3: broken", "last_4": "exit 3: broken"} and result.chosen == "sigma_rel_0.1"
    with pytest.raises(EvaluationError) as err:
        select(ckpts, out=tmp_path / "none", eval_command="echo no score here; true {path}", lasts=[2])
    assert err.value.exit_code == 10 and "printed no number" in str(err.value)
    assert not (tmp_path / "none").exists()
    cli = subprocess.run([sys.executable, "-m", "ema_ckpt", "select", str(ckpts), "--last", "2", "--eval",
                          "false {path}", "--out", str(tmp_path / "none")], capture_output=True, text=True)
    assert cli.returncode == 10 and cli.stderr.strip().splitlines()[-1].startswith("error: the evaluation command")
    assert "Traceback" not in cli.stderr


def test_greedy_soup_of_real_checkpoints_is_no_worse_than_the_best_one(planted, tmp_path):
    ckpts, _weights, command, _calls_file = planted
    result = select(ckpts, out=tmp_path / "soup", eval_command=command, metric="eval.loss", soup="greedy",
                    singles="all")
    singles = [s for s in result.scores if s.name.startswith("step_")]
    soup = next(s for s in result.scores if s.name == "soup_greedy")
    assert soup.score is not None and soup.score <= min(s.score for s in singles if s.score is not None)
    assert result.soup is not None and len(result.soup.path) == len(STEPS)
    members = sorted(int(m.removeprefix("step_")) for m in result.soup.members)
    assert [t.step for t in soup.output.terms] == members
    assert all(t.coefficient == pytest.approx(1 / len(members)) for t in soup.output.terms)
    selected = Manifest.read(tmp_path / "soup").options["selected"]  # type: ignore[union-attr]
    assert [p["added"] for p in selected["soup"]["path"]] == [p.added for p in result.soup.path]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=8), st.booleans(), st.integers(0, 2**31))
def test_greedy_soup_never_scores_worse_than_its_best_ingredient(alone, maximize, seed):
    rng = np.random.default_rng(seed)
    names = [f"c{i}" for i in range(len(alone))]
    mixed: dict[tuple[str, ...], float | None] = {}

    def score(group):
        if len(group) == 1:
            return alone[names.index(group[0])]
        key = tuple(sorted(group))
        if key not in mixed:
            mixed[key] = None if rng.random() < 0.1 else float(rng.uniform(-1e6, 1e6))
        return mixed[key]

    soup = greedy_soup(names, score, maximize=maximize)
    best = max(alone) if maximize else min(alone)
    assert (soup.score >= best) if maximize else (soup.score <= best)
    assert soup.members[0] == names[alone.index(best)]


def test_the_command_sees_each_candidate_and_its_format(planted, tmp_path):
    ckpts, _weights, _command, _calls = planted
    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nprint(sorted(os.listdir(sys.argv[1])), sys.argv[2], "
                     "os.environ['EMA_CKPT_CANDIDATE_NAME'])\nprint(len(os.listdir(sys.argv[1])))\n")
    for fmt, files in (("torch", 2), ("dcp", 3), ("hf", 2)):
        result = select(ckpts, out=tmp_path / f"out-{fmt}", eval_command=f"{sys.executable} {probe} {{path}} {{name}}",
                        lasts=[2], eval_format=fmt, format="safetensors", work_dir=tmp_path / f"w-{fmt}")
        assert result.score == files
        assert (tmp_path / f"out-{fmt}" / "model.safetensors").is_file()


def test_options_are_checked_before_anything_runs(planted, tmp_path):
    ckpts, _weights, command, calls = planted
    for bad, option in ((dict(eval_command="python eval.py"), "eval_command"),
                        (dict(eval_command=command, eval_format="npz"), "eval_format"),
                        (dict(eval_command=command, soup="best"), "soup"),
                        (dict(eval_command=command, weights=["steep"]), "weights"),
                        (dict(eval_command=command, lasts=["0"]), "lasts")):
        with pytest.raises(OptionError) as err:
            select(ckpts, out=tmp_path / "x", **{"lasts": [2], **bad})
        assert err.value.option == option
    with pytest.raises(UsageError, match="at least one candidate"):
        select(ckpts, out=tmp_path / "x", eval_command=command)
    cli = subprocess.run([sys.executable, "-m", "ema_ckpt", "select", str(ckpts), "--last", "2", "--eval",
                          "python eval.py", "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert cli.returncode == 2 and cli.stderr.strip() == (
        "error: --eval must name the candidate with {path} (e.g. 'python eval.py {path}'), got 'python eval.py'")
    assert not _calls(calls) and not (tmp_path / "x").exists()


def test_scores_are_read_from_what_the_command_prints(tmp_path):
    assert parse_score("epoch 3/10\nloss=0.25 acc 93.1%\n") == 93.1
    assert parse_score('{"loss": 2}\nnoise\n{"loss": "1.5"}\n', metric="loss") == 1.5
    assert parse_score('{"eval": {"acc": 0.9}}', metric="eval.acc") == 0.9
    for text, metric in (("no digits", None), ('{"x": 1}', "loss"), ("loss nan", None)):
        with pytest.raises(ValueError):
            parse_score(text, metric)
    slow = evaluate("sleep 5; echo 1 {path}", tmp_path, "c", timeout=0.5, log=tmp_path / "c.log")
    assert slow.error == "timed out after 0.5 s" and (tmp_path / "c.log").is_file()
    quoted = evaluate("printf '%s\\n' {path} {name}; echo 7", tmp_path / "a b; rm -rf x", "n'1")
    assert quoted.score == 7.0


def test_an_output_select_did_not_write_is_kept_unless_overwrite(planted, tmp_path):
    ckpts, _weights, command, _calls = planted
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(Exception) as err:
        select(ckpts, out=tmp_path / "mine", eval_command=command, lasts=[2])
    assert "overwrite" in str(err.value) and (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    result = select(ckpts, out=tmp_path / "mine", eval_command=command, lasts=[2], overwrite=True)
    assert result.evaluated == 0 and (tmp_path / "mine" / "model.safetensors").is_file()  # scored by the first try


def test_checkpoints_on_object_storage_and_the_choice_published_there(planted, tmp_path, s3):  # noqa: F811
    ckpts, _weights, command, _calls_file = planted
    grid = {"sigma_rels": ["0.1"], "lasts": [2, 4], "eval_command": command}
    url = upload(ckpts, "select/ckpts")
    local = select(ckpts, out=tmp_path / "local", work_dir=tmp_path / "w-local", **grid)
    remote = select(url, out=f"s3://{BUCKET}/select/best", work_dir=tmp_path / "w-s3", **grid)
    assert remote.chosen == local.chosen
    assert [s.score for s in remote.scores] == [s.score for s in local.scores]  # the same bytes evaluated
    there = download(f"s3://{BUCKET}/select/best", tmp_path / "fetched")
    assert (there / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()
    again = select(url, out=f"s3://{BUCKET}/select/best", work_dir=tmp_path / "w-s3", **grid)
    assert again.evaluated == 0  # cached; the earlier choice on S3 replaced without overwrite
