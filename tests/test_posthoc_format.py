"""``posthoc``/``average`` ``format="safetensors"``: each output ``OUT/<name>/model.safetensors``
beside its manifest, the same bits as the DCP output of the same sweep.

The DCP outputs are read with torch's own ``dcp_to_torch_save`` and the safetensors outputs with
the safetensors library; inputs come from real FSDP training runs and from ``save_file``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ema_ckpt.commands.averaging import average, posthoc
from ema_ckpt.commands.verify import verify
from ema_ckpt.errors import OptionError, UsageError
from ema_ckpt.manifest import MANIFEST_NAME, Manifest
from ema_ckpt.storage import files_on_disk
from tests.ema_reference import full_load

EMA_CKPT = str(Path(sys.executable).with_name("ema-ckpt"))
REPO = Path(__file__).resolve().parents[1]
SIGMAS = ["0.05", "0.10"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run([EMA_CKPT, *args], capture_output=True, text=True, env=env, timeout=300)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _without_container(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize(("kind", "world"), [("fsdp2", 2), ("fsdp1", 3)])
def test_safetensors_sweep_equals_the_dcp_sweep_bit_for_bit(fsdp_sequence, tmp_path, kind, world):
    folder = fsdp_sequence(kind, world)[-1].parent
    dcp = posthoc(folder, out=tmp_path / "dcp", sigma_rels=SIGMAS)
    st = posthoc(folder, out=tmp_path / "st", sigma_rels=SIGMAS, format="safetensors")
    assert dcp.format == "dcp" and st.format == "safetensors"  # DCP inputs: DCP unless asked
    assert [p.name for p in st.outputs] == ["sigma_rel_0.05", "sigma_rel_0.10"]
    for dcp_out, st_out in zip(dcp.outputs, st.outputs, strict=True):
        assert sorted(p.name for p in st_out.iterdir()) == [MANIFEST_NAME, "model.safetensors"]
        want = _without_container(full_load(dcp_out, tmp_path))  # named as consolidate names them
        _assert_same(load_file(st_out / "model.safetensors"), want)
        manifest = Manifest.read(st_out)
        assert manifest is not None and manifest.options["format"] == "safetensors"
        assert list(manifest.files) == ["model.safetensors"] and manifest.files["model.safetensors"]["crc32"]
        assert manifest.terms == Manifest.read(dcp_out).terms  # type: ignore[union-attr]
    assert any("container level 'model.'" in note for note in st.plan.notes)
    kept = posthoc(folder, out=tmp_path / "kept", sigma_rels=["0.05"], format="safetensors", keep_prefix=True)
    _assert_same(load_file(kept.outputs[0] / "model.safetensors"), full_load(dcp.outputs[0], tmp_path))


def test_verify_checks_each_output_against_its_manifest(fsdp_sequence, tmp_path):
    folder = fsdp_sequence("fsdp2", 2)[-1].parent
    result = posthoc(folder, out=tmp_path / "st", sigma_rels=SIGMAS, format="safetensors")
    for out in result.outputs:
        checked = verify(out)
        assert checked.ok, checked.problems
        assert checked.manifest and checked.checks == ["files", "readable"] and checked.files == ["model.safetensors"]
        assert checked.format_name == "safetensors" and checked.keys == len(load_file(out / "model.safetensors"))
    assert _cli("verify", str(result.outputs[0])).returncode == 0
    data = result.outputs[1] / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01  # a flipped bit in the last tensor's data: the file still parses
    data.write_bytes(bytes(raw))
    damaged = verify(result.outputs[1])
    assert not damaged.ok and any("CRC-32" in p and "model.safetensors" in p for p in damaged.problems)
    run = _cli("verify", str(result.outputs[1]))
    assert run.returncode != 0 and "Traceback" not in run.stderr


def _safetensors_sequence(root: Path) -> Path:
    """Hugging Face-style checkpoints (``step_<n>/model.safetensors``) written by the safetensors library."""
    for i, step in enumerate([100, 250, 700, 1000]):
        generator = torch.Generator().manual_seed(i)
        folder = root / f"step_{step}"
        folder.mkdir(parents=True)
        save_file({"layer.weight": torch.randn(33, 5, generator=generator),
                   "layer.bias": torch.randn(7, generator=generator),
                   "steps_seen": torch.tensor([step], dtype=torch.int64)}, str(folder / "model.safetensors"))
    return root


def test_safetensors_inputs_default_to_safetensors_outputs(tmp_path):
    ck = _safetensors_sequence(tmp_path / "ck")
    st = posthoc(ck, out=tmp_path / "st", sigma_rels=SIGMAS, dtype="float64")
    dcp = posthoc(ck, out=tmp_path / "dcp", sigma_rels=SIGMAS, dtype="float64", format="dcp")
    assert st.format == "safetensors" and dcp.format == "dcp" and not st.plan.notes
    for st_out, dcp_out in zip(st.outputs, dcp.outputs, strict=True):
        got = load_file(st_out / "model.safetensors")
        assert got["layer.weight"].dtype == torch.float64 and got["steps_seen"].tolist() == [1000]
        _assert_same(got, full_load(dcp_out, tmp_path))  # no container level to remove
        assert verify(st_out).ok


def test_average_writes_one_safetensors_output(fsdp_sequence, tmp_path):
    folder = fsdp_sequence("fsdp2", 2)[-1].parent
    dcp = average(folder, out=tmp_path / "avg-dcp", last=3)
    st = average(folder, out=tmp_path / "avg-st", last=3, format="safetensors")
    assert st.outputs == [tmp_path / "avg-st"] and st.format == "safetensors"
    _assert_same(load_file(tmp_path / "avg-st" / "model.safetensors"),
                 _without_container(full_load(dcp.outputs[0], tmp_path)))
    assert verify(tmp_path / "avg-st").ok
    with pytest.raises(UsageError, match="exists"):  # as for DCP: an output is replaced only when asked
        average(folder, out=tmp_path / "avg-st", last=3, format="safetensors")
    again = average(folder, out=tmp_path / "avg-st", last=2, format="safetensors", overwrite=True)
    assert Manifest.read(again.outputs[0]).options["last"] == 2  # type: ignore[union-attr]


def test_json_names_every_file_and_dry_run_says_the_format(tmp_path):
    ck = _safetensors_sequence(tmp_path / "ck")
    run = _cli("posthoc", str(ck), "--sigma-rel", "0.05,0.10", "--out", str(tmp_path / "out"), "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    on_disk = [str(tmp_path / "out" / o / name) for o in ("sigma_rel_0.05", "sigma_rel_0.10")
               for name, _ in files_on_disk(tmp_path / "out" / o)]
    assert data["format"] == "safetensors" and data["files"] == on_disk and data["files_written"] == 4
    assert sum(Path(f).stat().st_size for f in data["files"]) == data["bytes_written"]
    dry = _cli("posthoc", str(ck), "--sigma-rel", "0.05", "--out", str(tmp_path / "d"), "--format", "dcp",
               "--dry-run")
    assert dry.returncode == 0 and "output format dcp" in dry.stderr and not (tmp_path / "d").exists()
    dry = _cli("average", str(ck), "--last", "2", "--out", str(tmp_path / "a"), "--dry-run")
    assert "output format safetensors" in dry.stderr and "model.safetensors" in dry.stderr


@pytest.mark.parametrize("command", [["posthoc", "--sigma-rel", "0.05"], ["average", "--last", "2"]])
def test_an_unknown_format_is_one_line_exit_2(tmp_path, command):
    ck = _safetensors_sequence(tmp_path / "ck")
    run = _cli(command[0], str(ck), *command[1:], "--out", str(tmp_path / "out"), "--format", "npz")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == ["error: --format must be one of dcp, safetensors, hf, torch, got 'npz'"]
    assert not (tmp_path / "out").exists()
    with pytest.raises(OptionError) as err:
        posthoc(ck, out=tmp_path / "out", sigma_rels=["0.05"], format="npz")
    assert err.value.option == "format"


def test_every_sum_format_holds_the_same_tensors(tmp_path):
    """hf (the sharded layout) and torch (model.pt) hold what safetensors holds, bit for bit."""
    import torch

    ck = _safetensors_sequence(tmp_path / "ck")
    want = None
    for fmt in ("safetensors", "hf", "torch"):
        result = average(ck, out=tmp_path / fmt, last=2, weights="minus-sqrt", format=fmt)
        out = result.outputs[0]
        if fmt == "torch":
            got = torch.load(out / "model.pt", weights_only=True)
        else:
            got = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
        assert Manifest.read(out).options["format"] == fmt  # type: ignore[union-attr]
        want = want or got
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
