"""What ``inspect``, ``diff``, ``verify`` and the ``--dry-run`` plans show, at 80 and 200 columns.

Every screen is rendered by the real CLI on checkpoints from the real producers (FSDP,
DeepSpeed, the safetensors library, ``torch.save``, the trainers' committed layouts) and read
back as text: each name column, its lines joined, must give back every key or path whole (so
the part that tells two rows apart is always on screen), no two rows may be the same, and no
summary value may look like a Python repr.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from rich.cells import cell_len
from safetensors.torch import save_file
from typer.testing import CliRunner

from ema_ckpt.cli import _output, app
from ema_ckpt.cli._output import human_bytes
from ema_ckpt.cli._tables import wrap_name
from ema_ckpt.cli.inspect import summary_rows
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.diff import diff
from ema_ckpt.commands.inspect import inspect_checkpoint
from ema_ckpt.commands.verify import verify
from ema_ckpt.manifest import Manifest
from ema_ckpt.writers.base import registered_outputs
from tests.ds_fixtures import Config
from tests.test_trainers import FIXTURES, checkpoints_of

runner = CliRunner()
WIDTHS = (80, 200)
TRAINER_SETS = sorted(p.name for p in FIXTURES.iterdir() if (p / "producer.json").is_file()
                      and p.name != "mmengine-runner")  # refused whole (tests/test_trainer_layouts.py)


@pytest.fixture(autouse=True)
def _width_from_columns(monkeypatch):
    """The consoles read the width from COLUMNS at each print, unless COLUMNS was set when they
    were made (then it is fixed): each test here chooses its width through COLUMNS."""
    for console in (_output.console, _output.err_console):
        monkeypatch.setattr(console, "_width", None)


def cli(*args: object, width: int = 80, code: int = 0):
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": str(width)})
    assert result.exit_code == code, (args, result.output)
    assert "Traceback" not in result.output
    return result


def table(text: str, header: str, width: int) -> list[tuple[str, ...]]:
    """The rows of the table whose first column is headed ``header``, each name's lines joined
    (a line whose other cells are all empty continues the row above)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "┃" in line and line.split("┃")[0].strip() == header)
    rows: list[list[str]] = []
    for line in lines[start + 2:]:
        if "│" not in line:
            break
        assert cell_len(line) <= width, line
        cells = [c.strip() for c in line.split("│")]
        if rows and not any(cells[1:]):
            rows[-1][0] += cells[0]
        else:
            rows.append(cells)
    return [tuple(r) for r in rows]


def assert_names_whole(rows: list[tuple[str, ...]], names: list[str]) -> None:
    assert [r[0] for r in rows] == names
    assert len(set(rows)) == len(rows), "two rows read the same"
    assert not any("…" in r[0] for r in rows)


# --- names: never cut -----------------------------------------------------------------------


def test_wrap_name_breaks_after_separators_and_keeps_every_character():
    key = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    for width in range(1, len(key) + 2):
        lines = wrap_name(key, width)
        assert "".join(lines) == key and all(cell_len(line) <= width for line in lines)
    assert wrap_name("optim.state.blocks.0.norm1.weight.exp_avg_sq", 34) == [
        "optim.state.blocks.0.norm1.weight.", "exp_avg_sq"]
    assert wrap_name("層.重み", 4) == ["層.", "重み"] and wrap_name("層.重み", 3) == ["層.", "重", "み"]


@pytest.fixture(scope="module")
def long_keys(tmp_path_factory) -> Path:
    """Keys as real trainers name them, long and alike but for their tails, in two DCP
    checkpoints whose values differ."""
    root = tmp_path_factory.mktemp("long-keys")
    keys = [
        *(f"optim.state.model.layers.{i}.self_attn.q_proj.weight.{s}"
          for i in (0, 1) for s in ("exp_avg", "exp_avg_sq")),
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias",
        "model.blocks.0.norm1.weight", "model.blocks.0.norm1.bias",
        "model.blocks.0.norm2.weight", "model.blocks.0.norm2.bias",
    ]
    import torch.distributed.checkpoint as dcp

    for step in (1, 2):
        dcp.save({k: torch.full((3, 2), float((i + 1) * step)) for i, k in enumerate(keys)},
                 checkpoint_id=str(root / f"step_{step}"), no_dist=True)
    return root


@pytest.mark.parametrize("width", WIDTHS)
def test_inspect_shows_every_key_whole(long_keys, fsdp_sequence, width):
    for path in (long_keys / "step_2", fsdp_sequence("fsdp1", 3, "float32", True)[-1],
                 FIXTURES / "megatron-torch-dist-tp2" / "iter_0000007"):
        out = cli("inspect", path, "--all", width=width).stdout
        keys = [t.key for t in inspect_checkpoint(path).tensors]
        assert_names_whole(table(out, "key", width), keys)


@pytest.mark.parametrize("width", WIDTHS)
def test_diff_rows_name_every_key_whole(long_keys, fsdp_sequence, tmp_path, width):
    a, b = long_keys / "step_1", long_keys / "step_2"
    out = cli("diff", a, b, width=width, code=4).stdout
    rows = table(out, "key", width)
    assert_names_whole(rows, [k.key_a for k in diff(a, b).keys])
    assert {r[-1] for r in rows} == {"differs"}
    # against its consolidated file: names paired without the container's model. prefix
    ckpt = fsdp_sequence("fsdp1", 3, "float32", True)[-1]
    cli("consolidate", ckpt, "--out", tmp_path / "m.safetensors", "--quiet")
    out = cli("diff", ckpt, tmp_path / "m.safetensors", "--include", "model.*", width=width).stdout
    names = [k.key_b for k in diff(ckpt, tmp_path / "m.safetensors", include=["model.*"]).keys]
    assert_names_whole(table(out, "key", width), names)
    assert "keys in A start with model., keys in B do not" in out and "'" not in out


@pytest.mark.parametrize("width", WIDTHS)
def test_plan_tables_show_every_input_whole(fsdp_sequence, tmp_path, width):
    ckpts = fsdp_sequence("fsdp2", 2)
    out = cli("posthoc", ckpts[0].parent, "--sigma-rel", "0.1,0.2", "--out", tmp_path / "ph", "--dry-run",
              width=width).stdout
    assert out.count("inputs in ") == 2
    for name in ("sigma_rel_0.1", "sigma_rel_0.2"):
        part = out[out.index(f"{name} at step"):]
        assert_names_whole(table(part, "input", width), [p.name for p in ckpts])
    # inputs in two folders with long names: each path whole, no common folder left out
    far = tmp_path / "a-rather-long-experiment-folder-name" / "run-2024-11-05-lr3e-4-wd0.1-seed1234-resumed"
    far.mkdir(parents=True)
    copies = [shutil.copytree(p, far / p.name) for p in ckpts[-2:]]
    inputs = [*ckpts[:2], *copies]
    args = ["average", *inputs, "--out", tmp_path / "avg", "--last", "4", "--dry-run"]
    out = cli(*args, width=width).stdout
    terms = json.loads(cli(*args, "--json").stdout)["outputs"][0]["terms"]
    common = os.path.commonpath([t["path"] for t in terms])
    rows = table(out, "input", width)
    assert_names_whole(rows, [os.path.relpath(t["path"], common) for t in terms])
    assert any("a-rather-long-experiment-folder-name" in r[0] for r in rows)
    assert all(r[-1] and set(r[-1]) <= set("█▏▎▍▌▋▊▉·") for r in rows), rows


# --- every output consolidate writes: inspect, diff, verify ------------------------------------


def _outputs() -> list[str]:
    suffixes = [suffix for fmt in registered_outputs().values() for suffix in fmt.suffixes]
    names = [f"out{suffix}" for suffix in suffixes] + [f"OUT{suffix.upper()}" for suffix in suffixes]
    if any(fmt.is_default for fmt in registered_outputs().values()):
        names += ["hf/", "hf-shards/"]
    return names


@pytest.mark.parametrize("name", _outputs())
def test_every_consolidate_output_is_read_back(fsdp_sequence, tmp_path, name):
    src = fsdp_sequence("fsdp2", 2)[-1]
    out = tmp_path / name.rstrip("/")
    extra = ["--max-shard-size", "2KB"] if name == "hf-shards/" else []
    cli("consolidate", src, "--out", str(out) + ("/" if name.endswith("/") else ""), *extra, "--quiet")
    if name == "hf-shards/":
        assert (out / "model.safetensors.index.json").is_file()
    text = cli("inspect", out).stdout
    report = json.loads(cli("inspect", out, "--json").stdout)
    assert report["keys"] == len(inspect_checkpoint(src).tensors) and report["path"] == str(out)
    assert "step" in text
    assert "keys equal" in cli("diff", src, out).stdout
    assert json.loads(cli("diff", src, out, "--json").stdout)["equal"]
    assert "OK" in cli("verify", out).stdout


# --- inspect's summary: each fact once, no raw Python --------------------------------------------

REPR = re.compile(r"^(None|True|False|\{.*\}|\[.*\]|\(.*,.*\))$|'[^']*'|\bNone\b")


def assert_plain_summary(path: Path, width: int = 80) -> None:
    report = inspect_checkpoint(path)
    rows = summary_rows(report)
    labels = [label for label, _ in rows if label != "note"]
    assert len(labels) == len(set(labels)), labels
    for label, value in rows:
        assert value and not REPR.search(value), (path, label, value)
    out = cli("inspect", path, width=width).stdout
    summary = out[: re.search(r"^ *key +[┃│]", out, re.MULTILINE).start()]  # up to the tensor table's header
    for label, _ in rows:
        assert label in summary
    data = json.loads(cli("inspect", path, "--json").stdout)
    assert set(data) == {"path", "format", "step", "step_source", "model_path", "trainer", "container", "notes",
                         "counters", "keys", "total_bytes", "dtypes", "details", "manifest", "tensors"}
    assert data["details"] == json.loads(json.dumps(report.details, default=str))


@pytest.mark.parametrize(("kind", "world"), [("fsdp1", 3), ("fsdp2", 2)])
def test_summary_of_dcp(fsdp_sequence, kind, world):
    ckpt = fsdp_sequence(kind, world, "float32", kind == "fsdp1")[-1]
    assert_plain_summary(ckpt)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_summary_of_deepspeed(ds_run, stage):
    folder = ds_run(Config(2, stage, "fp32"))
    assert_plain_summary(folder)
    assert_plain_summary(folder / "global_step7")
    rows = summary_rows(inspect_checkpoint(folder))
    assert [label for label, _ in rows].count("format") == 1


def test_summary_of_safetensors_and_torch_files(fsdp_sequence, tmp_path):
    src = fsdp_sequence("fsdp2", 2)[-1]
    state = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    save_file(state, tmp_path / "lib.safetensors", metadata={"format": "pt"})
    torch.save(state, tmp_path / "pytorch_model.bin")
    for name in ("one.safetensors", "hf/", "model.pt"):
        shards = ["--max-shard-size", "4KB"] if name.endswith("/") else []  # a one-file output refuses it
        cli("consolidate", src, "--out", f"{tmp_path}/{name}", *shards, "--quiet")
    for path in ("lib.safetensors", "pytorch_model.bin", "one.safetensors", "hf", "model.pt"):
        assert_plain_summary(tmp_path / path)
    rows = dict(summary_rows(inspect_checkpoint(tmp_path / "hf")))
    assert rows["index"] == "model.safetensors.index.json" and "indexed" not in rows
    assert rows["header metadata"] == "format pt"
    size = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    assert rows["file size"] == f"{human_bytes(size)} ({size:,} bytes)"


def test_summary_of_an_ema_ckpt_output(fsdp_sequence, tmp_path):
    ema = accumulate(fsdp_sequence("fsdp2", 2)[0].parent, decay=0.9, out=tmp_path / "ema").out
    assert_plain_summary(ema)
    assert "ema-ckpt" in dict(summary_rows(inspect_checkpoint(ema)))


@pytest.mark.parametrize("name", TRAINER_SETS)
def test_summary_of_trainer_checkpoints(name):
    from ema_ckpt.commands.inspect import is_folder_of_checkpoints

    for rel, _ in checkpoints_of(name):
        if not is_folder_of_checkpoints(FIXTURES / name / rel):  # a checkpoint of components is listed
            assert_plain_summary(FIXTURES / name / rel)


# --- --quiet, --workers -------------------------------------------------------------------------


def test_quiet_prints_nothing_but_errors(long_keys, tmp_path):
    a, b = long_keys / "step_1", long_keys / "step_2"
    for args in (["inspect", a], ["verify", a], ["diff", a, a], ["inspect", a, "-j", "3"]):
        result = cli(*args, "--quiet")
        assert result.stdout == "" and result.stderr == "", args
    result = cli("diff", a, b, "--quiet", code=4)
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: {a} and {b} differ")
    result = cli("inspect", tmp_path / "nope", "--quiet", code=3)
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1


def test_verify_and_diff_are_the_same_for_any_number_of_workers(fsdp_sequence, tmp_path):
    ckpts = fsdp_sequence("fsdp1", 3, "float32", True)
    ema = accumulate(ckpts[0].parent, decay=0.9, out=tmp_path / "ema").out
    one, two = diff(ckpts[-2], ckpts[-1]), diff(ckpts[-2], ckpts[-1], workers=2)
    assert one.to_dict() == two.to_dict() and not one.equal()
    damaged = tmp_path / "damaged"
    shutil.copytree(ema, damaged)
    data = damaged / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    (damaged / "stray.txt").write_text("x")
    for path in (ema, ckpts[-1], damaged):
        one_v, two_v = verify(path), verify(path, workers=2)
        assert one_v.to_dict() == two_v.to_dict(), path
    problems = verify(damaged).problems
    assert "CRC-32" in problems[0] and "extra file" in problems[1]
    result = cli("verify", ema, "--workers", "2", "--json")
    assert json.loads(result.stdout) == verify(ema).to_dict()


# --- verify: each byte counted once -------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_verify_reports_the_bytes_on_disk_once(fsdp_sequence, tmp_path, width):
    ema = accumulate(fsdp_sequence("fsdp2", 2)[0].parent, decay=0.9, out=tmp_path / "ema").out
    listed = Manifest.read(ema).files
    size = sum((ema / name).stat().st_size for name in listed)
    result = verify(ema)
    assert result.bytes_checked == result.bytes_hashed == size and result.hashed_files == len(listed)
    out = cli("verify", ema, width=width).stdout
    figure = f"{human_bytes(size)} ({size:,} bytes)"
    assert out.count(figure) == 1 and f"in {len(listed)} files, against ema-ckpt.json" in " ".join(out.split())
    assert out.count("KiB") + out.count("MiB") == 1
    # a file without a manifest: its own zip CRC-32s, the file's size
    cli("consolidate", ema, "--out", tmp_path / "ema.pt", "--quiet")
    pt = tmp_path / "ema.pt"
    assert verify(pt).bytes_checked == pt.stat().st_size
    assert f"({pt.stat().st_size:,} bytes) in 1 file, against its own zip CRC-32s" in " ".join(
        cli("verify", pt, width=width).stdout.split())
