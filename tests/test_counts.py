"""One honest byte count: what a summary calls written is the files on disk, counted as they are
named; the progress bar counts in the summaries' binary units and knows its total before it
draws one.

The bar is read from a real pseudo-terminal, as a user sees it (escape sequences stripped).
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.cli._output import human_bytes, plural
from tests.dcp_helpers import write_dcp

runner = CliRunner()
EMA_CKPT = str(Path(sys.executable).with_name("ema-ckpt"))
REPO = Path(__file__).resolve().parents[1]


def _disk(path: Path) -> tuple[int, int]:
    """(files, bytes) of a file or of every file under a directory."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


@pytest.fixture
def ckpts(tmp_path) -> Path:
    for step in (10, 20, 30):
        state = {f"model.layer{i}.weight": torch.full((64, 64), float(step + i)) for i in range(6)}
        write_dcp(tmp_path / "ckpts" / f"step_{step}", state, world_size=2)
    return tmp_path / "ckpts"


def _summary(result) -> str:
    assert result.exit_code == 0, result.output
    return result.stdout.strip().splitlines()[-1]


def test_consolidate_counts_shards_and_index_and_the_bytes_on_disk(ckpts, tmp_path):
    out = tmp_path / "hf"
    result = runner.invoke(app, ["consolidate", str(ckpts / "step_30"), "--out", f"{out}/", "--max-shard-size", "20KB"])
    files, size = _disk(out)
    assert files == 7  # six shards of one 16 KiB tensor each, and the index
    assert _summary(result).startswith(f"{out}: hf-sharded, 6 tensors in 6 shards + index, {human_bytes(size)} ")
    doc = json.loads(runner.invoke(app, ["consolidate", str(ckpts / "step_30"), "--out", f"{out}/", "--overwrite",
                                         "--max-shard-size", "20KB", "--json"]).stdout)
    assert doc["bytes_written"] == size and len(doc["files"]) == files
    assert doc["index"] == "model.safetensors.index.json"
    one = runner.invoke(app, ["consolidate", str(ckpts / "step_30"), "--out", str(tmp_path / "m.safetensors")])
    assert " 6 tensors in 1 file, " in _summary(one)
    single = runner.invoke(app, ["consolidate", str(ckpts / "step_30"), "--out", f"{tmp_path}/whole/"])
    assert " in 1 shard, " in _summary(single) and "index" not in _summary(single)


def test_accumulate_and_posthoc_count_the_files_they_wrote(ckpts, tmp_path):
    ema = tmp_path / "ema"
    result = runner.invoke(app, ["accumulate", str(ckpts), "--decay", "0.9", "--out", str(ema)])
    files, size = _disk(ema)
    line = result.stdout.strip().splitlines()[0]
    assert result.exit_code == 0 and "folded steps 10, 20, 30;" in line, result.output
    assert f"{human_bytes(size)} written in {plural(files, 'file')}" in line and "of tensors read" in line
    assert "(s)" not in result.output
    write_dcp(ckpts / "step_40", {f"model.layer{i}.weight": torch.zeros(64, 64) for i in range(6)}, world_size=2)
    again = runner.invoke(app, ["accumulate", str(ckpts), "--decay", "0.9", "--out", str(ema), "--json"])
    doc = json.loads(again.stdout)
    assert (doc["files_written"], doc["bytes_written"]) == _disk(ema)
    once = runner.invoke(app, ["accumulate", str(ckpts / "step_10"), "--decay", "0.9", "--out", str(tmp_path / "e1")])
    assert "folded step 10;" in once.stdout, once.output
    ph = tmp_path / "ph"
    result = runner.invoke(app, ["posthoc", str(ckpts), "--sigma-rel", "0.1,0.2", "--out", str(ph)])
    files, size = _disk(ph)
    assert result.exit_code == 0, result.output
    assert f"for 2 outputs, {human_bytes(size)} written in {plural(files, 'file')}," in result.stdout
    assert ": step 40, 4 inputs" in result.stdout and "(s)" not in result.output
    doc = json.loads(runner.invoke(app, ["average", str(ckpts), "--last", "1", "--out", str(tmp_path / "a"),
                                         "--json"]).stdout)
    assert (doc["files_written"], doc["bytes_written"]) == _disk(tmp_path / "a")


def test_reshard_counts_every_file(ckpts, tmp_path):
    out = tmp_path / "r3"
    result = runner.invoke(app, ["reshard", str(ckpts / "step_30"), "--world-size", "3", "--out", str(out)])
    files, size = _disk(out)
    assert f": 6 tensors for 3 ranks, {human_bytes(size)} written in {plural(files, 'file')}, " in _summary(result)
    one = runner.invoke(app, ["reshard", str(ckpts / "step_30"), "--world-size", "1", "--out", str(tmp_path / "r1")])
    assert "for 1 rank, " in _summary(one)


# --- the progress bar, on a real terminal --------------------------------------------------

_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[=>]")


def _screen_lines(args: list[str], columns: int = 80) -> tuple[int, list[str]]:
    """Every line the program drew on a pseudo-terminal of ``columns`` columns, escapes removed."""
    main, child = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(columns), "LINES": "24", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([EMA_CKPT, *args], stdin=child, stdout=child, stderr=child, env=env, close_fds=True)
    os.close(child)
    chunks = []
    while True:
        ready, _, _ = select.select([main], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    code = proc.wait(timeout=60)
    text = _ESCAPE.sub("", b"".join(chunks).decode("utf-8", "replace"))
    return code, [line for line in re.split(r"[\r\n]", text) if line.strip()]


def test_the_bar_counts_binary_units_and_knows_its_total_before_it_draws_it(tmp_path):
    g = torch.Generator().manual_seed(0)
    for step in (10, 20, 30):
        state = {f"model.layer{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(8)}
        write_dcp(tmp_path / "big" / f"step_{step}", state, world_size=2)
    code, lines = _screen_lines(["accumulate", str(tmp_path / "big"), "--decay", "0.9"])
    assert code == 0, lines
    bars = [line for line in lines if line.startswith("accumulate ")]
    assert bars and all(len(line) <= 80 for line in bars), bars
    counted = [line for line in bars if " / " in line]
    assert counted, bars  # the bar drew figures
    totals = {re.search(r" / ([\d.]+ [KMG]iB)", line).group(1) for line in counted}
    read = human_bytes(3 * 8 * 1024 * 1024 * 4)  # each checkpoint's tensors, read once
    assert totals == {read}, counted  # one total, from the first frame on: what the summary says was read
    for line in bars:
        assert "?" not in line and " kB" not in line and " MB" not in line and "-:--:--" not in line, line
        assert " / " in line or "planning…" in line, line
    assert re.search(r"\d+(\.\d)? [KMG]iB/s", " ".join(counted)), counted
    start = next((i for i, line in enumerate(lines) if "folded" in line), None)
    assert start is not None, lines
    # on a terminal, a long summary wraps between words (where depends on the run's timings)
    summary = " ".join(" ".join(lines[start:start + 3]).split())
    assert re.search(rf"{read} of tensors read, [\d.]+ MiB written in \d+ files", summary), summary
