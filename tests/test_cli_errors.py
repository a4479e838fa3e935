"""Every error of the command line is one line: parse errors too, for every command.

Parse errors (an unknown option, a bad value, a missing argument) are made by Typer's Click
before any command runs; ``ema_ckpt.cli.run`` words them as one line naming the command and
where to look, exit 2. Usage lines name arguments plainly (``CHECKPOINTS...``, never
``{checkpoints}``). The sparse-checkpoint warning shows on every run, in plain words.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ema_ckpt.cli import _errors, run
from tests.dcp_helpers import write_dcp
from tests.waiting import ending

EMA_CKPT = str(Path(sys.executable).with_name("ema-ckpt"))
REPO = Path(__file__).resolve().parents[1]
BOX = re.compile("[\u2500-\u257f]")  # box-drawing characters: a rich panel

# (command, its positional arguments, a flag of it that takes a number) for every command
COMMANDS = {
    "accumulate": (["ckpts"], "--decay"),
    "posthoc": (["ckpts"], "--at-step"),
    "average": (["ckpts"], "--last"),
    "consolidate": (["src", "--out", "x.safetensors"], "--workers"),
    "reshard": (["src", "--out", "x", "--world-size", "2"], "--workers"),
    "inspect": (["ckpt"], None),
    "verify": (["ckpt"], None),
    "diff": (["a", "b"], "--atol"),
}
MISSING = {"accumulate": "CHECKPOINTS...", "posthoc": "CHECKPOINTS...", "average": "CHECKPOINTS...",
           "consolidate": "SRC", "reshard": "SRC", "inspect": "PATH", "verify": "PATH", "diff": "A"}


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = run(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert not BOX.search(err) and "Traceback" not in err, err
    assert lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unknown_option_is_one_line_with_a_suggestion(command, capsys):
    positional, _ = COMMANDS[command]
    code, out, err = _run(capsys, command, *positional, "--jsonn")
    line = _one_line(err)
    assert code == 2 and out == ""
    assert line.startswith(f"error: {command}: no such option --jsonn")
    assert "(did you mean --json?)" in line and line.endswith(f"see 'ema-ckpt {command} --help'")


@pytest.mark.parametrize("command", sorted(c for c, (_, flag) in COMMANDS.items() if flag))
def test_a_bad_value_is_one_line_naming_the_option(command, capsys):
    positional, flag = COMMANDS[command]
    code, _, err = _run(capsys, command, *positional, flag, "abc")
    line = _one_line(err)
    assert code == 2 and f"{command}: invalid value for {flag}: 'abc' is not a valid" in line


@pytest.mark.parametrize("command", sorted(c for c, (_, flag) in COMMANDS.items() if flag == "--workers"
                                           or c in ("accumulate", "posthoc", "average")))
def test_workers_zero_is_refused_in_one_line(command, capsys):
    positional, _ = COMMANDS[command]
    code, _, err = _run(capsys, command, *positional, "--workers", "0")
    assert code == 2 and "invalid value for --workers: 0 is not in the range" in _one_line(err)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_missing_argument_is_one_line_naming_it(command, capsys):
    code, _, err = _run(capsys, command)
    line = _one_line(err)
    assert code == 2 and line == (f"error: {command}: missing argument {MISSING[command]}; "
                                  f"see 'ema-ckpt {command} --help'")


def test_other_parse_errors_are_one_line(capsys):
    code, _, err = _run(capsys, "consolidate", "src")
    assert code == 2 and _one_line(err) == "error: consolidate: missing option --out; see 'ema-ckpt consolidate --help'"
    code, _, err = _run(capsys, "consolidate", "src", "--out")
    assert code == 2 and "consolidate: option '--out' requires an argument" in _one_line(err)
    code, _, err = _run(capsys, "acumulate", "ckpts")
    assert code == 2 and _one_line(err) == ("error: no such command 'acumulate' (did you mean 'accumulate'?); "
                                            "see 'ema-ckpt --help'")
    code, _, err = _run(capsys, "accumulate", "ckpts", "--decay", "0.9", "--dtype")
    assert code == 2 and "accumulate: option '--dtype' requires an argument" in _one_line(err)


def test_the_installed_program_prints_parse_errors_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    for args, expected in [
        (["consolidate", "--outt", "x", str(tmp_path)],
         "error: consolidate: no such option --outt (did you mean --out?)"),
        (["accumulate", str(tmp_path), "--decay", "abc"], "error: accumulate: invalid value for --decay"),
        (["accumulate"], "error: accumulate: missing argument CHECKPOINTS..."),
    ]:
        proc = subprocess.run([EMA_CKPT, *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 2 and proc.stdout == ""
        assert _one_line(proc.stderr).startswith(expected), proc.stderr
    alone = subprocess.run([EMA_CKPT], capture_output=True, text=True, env=env)
    assert alone.returncode == 2 and "Usage: ema-ckpt [OPTIONS] COMMAND" in alone.stdout and alone.stderr == ""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_usage_lines_name_arguments_plainly_and_fit_80_columns(command):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    proc = subprocess.run([EMA_CKPT, command, "--help"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    usage = next(line.strip() for line in proc.stdout.splitlines() if "Usage:" in line)
    assert usage == f"Usage: ema-ckpt {command} [OPTIONS] {' '.join(_arguments(command))}"
    assert "{" not in usage and "}" not in usage and len(usage) <= 78
    assert all(len(line) <= 80 for line in proc.stdout.splitlines())
    assert "Examples" in proc.stdout and f"ema-ckpt {command} " in proc.stdout.split("Examples", 1)[1]


def _arguments(command: str) -> list[str]:
    return {"diff": ["A", "B"]}.get(command, [MISSING[command]])


def test_error_docstrings():
    for module in (_errors,):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


# --- the sparse-checkpoint warning -----------------------------------------------------------


@pytest.fixture
def sparse(tmp_path) -> Path:
    """Checkpoints 90 steps apart: sparse for an EMA with a half-life of 5 steps."""
    for step in (10, 100, 190):
        write_dcp(tmp_path / "ckpts" / f"step_{step}", {"model.w": torch.full((4, 2), float(step))})
    return tmp_path / "ckpts"


def _plain(line: str) -> None:
    assert "sqrt(k/window)" not in line and "1/20 of the averaging window" not in line
    assert "checkpoints are up to 90 steps apart (between steps 10 and 100)" in line
    assert "keeps more of the training noise" in line and "save checkpoints more often" in line


def test_the_sparse_warning_shows_on_a_real_run_in_plain_words(sparse, tmp_path, capsys):
    code, _, err = _run(capsys, "accumulate", str(sparse), "--half-life", "5", "--out", str(tmp_path / "ema"))
    assert code == 0
    [warning] = [line for line in err.splitlines() if line.startswith("warning: ")]
    _plain(warning)
    assert "choose a longer EMA (a longer --half-life, or a --decay closer to 1)" in warning
    code, _, err = _run(capsys, "posthoc", str(sparse), "--sigma-rel", "0.02", "--out", str(tmp_path / "ph"))
    assert code == 0
    [warning] = [line for line in err.splitlines() if line.startswith("warning: sigma_rel_0.02: ")]
    _plain(warning)
    assert "(a larger --sigma-rel)" in warning and "over 100%" in warning


def test_the_sparse_warning_is_in_json_and_dry_runs(sparse, tmp_path, capsys):
    code, out, _ = _run(capsys, "accumulate", str(sparse), "--half-life", "5", "--out", str(tmp_path / "ema"),
                        "--json")
    assert code == 0
    [warning] = json.loads(out)["warnings"]
    _plain(warning)
    code, out, _ = _run(capsys, "posthoc", str(sparse), "--sigma-rel", "0.02", "--out", str(tmp_path / "ph"),
                        "--json")
    assert code == 0
    [warning] = json.loads(out)["outputs"][0]["warnings"]
    _plain(warning)
    code, _, err = _run(capsys, "posthoc", str(sparse), "--sigma-rel", "0.02", "--dry-run")
    assert code == 0
    _plain(next(line for line in err.splitlines() if line.startswith("warning: ")))
    code, _, err = _run(capsys, "accumulate", str(sparse), "--half-life", "5000", "--out", str(tmp_path / "long"))
    assert code == 0 and "warning" not in err  # a window long enough for the spacing: nothing to say


@pytest.mark.parametrize(("signum", "code"), [(2, 130), (15, 143)])
def test_a_signal_swallowed_by_code_that_is_not_ours_still_ends_the_run_as_the_signal(monkeypatch, signum, code):
    """Ctrl-C inside ``import torch`` can be swallowed there; the import then fails again with
    another error ("cannot load module more than once"): the run ends as the signal asked."""
    import typer

    from ema_ckpt import _signals
    from ema_ckpt.cli._errors import reports_errors

    monkeypatch.setitem(_signals._state, "raised", None)

    @reports_errors
    def body() -> None:
        with pytest.raises(KeyboardInterrupt):
            monkeypatch.setitem(_signals._state, "armed", True)
            _signals._handler(signum, None)
        raise ImportError("cannot load module more than once per process")

    with pytest.raises(typer.Exit) as stopped:
        body()
    assert stopped.value.exit_code == code


_IMPORT_THEN_WAIT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from ema_ckpt import _signals
_signals.install()
try:
    with _signals.armed():
        print("armed", flush=True)
        import slow_to_import
        time.sleep(30)
        print("not interrupted", flush=True)
except KeyboardInterrupt as stop:
    # the signal comes once the import is done, whenever after that: the module is whole
    print("imported", getattr(sys.modules.get("slow_to_import"), "DONE", None), flush=True)
    print("stopped", type(stop).__name__, flush=True)
"""


@pytest.mark.parametrize(("signum", "raised"), [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "Terminated")])
def test_a_signal_during_an_import_is_raised_once_the_import_is_done(tmp_path, signum, raised):
    """An extension's initialisation (torch's) calls back into Python from C++, where an
    exception cannot unwind: the process would abort. The signal waits for the import."""
    sent = tmp_path / "signal-sent"
    (tmp_path / "slow_to_import.py").write_text(  # Python code runs in the import until the signal was sent
        "import os, sys, time\nprint('importing', flush=True)\nend = time.monotonic() + 120\n"
        f"while not os.path.exists({str(sent)!r}) and time.monotonic() < end:\n    pass\nDONE = True\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", _IMPORT_THEN_WAIT, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with ending(proc):
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "armed"
        assert proc.stdout.readline().strip() == "importing"
        proc.send_signal(signum)  # inside the import's loop
        sent.touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.split("\n")[:2] == ["imported True", f"stopped {raised}"]
