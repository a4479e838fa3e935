"""Library errors carry data; the CLI words them from one table of flags."""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest
import torch

import ema_ckpt
from ema_ckpt.cli._errors import error_message, flag_for
from ema_ckpt.cli._flags import flags
from ema_ckpt.errors import (
    CheckpointFormatError,
    EmaCkptError,
    ManifestMismatchError,
    NonFiniteError,
    OptionError,
    UsageError,
)
from ema_ckpt.maths import (
    ExponentialProfile,
    Snapshot,
    check_gamma,
    posthoc_plan,
    power_coefficients,
    sigma_rel_to_gamma,
    uniform_coefficients,
)
from ema_ckpt.profile_specs import parse_gamma_list, parse_sigma_list

PACKAGE = Path(ema_ckpt.__file__).parent
MATHS_SOURCES = [*sorted((PACKAGE / "maths").glob("*.py")), PACKAGE / "profile_specs.py"]


# --------------------------------------------------------------------------- the table is whole


def _literal_strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _literal_strings(element)]
    return []


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def named_parameters() -> set[str]:
    """Every library parameter an error can name, read from the package's source.

    The literals passed as an error's ``option``/``remedy``/``mentions``, the first argument of
    ``OptionError``, and the ``option`` argument (or its default) of any function that takes one.
    """
    trees = [ast.parse(path.read_text(encoding="utf-8")) for path in sorted(PACKAGE.rglob("*.py"))]
    option_position: dict[str, int] = {}
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [*node.args.posonlyargs, *node.args.args]
                for index, arg in enumerate(params):
                    if arg.arg == "option" and node.name != "__init__":
                        option_position[node.name] = index
                        defaults = node.args.defaults
                        offset = len(params) - len(defaults)
                        if index >= offset:
                            names.update(_literal_strings(defaults[index - offset]))
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = _called_name(node)
            for keyword in node.keywords:
                if keyword.arg in ("option", "remedy", "mentions"):
                    names.update(_literal_strings(keyword.value))
            if called == "OptionError" and node.args:
                names.update(_literal_strings(node.args[0]))
            if called in option_position and len(node.args) > option_position[called]:
                names.update(_literal_strings(node.args[option_position[called]]))
    return names


def test_every_parameter_an_error_can_name_has_a_flag():
    names = named_parameters()
    assert {"at_step", "decay", "half_life", "warmup", "per_checkpoint", "sigma_rel", "sigma_rels", "gamma",
            "gammas", "last", "from_step", "to_step"} <= names  # the scan sees them
    missing = sorted(names - flags().keys())
    assert not missing, f"no command has a flag for these library parameters (ema_ckpt.cli._flags.CLI_NAMES): {missing}"


def test_flags_are_flags():
    assert all(flag.startswith("--") and " " not in flag for flag in flags().values())
    assert flag_for("at_step") == "--at-step"


def test_the_maths_names_no_flag():
    for path in MATHS_SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "--" not in node.value.replace("# ---", ""), f"{path.name}: {node.value!r}"


# --------------------------------------------------------------------------- the same error, two wordings


def _raised(call, *args, **kwargs) -> EmaCkptError:
    with pytest.raises(EmaCkptError) as info:
        call(*args, **kwargs)
    return info.value


CASES = [
    # (raise it, library wording, CLI wording: as the CLI printed it before errors carried data)
    (lambda: power_coefficients([10, 20], 1.0, at_step=5),
     "at_step 5 is before the first checkpoint (step 10)",
     "--at-step 5 is before the first checkpoint (step 10)"),
    (lambda: power_coefficients([100, 200, 400], 1.0, at_step=10000),
     "at_step 10000 is after the newest checkpoint (step 400): nothing after it is known",
     "--at-step 10000 is after the newest checkpoint (step 400): nothing after it is known"),
    (lambda: ExponentialProfile(1.5),
     "decay must lie strictly between 0 and 1, got 1.5",
     "--decay must lie strictly between 0 and 1, got 1.5"),
    (lambda: ExponentialProfile(0.9, per_checkpoint=True, warmup=True),
     "warmup counts optimizer steps; it cannot be combined with per_checkpoint",
     "--warmup counts optimizer steps; it cannot be combined with --per-checkpoint"),
    (lambda: ExponentialProfile.from_half_life(-3.0),
     "half_life must be a positive number of steps, got -3.0",
     "--half-life must be a positive number of steps, got -3.0"),
    (lambda: uniform_coefficients([10, 20, 30], from_step=30, to_step=20),
     "from_step 30 is after to_step 20",
     "--from-step 30 is after --to-step 20"),
    (lambda: uniform_coefficients([10, 20, 30], last=0),
     "last must be a positive number of checkpoints, got 0",
     "--last must be a positive number of checkpoints, got 0"),
    (lambda: parse_sigma_list("abc"),
     "sigma_rels: 'abc' is not a number or a start:stop:step range",
     "--sigma-rel: 'abc' is not a number or a start:stop:step range"),
    (lambda: parse_sigma_list(""),
     "sigma_rels needs at least one value",
     "--sigma-rel needs at least one value"),
    (lambda: parse_sigma_list("0.5"),
     "sigma_rels must lie between 1.0e-06 and 1/√12 ≈ 0.2887 (a relative width of the averaging window, "
     "not γ), got 0.5",
     "--sigma-rel must lie between 1.0e-06 and 1/√12 ≈ 0.2887 (a relative width of the averaging window, "
     "not γ), got 0.5"),
    (lambda: sigma_rel_to_gamma(0.3),
     "sigma_rel must lie between 1.0e-06 and 1/√12 ≈ 0.2887 (a relative width of the averaging window, "
     "not γ), got 0.3",
     "--sigma-rel must lie between 1.0e-06 and 1/√12 ≈ 0.2887 (a relative width of the averaging window, "
     "not γ), got 0.3"),
    (lambda: check_gamma("-1"),
     "gamma (the power-EMA exponent γ) must lie between 0 and 1e+06, got '-1'",
     "--gamma (the power-EMA exponent γ) must lie between 0 and 1e+06, got '-1'"),
    (lambda: parse_gamma_list("7,x"),
     "gammas must be a number, got 'x'",
     "--gamma must be a number, got 'x'"),
    (lambda: posthoc_plan([Snapshot(t, 6.94) for t in (1000, 2000)], 6.94, at_step=1500),
     "at_step 1500 is not a snapshot step; a post-hoc EMA ends at one: step 1000 or 2000",
     "--at-step 1500 is not a snapshot step; a post-hoc EMA ends at one: step 1000 or 2000"),
]


@pytest.mark.parametrize(("call", "library", "cli"), CASES)
def test_library_and_cli_wording(call, library, cli):
    err = _raised(call)
    assert isinstance(err, OptionError) and err.exit_code == 2
    assert str(err) == library
    assert "--" not in str(err)
    assert error_message(err) == (cli, 2)


def test_option_errors_carry_the_parameter_and_value():
    err = _raised(power_coefficients, [10, 20], 1.0, at_step=5)
    assert (err.option, err.value, err.parameters) == ("at_step", 5, ("at_step",))
    conflict = _raised(ExponentialProfile, 0.9, per_checkpoint=True, warmup=True)
    assert conflict.option == "warmup" and conflict.parameters == ("warmup", "per_checkpoint")
    assert isinstance(conflict, UsageError) and isinstance(conflict, ValueError)  # what callers catch today


def test_remedies_are_data():
    err = ManifestMismatchError("ema was made with decay 0.9, not 0.99; pass {restart=True} to start over",
                                remedy="restart")
    assert err.remedy == "restart" and err.exit_code == 5
    assert str(err) == "ema was made with decay 0.9, not 0.99; pass restart=True to start over"
    assert error_message(err) == ("ema was made with decay 0.9, not 0.99; pass --restart to start over", 5)
    nan = NonFiniteError(2, "step_3: key 'w' holds NaN or Inf (pass {skip_nonfinite=True} to skip that "
                            "checkpoint)", remedy="skip_nonfinite")
    assert nan.source == 2
    assert error_message(nan)[0].endswith("(pass --skip-nonfinite to skip that checkpoint)")
    waiting = UsageError("retry later or pass {wait_seconds=SECONDS}", remedy="wait_seconds")
    assert str(waiting) == "retry later or pass wait_seconds=SECONDS"
    assert error_message(waiting)[0] == "retry later or pass --wait SECONDS"


def test_text_from_users_or_checkpoints_is_never_a_placeholder():
    err = CheckpointFormatError("/ckpts/{at_step}/x{y}", "key '{z}' is odd; pass {overwrite=True}",
                                remedy="overwrite")
    assert str(err) == "/ckpts/{at_step}/x{y}: key '{z}' is odd; pass overwrite=True"
    assert error_message(err)[0] == "/ckpts/{at_step}/x{y}: key '{z}' is odd; pass --overwrite"
    plain = UsageError("no {decay} here")  # declares nothing: the braces are text
    assert str(plain) == error_message(plain)[0] == "no {decay} here"


@pytest.mark.parametrize("err", [
    OptionError("at_step", "5 is before the first checkpoint (step 10)", value=5),
    NonFiniteError(4, "bad values; pass {skip_nonfinite=True}", remedy="skip_nonfinite"),
    CheckpointFormatError("/x/.metadata", "truncated"),
    ManifestMismatchError("pass {restart=True}", remedy="restart"),
])
def test_errors_cross_processes_whole(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__
    assert error_message(back) == error_message(err)


def test_errors_without_data_read_as_before():
    assert str(UsageError("no checkpoints to combine")) == "no checkpoints to combine"
    assert error_message(CheckpointFormatError("/a", "bad")) == ("/a: bad", 3)


@pytest.mark.parametrize(("args", "line"), [
    (["--decay", "1.5"], "error: --decay must lie strictly between 0 and 1, got 1.5"),
    (["--half-life", "-2"], "error: --half-life must be a positive number of steps, got -2.0"),
    (["--decay", "0.9", "--per-checkpoint", "--warmup"],
     "error: --warmup counts optimizer steps; it cannot be combined with --per-checkpoint"),
    (["--sigma-rel", "abc"], "error: --sigma-rel: 'abc' is not a number or a start:stop:step range"),
    (["--gamma", "-1"], "error: --gamma (the power-EMA exponent γ) must lie between 0 and 1e+06, got '-1'"),
])
def test_the_cli_words_library_errors_with_its_flags(tmp_path, args, line):
    from typer.testing import CliRunner

    from ema_ckpt.cli import app

    result = CliRunner().invoke(app, ["accumulate", str(tmp_path), *args, "--dry-run"])
    assert result.exit_code == 2 and result.output.strip() == line, result.output


# --------------------------------------------------------------------------- notes and warnings, every module


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_the_library_names_no_flag_outside_the_cli():
    import re

    flag = re.compile(r"(?<![\w-])--[a-z]")
    for path in sorted(PACKAGE.rglob("*.py")):
        if "cli" in path.relative_to(PACKAGE).parts or path.name == "_entry.py":
            continue  # _entry: the console script's entry point, which reads the words ahead of the CLI
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                assert not flag.search(node.value), f"{path.relative_to(PACKAGE)}: {node.value!r}"


def test_notes_read_as_text_and_keep_their_placeholders():
    from ema_ckpt.cli._flags import cli_json, cli_text
    from ema_ckpt.errors import Note

    note = Note("skipped /c/step_2: left out ({skip})", mentions=("skip",))
    assert note == "skipped /c/step_2: left out (skip)" and isinstance(note, str)
    assert cli_text(note) == "skipped /c/step_2: left out (--skip)"
    longer = "(" + note + "); " + Note("see {step_regex}", mentions=("step_regex",))
    assert isinstance(longer, Note) and longer.mentions == ("skip", "step_regex")
    assert cli_text(longer) == "(skipped /c/step_2: left out (--skip)); see --step-regex"
    assert pickle.loads(pickle.dumps(longer)).render(flag_for) == cli_text(longer)
    assert cli_text("plain {skip} text") == "plain {skip} text"
    assert cli_json({"notes": [note], "n": 1, "nested": ({"w": note},)}) == {
        "notes": ["skipped /c/step_2: left out (--skip)"], "n": 1,
        "nested": [{"w": "skipped /c/step_2: left out (--skip)"}]}
    err = CheckpointFormatError("/c", "no checkpoints found (" + Note.joined("; ", [note, "other"]) + ")")
    assert str(err) == "/c: no checkpoints found (skipped /c/step_2: left out (skip); other)"
    assert error_message(err)[0] == "/c: no checkpoints found (skipped /c/step_2: left out (--skip); other)"


def test_an_error_built_on_another_keeps_both_placeholders():
    inner = CheckpointFormatError("/c/step_2", "rebuild it with {restart=True}", remedy="restart")
    outer = CheckpointFormatError(inner.path, inner.note() + " (pass {skip_damaged=True})", remedy="skip_damaged")
    assert str(outer) == "/c/step_2: /c/step_2: rebuild it with restart=True (pass skip_damaged=True)"
    assert error_message(outer)[0] == "/c/step_2: /c/step_2: rebuild it with --restart (pass --skip-damaged)"


def test_the_cli_words_notes_on_stderr_and_in_json(tmp_path):
    from typer.testing import CliRunner

    from ema_ckpt.cli import app
    from tests.dcp_helpers import write_dcp

    for step in (1, 2):
        write_dcp(tmp_path / f"step_{step}", {"model.w": torch.ones(2) * step})
    runner = CliRunner()
    args = ["accumulate", str(tmp_path), "--decay", "0.9", "--skip", str(tmp_path / "step_2"), "--dry-run"]
    shown = runner.invoke(app, args)
    assert shown.exit_code == 0 and f"skipped {tmp_path / 'step_2'}: left out (--skip)" in shown.output
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0
    assert json.loads(as_json.stdout)["notes"] == [f"skipped {tmp_path / 'step_2'}: left out (--skip)"]
