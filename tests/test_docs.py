"""The committed CLI reference matches the commands' help (regenerate with ``make docs``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cli_reference_is_current(tmp_path):
    typer_bin = Path(sys.executable).with_name("typer")
    out = tmp_path / "cli.md"
    subprocess.run([str(typer_bin), "ema_ckpt.cli", "utils", "docs", "--name", "ema-ckpt", "--output", str(out)],
                   check=True, capture_output=True, cwd=REPO)
    assert out.read_text() == (REPO / "docs" / "cli.md").read_text(), "docs/cli.md is stale: run `make docs`"
