"""An output path says what it is, or the run is refused: a typo never becomes a directory.

``consolidate`` takes a suffix the output registry knows, an existing directory, a path ending
in ``/``, a name without a file suffix (a directory, as ``save_pretrained`` makes) or
``--format NAME``; DCP directory outputs refuse a file format's suffix. The check is the
library's (``OptionError``); the CLI words it as one line, exit 2.
"""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.commands.consolidate import consolidate
from ema_ckpt.errors import OptionError
from ema_ckpt.writers import base
from ema_ckpt.writers.base import choose_output_format, path_formats
from tests.dcp_helpers import write_dcp

runner = CliRunner()
SUFFIXES = [suffix for fmt in path_formats() for suffix in fmt.suffixes]


@pytest.fixture
def ckpt(tmp_path) -> Path:
    state = {f"model.layer{i}.weight": torch.full((16, 8), float(i)) for i in range(3)}
    return write_dcp(tmp_path / "ckpts" / "step_10", state, world_size=2)


def _refused(result, *fragments: str) -> str:
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    for fragment in fragments:
        assert fragment in line, line
    return line


def _nothing_written(folder: Path, *names: str) -> None:
    left = sorted(p.name for p in folder.iterdir())
    assert not [n for n in left if n in names or n.endswith(".lock") or ".tmp-" in n], left


@pytest.mark.parametrize(("out", "hint"), [
    ("weird.txt", "unknown output suffix .txt;"),
    ("ema.safetensor", "unknown output suffix .safetensor (did you mean ema.safetensors?)"),
    ("model.bi", "unknown output suffix .bi (did you mean model.bin?)"),
    ("model.v2", "unknown output suffix .v2;"),
])
def test_a_path_that_names_no_format_is_refused(ckpt, tmp_path, out, hint):
    result = runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / out)])
    line = _refused(result, f"error: --out {tmp_path / out}: {hint}", "a path ending in " + ", ".join(SUFFIXES[:-1]),
                    "a directory for hf-sharded (an existing one, or a path ending in /)",
                    "or pass --format NAME (safetensors, hf-sharded, torch, lightning)")
    assert "did you mean" not in line or out in ("ema.safetensor", "model.bi")
    _nothing_written(tmp_path, out)


def test_the_forms_accepted(ckpt, tmp_path):
    slash = runner.invoke(app, ["consolidate", str(ckpt), "--out", f"{tmp_path}/hf/", "--max-shard-size", "1KB"])
    assert slash.exit_code == 0, slash.output
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    (tmp_path / "existing").mkdir()
    existing = runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / "existing"), "--overwrite"])
    assert existing.exit_code == 0 and (tmp_path / "existing" / "model.safetensors").is_file(), existing.output
    named = runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / "weights"), "--format", "torch"])
    assert named.exit_code == 0, named.output
    assert set(torch.load(tmp_path / "weights", weights_only=True)) == {f"layer{i}.weight" for i in range(3)}
    as_st = runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / "w2"), "--format", "safetensors"])
    assert as_st.exit_code == 0 and len(load_file(tmp_path / "w2")) == 3, as_st.output
    folder = runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / "d"), "--format", "hf-sharded"])
    assert folder.exit_code == 0 and (tmp_path / "d" / "model.safetensors").is_file(), folder.output
    upper = runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / "M.SAFETENSORS"), "--json"])
    assert upper.exit_code == 0 and json.loads(upper.stdout)["layout"] == "safetensors"
    for name in ("hf_ema", "llama-3.1-ema"):  # no file suffix: a new directory, as save_pretrained makes
        named_dir = runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / name), "--json"])
        assert named_dir.exit_code == 0 and json.loads(named_dir.stdout)["layout"] == "hf-sharded", named_dir.output
        assert (tmp_path / name / "model.safetensors").is_file()


def test_format_must_fit_the_path(ckpt, tmp_path):
    _refused(runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / "x.pt"), "--format", "safetensors"]),
             f"--format safetensors does not match --out {tmp_path / 'x.pt'} (its suffix .pt is torch)")
    _refused(runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / "x"), "--format", "npz"]),
             "--format must be one of safetensors, hf-sharded, torch, lightning, got 'npz'")
    _refused(runner.invoke(app, ["consolidate", str(ckpt), "--out", f"{tmp_path}/", "--format", "torch"]),
             "--format torch writes one file, but --out")
    _refused(runner.invoke(app, ["consolidate", str(ckpt), "--out", f"{tmp_path}/m.safetensors/"]),
             "a directory whose name ends in .safetensors (safetensors) would be mistaken for one file")
    _nothing_written(tmp_path, "x.pt", "x", "m.safetensors")


def test_help_lists_the_registered_formats():
    result = runner.invoke(app, ["consolidate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--format" in result.stdout
    assert all(fmt.name in result.stdout for fmt in path_formats())


def test_the_check_is_the_librarys(ckpt, tmp_path):
    with pytest.raises(OptionError, match=r"^out .*ema\.safetensor: unknown output suffix") as caught:
        consolidate(ckpt, tmp_path / "ema.safetensor")
    assert caught.value.option == "out" and "format=NAME" in str(caught.value)
    with pytest.raises(OptionError) as caught:
        consolidate(ckpt, tmp_path / "x.bin", format="safetensors")
    assert caught.value.option == "format"
    result = consolidate(ckpt, f"{tmp_path}/lib/", max_shard_size="1KB")  # a str keeps its trailing /
    assert result.layout == "hf-sharded" and result.index == "model.safetensors.index.json"
    assert choose_output_format(tmp_path / "lib").name == "hf-sharded"  # now an existing directory
    assert doctest.testmod(base, optionflags=doctest.ELLIPSIS).failed == 0


def test_the_accepted_suffixes_come_from_the_registry():
    formats = base.registered_outputs()
    assert {fmt.name for fmt in path_formats()} == {n for n, f in formats.items() if f.suffixes or f.is_default}
    for fmt in path_formats():
        for suffix in fmt.suffixes:
            assert choose_output_format(f"model{suffix}") is fmt


@pytest.mark.parametrize("command", [
    ["reshard", "{ckpt}", "--world-size", "2", "--out", "{tmp}/ema.safetensors"],
    ["accumulate", "{ckpts}", "--decay", "0.9", "--out", "{tmp}/ema.pt"],
    ["posthoc", "{ckpts}", "--sigma-rel", "0.1", "--out", "{tmp}/ph.safetensors"],
    ["average", "{ckpts}", "--last", "1", "--out", "{tmp}/avg.bin"],
], ids=["reshard", "accumulate", "posthoc", "average"])
def test_directory_outputs_refuse_a_file_suffix(ckpt, tmp_path, command):
    args = [a.format(ckpt=ckpt, ckpts=ckpt.parent, tmp=tmp_path) for a in command]
    _refused(runner.invoke(app, args), "error: --out ", "a dcp directory here would be taken for a",
             "name it otherwise, or write one file with consolidate")
    _nothing_written(tmp_path, "ema.safetensors", "ema.pt", "ph.safetensors", "avg.bin")


def test_a_shard_size_for_a_one_file_output_is_refused(ckpt, tmp_path):
    _refused(runner.invoke(app, ["consolidate", str(ckpt), "--out", str(tmp_path / "m.safetensors"),
                                 "--max-shard-size", "2GB"]),
             f"--max-shard-size shards a directory output, but --out {tmp_path / 'm.safetensors'} is one "
             "safetensors file; name a directory (no file suffix) to shard it")
    _nothing_written(tmp_path, "m.safetensors")
