"""The documentation: the CLI reference is current, the site builds with --strict, tables match the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from ema_ckpt import errors

REPO = Path(__file__).resolve().parents[1]


def test_cli_reference_is_current(tmp_path):
    typer_bin = Path(sys.executable).with_name("typer")
    out = tmp_path / "cli.md"
    subprocess.run([str(typer_bin), "ema_ckpt.cli", "utils", "docs", "--name", "ema-ckpt", "--output", str(out)],
                   check=True, capture_output=True, cwd=REPO)
    assert out.read_text() == (REPO / "docs" / "cli.md").read_text(), "docs/cli.md is stale: run `make docs`"


def test_site_builds_strict(tmp_path):
    """Broken links or anchors, pages missing from the nav, API docstrings griffe cannot parse: all fail."""
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert (site / "index.html").is_file()
    assert (site / "api" / "commands" / "index.html").is_file()
    assert "ema_ckpt.commands.accumulate.accumulate" in (site / "api" / "commands" / "index.html").read_text()


def test_exit_code_table_matches_errors():
    """docs/api/errors.md lists every error class with the exit code it carries."""
    table = (REPO / "docs" / "api" / "errors.md").read_text()
    documented: dict[str, int] = {}
    for names, code in re.findall(r"^\| (.+?) \| (\d+) \|$", table, flags=re.MULTILINE):
        for name in re.findall(r"`(\w+)`", names):
            documented[name] = int(code)
    actual = {name: cls.exit_code for name, cls in vars(errors).items()
              if isinstance(cls, type) and issubclass(cls, errors.EmaCkptError)}
    assert documented == actual
