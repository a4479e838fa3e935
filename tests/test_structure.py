"""Rules of the package's shape that hold after every change: small modules that each say their
one job, commands that do not import each other, and the job runner kept to the order of a run."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ema_ckpt"
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _lines(module: Path) -> int:
    return len(module.read_text().splitlines())


def test_every_module_is_under_500_lines():
    long = {str(p.relative_to(PACKAGE)): _lines(p) for p in _modules() if _lines(p) >= MAX_LINES}
    assert long == {}


def test_the_job_runner_stays_small():
    assert _lines(PACKAGE / "jobs.py") < 450


def test_every_module_says_its_job_in_its_first_docstring_line():
    missing = []
    for module in _modules():
        doc = ast.get_docstring(ast.parse(module.read_text()))
        if not doc or len(doc.splitlines()[0].strip()) < 10:
            missing.append(str(module.relative_to(PACKAGE)))
    assert missing == []


def test_commands_do_not_import_each_other():
    """What two commands share lives a floor down (selection, integrity, jobs), not in a command."""
    commands = {p.stem for p in (PACKAGE / "commands").glob("*.py")} - {"__init__"}
    found = []
    for module in (PACKAGE / "commands").glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in commands:
                found.append(f"{module.stem} -> {node.module}")
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module == "commands":
                found.append(f"{module.stem} -> commands")
    assert found == []
