"""One exit-code table, ``ema_ckpt.errors.EXIT_CODES``: error classes, CLI, ``--help`` and docs follow it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ema_ckpt import _signals, dist, errors
from ema_ckpt._compat.fast_exit import FLUSH_FAILED_EXIT
from ema_ckpt.cli import _errors, app

REPO = Path(__file__).resolve().parents[1]
CODES = [row.code for row in errors.EXIT_CODES]


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def test_the_table_is_ordered_and_complete():
    assert sorted(set(CODES)) == CODES
    assert CODES == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 75, 120, 130, 143]
    assert all(row.meaning and "\n" not in row.meaning for row in errors.EXIT_CODES)


def test_every_error_class_exits_with_a_code_of_the_table():
    classes = [errors.EmaCkptError, *_subclasses(errors.EmaCkptError)]
    assert dist.WorkerFailed in classes  # subclasses outside errors.py are seen too
    wrong = {cls.__name__: cls.exit_code for cls in classes if cls.exit_code not in CODES}
    assert not wrong, f"exit codes missing from ema_ckpt.errors.EXIT_CODES: {wrong}"


def test_every_code_of_an_error_class_is_raised_by_one():
    """The codes 1-10 and 75 are the error classes'; the rest come from the CLI and signals."""
    raised = {cls.exit_code for cls in [errors.EmaCkptError, *_subclasses(errors.EmaCkptError)]}
    assert raised == {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 75}


def test_the_cli_and_signal_codes_are_in_the_table():
    for code in (_errors.INTERNAL_ERROR, _errors.OS_ERROR, _signals.INTERRUPTED_EXIT, _signals.TERMINATED_EXIT,
                 FLUSH_FAILED_EXIT):
        assert code in CODES
    assert (_signals.INTERRUPTED_EXIT, _signals.TERMINATED_EXIT) == (130, 143)


def test_help_lists_every_code_from_the_table():
    result = CliRunner().invoke(app, ["--help"], prog_name="ema-ckpt", env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    listed = result.output.split("Exit codes:", 1)[1]
    for row in errors.EXIT_CODES:
        meaning = errors.worded(row.meaning, _errors.flag_for)
        assert re.search(rf"^\s*{row.code}\s+{re.escape(meaning)}\s*$", listed, flags=re.MULTILINE), meaning
    assert "--restart starts over" in listed and "--wait SECONDS" in listed  # worded as flags


def test_cli_reference_shows_the_table():
    assert _errors.exit_codes_help() in (REPO / "docs" / "cli.md").read_text()


def _table_codes(path: Path) -> list[int]:
    """The code column of the markdown table under the ``## Exit codes`` heading of ``path``."""
    text = path.read_text(encoding="utf-8")
    section = text.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows[0].split("|")[1].strip() == "code" and set(rows[1]) <= set("|-: "), rows[:2]
    return [int(code) for row in rows[2:] for code in re.findall(r"\d+", row.split("|")[1])]


@pytest.mark.parametrize("doc", ["README.md", "docs/reliability.md"])
def test_doc_tables_list_exactly_the_codes(doc):
    codes = _table_codes(REPO / doc)
    assert sorted(codes) == CODES, f"{doc}: its exit-code table must list exactly {CODES}"


def test_cron_recipe_lists_only_codes_of_the_table():
    assert set(_table_codes(REPO / "docs" / "recipes" / "cron.md")) <= set(CODES)
