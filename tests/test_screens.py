"""What a user sees: the real CLI in a real terminal (tmux) at 80 and 200 columns.

Each screen is read back with ``capture-pane`` and checked the way a reader would: every key
or checkpoint can be told apart from its neighbours (its distinguishing tail is on screen,
never cut), no two table rows are the same, no raw Python (``None``, ``{'a': 1}``) shows, and
the progress bar counts in the summaries' units with its total known from the first frame.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.terminal import Screen, run_in_terminal

WIDTHS = [80, 200]
TRAINERS = Path(__file__).parent / "fixtures" / "trainers"
CLI = str(Path(sys.executable).with_name("ema-ckpt"))
_REPR = re.compile(r"(?<![\w.])(None|True|False)(?![\w.])|\{'|\['|\{\}|\[\]|\bdtype\(|torch\.\w+\(")


def _cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def _screen(width: int, *args: str | Path, cwd: Path | None = None) -> Screen:
    return run_in_terminal([CLI, *map(str, args)], width=width, cwd=cwd)


def _table_rows(lines: list[str]) -> list[list[str]]:
    """The body rows of every rich table on the screen, a row's folded lines joined per cell."""
    rows: list[list[str]] = []
    in_body = False
    for line in lines:
        if "┃" in line:  # a header line
            in_body = False
            continue
        if set(line.strip()) <= set("━╇╋┿━─┼╂┃│ ") and "━" in line:
            in_body = True
            continue
        if not in_body or "│" not in line:
            in_body = in_body and "│" in line
            continue
        cells = [c.strip() for c in line.split("│")]
        if rows and not any(cells[1:]) and cells[0]:
            rows[-1][0] += cells[0]  # the name column folded onto another line
        elif rows and cells[0] == "" and any(cells[1:]) and len(rows[-1]) == len(cells):
            for i, cell in enumerate(cells):  # another folded column of the same row
                if cell:
                    rows[-1][i] += cell
        else:
            rows.append(cells)
    return rows


def _distinguishing_tail(name: str, names: list[str], separator: str = ".") -> str:
    """The shortest ``separator``-suffix of ``name`` that no other name ends with."""
    parts = name.split(separator)
    for size in range(1, len(parts) + 1):
        tail = separator.join(parts[-size:])
        if not any(other != name and (other == tail or other.endswith(separator + tail)) for other in names):
            return tail
    return name


def _assert_readable(screen: Screen, names: list[str], *, separator: str = ".", column: int = 0) -> None:
    rows = _table_rows(screen.lines)
    assert rows, screen.text
    shown = ["".join(r[column].split()) for r in rows]
    assert len(set(map(tuple, rows))) == len(rows), "two table rows read the same:\n" + screen.text
    for name in names:
        tail = "".join(_distinguishing_tail(name, names, separator).split())
        assert any(tail in cell and "…" not in cell[cell.find(tail):cell.find(tail) + len(tail)] for cell in shown), (
            f"{name!r}: its tail {tail!r} is not visible:\n" + screen.text)
    for line in screen.lines:
        assert not _REPR.search(line), f"raw Python on screen: {line!r}\n" + screen.text


REFUSED_LAYOUTS = {"mmengine-runner"}
"""Sets whose every file is refused, naming why (mmengine pickles ``builtins.getattr`` in its
``message_hub``: a function is never read as data); tests/test_trainer_layouts.py checks the refusal."""
TRAINER_LAYOUTS = sorted(p.name for p in TRAINERS.iterdir() if p.is_dir() and p.name not in REFUSED_LAYOUTS) if (
    TRAINERS.is_dir()) else []


def _keys(path: Path) -> list[str]:
    """Every key ``inspect --json`` lists for ``path`` (the library's report, in this process)."""
    import ema_ckpt

    return [t["key"] for t in ema_ckpt.inspect(path).to_dict()["tensors"]]


@functools.cache
def _first_checkpoint(layout: str) -> Path | None:
    """The first checkpoint (depth first, by name) a trainer's set holds, or None."""
    import ema_ckpt
    from ema_ckpt.errors import EmaCkptError

    for path in sorted(p for p in (TRAINERS / layout).rglob("*") if "oracle" not in p.parts):
        if path.is_dir() or path.suffix in (".safetensors", ".pt", ".bin", ".ckpt", ".pth", ".tar"):
            try:
                ema_ckpt.inspect(path)
            except EmaCkptError:
                continue
            return path
    return None


def _summary_labels(screen: Screen) -> list[str]:
    """The labels of the summary above the first table (continuation lines start with a space)."""
    labels = []
    for line in screen.lines:
        if "┃" in line:
            break
        if line and not line.startswith(" "):
            labels.append(re.split(r"\s{2,}", line.strip(), maxsplit=1)[0])
    return labels


@pytest.mark.parametrize("width", WIDTHS)
def test_inspect_shows_every_key_of_an_fsdp_checkpoint_with_its_optimizer_state(fsdp_sequence, width):
    last = fsdp_sequence("fsdp2", 2, with_optim=True)[-1]
    keys = _keys(last)
    assert any(k.endswith("exp_avg") for k in keys) and any(k.endswith("exp_avg_sq") for k in keys)
    screen = _screen(width, "inspect", last, "--all")
    assert screen.exit_code == 0, screen.text
    _assert_readable(screen, keys)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("layout", TRAINER_LAYOUTS)
def test_inspect_reads_well_on_every_trainers_layout(layout, width):
    path = _first_checkpoint(layout)
    assert path is not None, f"{layout}: no checkpoint found"
    keys = _keys(path)
    screen = _screen(width, "inspect", path, "--all")
    assert screen.exit_code == 0, screen.text
    _assert_readable(screen, keys)
    labels = _summary_labels(screen)
    assert len(labels) == len(set(labels)), f"a summary row appears twice: {labels}\n" + screen.text


@pytest.mark.parametrize("width", WIDTHS)
def test_diff_rows_name_each_key_whole(fsdp_sequence, tmp_path, width):
    first, *_, last = fsdp_sequence("fsdp2", 2, with_optim=True)
    keys = _keys(last)
    screen = _screen(width, "diff", first, last)
    assert screen.exit_code == 4, screen.text
    _assert_readable(screen, keys)


@pytest.mark.parametrize("width", WIDTHS)
def test_posthoc_dry_run_tells_every_input_apart(fsdp_sequence, tmp_path, width):
    ckpts = fsdp_sequence("fsdp2", 2)
    screen = _screen(width, "posthoc", ckpts[0].parent, "--sigma-rel", "0.05,0.1", "--out", tmp_path / "ph",
                     "--dry-run")
    assert screen.exit_code == 0, screen.text
    _assert_readable(screen, [p.name for p in ckpts], separator="/")
    assert not (tmp_path / "ph").exists()


@pytest.fixture(scope="module")
def large_sequence(tmp_path_factory) -> Path:
    """Three 96 MiB DCP checkpoints (dcp.save): long enough for the progress bar to be drawn."""
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("large") / "ckpts"
    generator = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(1024, 2048, generator=generator) for i in range(12)}
    for step in (100, 250, 400):
        for tensor in state.values():
            tensor.add_(0.01)
        with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
            dcp.save(state, checkpoint_id=root / f"step_{step}")
    return root


_DECIMAL_UNITS = re.compile(r"\d\s?(kB|MB|GB)\b|\d\s?(kB|MB|GB)/s")


@pytest.mark.parametrize("width", WIDTHS)
def test_accumulate_progress_counts_in_the_summarys_units_with_its_total(large_sequence, tmp_path, width):
    screen = run_in_terminal([CLI, "accumulate", str(large_sequence), "--decay", "0.99", "--out",
                              str(tmp_path / "ema")], width=width, sample_every=0.01)
    assert screen.exit_code == 0, screen.text
    bars = [f for f in screen.frames if "━" in f or "█" in f or "%" in f]
    assert bars, "no progress frame was seen:\n" + "\n----\n".join(screen.frames)
    for frame in screen.frames:
        assert "?" not in frame, "a frame without its total:\n" + frame
        assert not _DECIMAL_UNITS.search(frame), "decimal units on the bar:\n" + frame
    assert any(re.search(r"\d(\.\d)? (KiB|MiB|GiB)", f) for f in bars)
    written = sum(p.stat().st_size for p in (tmp_path / "ema").rglob("*") if p.is_file())
    for line in screen.lines:
        assert not _REPR.search(line), line
    mentioned = re.findall(r"([\d.]+) (KiB|MiB|GiB) written", screen.text)
    for value, unit in mentioned:  # "written" is what is on disk
        factor = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
        assert abs(float(value) * factor - written) <= 0.06 * factor, (value, unit, written, screen.text)


def test_the_screens_in_the_docs_are_current():
    """docs/*.md show screens captured by docs/make_screens.py; they must match today's CLI."""
    script = Path(__file__).parent.parent / "docs" / "make_screens.py"
    done = subprocess.run([sys.executable, str(script), "--check", "--cli", CLI], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
