"""Golden digests: the sha256 of every file each kind of output is made of, so that a refactor
shows it writes the same bytes.

Each case runs the public API (``ema_ckpt.accumulate``, ``posthoc``, ``average``, ``select``,
``consolidate``, ``reshard``) on checkpoints committed in ``tests/fixtures/trainers`` (DCP from
FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, safetensors, Lightning ``.ckpt`` and nanoGPT ``.pt`` files)
and records ``{file under the case's folder: sha256}`` in ``tests/golden/outputs.json``.

Regenerate the file, after changing an output format on purpose::

    EMA_CKPT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_outputs.py

Without the variable, a case whose files differ from the recorded ones fails, naming the case and
each file added, missing or changed.

What is normalised, and only in the manifests (``ema-ckpt.json``), because it differs between two
runs that do the same work; every other byte is hashed as written:

- the folder the test runs in (``tmp_path``): inputs are copied under it, so every absolute path
  recorded (``checkpoints[].path``, ``options.checkpoints``, ``terms[].path``, ``left[].path``)
  starts with it; it becomes ``<root>``;
- the fingerprint of an input that an earlier case wrote (``posthoc`` of ``accumulate``'s
  snapshots): it holds the sizes of that input's files, and so of its manifest, whose paths start
  with the run's folder; it becomes ``<fingerprint of an output>``;
- ``tool_version``: the package's version, which changes with each release;
- ``integrity``: the manifest's checksum of its own fields, which covers the three above; it is
  checked against the fields as written before it is replaced by ``<integrity>``.

The fingerprints of the committed inputs (names, sizes and mtimes of their files) need no
normalising: the copied inputs get one fixed mtime. The tests also check that a second run, in a
folder of another length, writes the same bytes, that ``workers=2`` writes the bytes one worker
writes, and that an incremental ``accumulate`` writes the data files of a one-shot run.

A Lightning ``.ckpt`` is written from a Lightning source only: from any other, the output records
the installed Lightning's version (``pytorch-lightning_version``), which is the environment's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import ema_ckpt

FIXTURES = Path(__file__).parent / "fixtures" / "trainers"
MANIFEST_NAME = "ema-ckpt.json"
GOLDEN = Path(__file__).parent / "golden" / "outputs.json"
UPDATE = os.environ.get("EMA_CKPT_UPDATE_GOLDEN") == "1"
FIXED_MTIME_NS = 1_700_000_000 * 10**9
"""The mtime every copied input file gets, so the fingerprints in manifests are the same on every run."""

INPUTS = {  # name under <root>/inputs → the committed folder of checkpoints (or single files)
    "fsdp2": "accelerate-fsdp2/ckpts",            # DCP: accelerate FSDP2, 2 ranks, steps 2, 3, 6
    "zero2": "hf-trainer-zero2-bf16/ckpts",       # DeepSpeed ZeRO-2 bf16 (HF Trainer), config.json carried
    "zero3": "lightning-deepspeed3",              # DeepSpeed ZeRO-3 bf16 (Lightning), steps 2, 4, 5, 6
    "plain": "accelerate-plain/ckpts",            # safetensors: accelerate save_state
    "kohya": "kohya-metadata/output",             # safetensors files with __metadata__ (carried)
    "two-models": "accelerate-two-models/ckpts",  # two safetensors models per checkpoint
    "lightning": "lightning-single/ckpts",        # torch files: Lightning .ckpt
    "nanogpt": "nanogpt/out",                     # torch files: nanoGPT ckpt_*.pt
}


def copy_inputs(root: Path) -> dict[str, Path]:
    """Copies of the input sets under ``root/inputs``, every file's mtime set to one fixed time."""
    paths = {}
    for name, rel in INPUTS.items():
        target = root / "inputs" / name
        shutil.copytree(FIXTURES / rel, target, copy_function=shutil.copyfile)
        fix_mtimes(target)
        paths[name] = target
    return paths


def fix_mtimes(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            os.utime(file, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))


# ---------------------------------------------------------------------------------------------
# The cases. Each writes into its own folder ``out`` (created empty) and may read what an earlier
# case wrote (``ema_of(root, <case>)``); cases run in the order listed.

Case = Callable[[dict[str, Path], Path, Path, int], None]
CASES: dict[str, Case] = {}


def case(name: str) -> Callable[[Case], Case]:
    def register(function: Case) -> Case:
        CASES[name] = function
        return function
    return register


def ema_of(root: Path, name: str) -> Path:
    return root / "cases" / name / "ema"


# accumulate: a DCP EMA from every input format; one safetensors file per component; power EMAs
# with snapshots; an incremental run.

@case("accumulate/dcp-from-fsdp2-dcp")
def _(inp, root, out, workers):
    ema_ckpt.accumulate(inp["fsdp2"], out=out / "ema", decay=0.9, workers=workers)


@case("accumulate/dcp-from-deepspeed-zero2")
def _(inp, root, out, workers):
    ema_ckpt.accumulate(inp["zero2"], out=out / "ema", decay=0.99, warmup=True, workers=workers)


@case("accumulate/dcp-from-deepspeed-zero3")
def _(inp, root, out, workers):
    ema_ckpt.accumulate(inp["zero3"], out=out / "ema", half_life=2, workers=workers)


@case("accumulate/dcp-float64-from-safetensors")
def _(inp, root, out, workers):
    ema_ckpt.accumulate(inp["plain"], out=out / "ema", decay=0.9, dtype="float64", workers=workers)


@case("accumulate/dcp-from-safetensors-metadata")
def _(inp, root, out, workers):
    ema_ckpt.accumulate(inp["kohya"], out=out / "ema", decay=0.8, per_checkpoint=True, workers=workers)


@case("accumulate/dcp-from-lightning-ckpt")
def _(inp, root, out, workers):
    ema_ckpt.accumulate(inp["lightning"], out=out / "ema", decay=0.9, workers=workers)


@case("accumulate/dcp-from-nanogpt-pt")
def _(inp, root, out, workers):
    ema_ckpt.accumulate(inp["nanogpt"], out=out / "ema", decay=0.9, workers=workers)


@case("accumulate/safetensors-per-component")
def _(inp, root, out, workers):
    ema_ckpt.accumulate(inp["two-models"], out=out / "ema", decay=0.9, workers=workers)


@case("accumulate/power-emas-and-snapshots")
def _(inp, root, out, workers):
    ema_ckpt.accumulate(inp["zero3"], out=out / "ema", sigma_rels=["0.05", "0.1"], snapshot_every=2,
                        workers=workers)


@case("accumulate/incremental")
def _(inp, root, out, workers):
    first = sorted(p for p in (inp["fsdp2"] / "checkpoints").iterdir())[:2]
    ema_ckpt.accumulate(first, out=out / "ema", decay=0.9, workers=workers)
    ema_ckpt.accumulate(inp["fsdp2"], out=out / "ema", decay=0.9, workers=workers)


# posthoc and average: each of the four formats a weighted sum writes.

@case("posthoc/dcp-from-fsdp2-dcp")
def _(inp, root, out, workers):
    ema_ckpt.posthoc(inp["fsdp2"], out=out / "sweep", sigma_rels=["0.05", "0.1"], workers=workers)


@case("posthoc/dcp-from-snapshots")
def _(inp, root, out, workers):
    snapshots = ema_of(root, "accumulate/power-emas-and-snapshots") / "snapshots"
    ema_ckpt.posthoc(snapshots, out=out / "sweep", sigma_rels=["0.08"], workers=workers)


@case("posthoc/safetensors-from-safetensors")
def _(inp, root, out, workers):
    ema_ckpt.posthoc(inp["plain"], out=out / "sweep", sigma_rels=["0.1"], workers=workers)


@case("posthoc/hf-from-deepspeed-zero2")
def _(inp, root, out, workers):
    ema_ckpt.posthoc(inp["zero2"], out=out / "sweep", sigma_rels=["0.1"], format="hf", workers=workers)


@case("posthoc/torch-from-nanogpt-pt")
def _(inp, root, out, workers):
    ema_ckpt.posthoc(inp["nanogpt"], out=out / "sweep", gammas=["6.9"], format="torch", workers=workers)


@case("average/dcp-from-fsdp2-dcp")
def _(inp, root, out, workers):
    ema_ckpt.average(inp["fsdp2"], out=out / "avg", last=2, workers=workers)


@case("average/safetensors-minus-sqrt-from-deepspeed-zero3")
def _(inp, root, out, workers):
    ema_ckpt.average(inp["zero3"], out=out / "avg", last=3, weights="minus-sqrt", format="safetensors",
                     workers=workers)


@case("average/torch-from-lightning-ckpt")
def _(inp, root, out, workers):
    ema_ckpt.average(inp["lightning"], out=out / "avg", from_step=4, format="torch", workers=workers)


@case("average/hf-from-safetensors")
def _(inp, root, out, workers):
    ema_ckpt.average(inp["plain"], out=out / "avg", last=3, format="hf", workers=workers)


@case("select/safetensors-from-fsdp2-dcp")
def _(inp, root, out, workers):
    # the score is the last number the command prints: sigma_rel_0.05 scores 0.05, the lowest
    ema_ckpt.select(inp["fsdp2"], out=out / "best", eval_command="echo {path} {name} | tr _ ' '",
                    sigma_rels=["0.05", "0.1"], work_dir=root / "select-work" / out.name, workers=workers)


# consolidate: every target format, from an EMA and from raw checkpoints of each input format.

@case("consolidate/safetensors-from-ema")
def _(inp, root, out, workers):
    ema_ckpt.consolidate(ema_of(root, "accumulate/dcp-from-fsdp2-dcp"), out / "ema.safetensors", workers=workers)


@case("consolidate/safetensors-bfloat16-from-ema")
def _(inp, root, out, workers):
    ema_ckpt.consolidate(ema_of(root, "accumulate/dcp-from-fsdp2-dcp"), out / "ema.safetensors",
                         dtype="bfloat16", workers=workers)


@case("consolidate/hf-sharded-from-ema")
def _(inp, root, out, workers):
    ema_ckpt.consolidate(ema_of(root, "accumulate/dcp-from-deepspeed-zero2"), f"{out}/hf/", max_shard_size="8KB",
                         workers=workers)


@case("consolidate/torch-from-ema")
def _(inp, root, out, workers):
    ema_ckpt.consolidate(ema_of(root, "accumulate/dcp-from-fsdp2-dcp"), out / "ema.pt", workers=workers)


@case("consolidate/lightning-from-ema")
def _(inp, root, out, workers):
    ema_ckpt.consolidate(ema_of(root, "accumulate/dcp-from-lightning-ckpt"), out / "ema.ckpt", workers=workers)


@case("consolidate/safetensors-from-deepspeed-zero3")
def _(inp, root, out, workers):
    ema_ckpt.consolidate(inp["zero3"] / "epoch=1-step=6.ckpt", out / "model.safetensors", workers=workers)


@case("consolidate/safetensors-from-nanogpt-pt")
def _(inp, root, out, workers):
    ema_ckpt.consolidate(inp["nanogpt"] / "ckpt_000008.pt", out / "model.safetensors", workers=workers)


@case("consolidate/torch-from-safetensors")
def _(inp, root, out, workers):
    ema_ckpt.consolidate(inp["plain"] / "checkpoints" / "checkpoint_2", out / "model.bin", workers=workers)


@case("consolidate/hf-sharded-from-fsdp2-dcp")
def _(inp, root, out, workers):
    ema_ckpt.consolidate(inp["fsdp2"] / "checkpoints" / "checkpoint_2", f"{out}/hf/", workers=workers)


# reshard: DCP for a couple of world sizes, from an EMA and from raw checkpoints.

@case("reshard/world-2-from-ema")
def _(inp, root, out, workers):
    ema_ckpt.reshard(ema_of(root, "accumulate/dcp-from-fsdp2-dcp"), world_size=2, out=out / "dcp", workers=workers)


@case("reshard/world-3-from-ema")
def _(inp, root, out, workers):
    ema_ckpt.reshard(ema_of(root, "accumulate/dcp-from-fsdp2-dcp"), world_size=3, out=out / "dcp", workers=workers)


@case("reshard/world-2-from-deepspeed-zero3")
def _(inp, root, out, workers):
    ema_ckpt.reshard(inp["zero3"] / "epoch=1-step=6.ckpt", world_size=2, out=out / "dcp", workers=workers)


@case("reshard/world-4-from-safetensors")
def _(inp, root, out, workers):
    ema_ckpt.reshard(inp["plain"] / "checkpoints" / "checkpoint_2", world_size=4, out=out / "dcp", workers=workers)


@case("reshard/world-3-from-lightning-ckpt")
def _(inp, root, out, workers):
    ema_ckpt.reshard(inp["lightning"] / "epoch=2-step=8.ckpt", world_size=3, out=out / "dcp", workers=workers)


WORKER_CASES = ("accumulate/dcp-from-fsdp2-dcp", "reshard/world-4-from-safetensors")
"""Run again with ``workers=2`` (each output file written by one of two processes): the bytes must be
those of one worker. Two cases only: each spawns a process (about 3 s)."""


# ---------------------------------------------------------------------------------------------
# Digests.

def _manifest_bytes(file: Path, root: Path) -> bytes:
    """The manifest with the run's folder, the tool's version and the checksum over both replaced."""
    text = file.read_text()
    data = json.loads(text)
    body = {k: v for k, v in data.items() if k != "integrity"}  # the checksum holds before it is replaced
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert data["integrity"] == "sha256:" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest(), (
        f"{file}: its integrity checksum does not match its fields")
    text = text.replace(str(root), "<root>")
    text = re.sub(r'"fingerprint": "sha256:[0-9a-f]{32}",(\s*"path": "<root>/cases/)',
                  r'"fingerprint": "<fingerprint of an output>",\1', text)
    text = re.sub(r'("tool_version": )"[^"]*"', r'\1"<version>"', text)
    text = re.sub(r'("integrity": )"sha256:[0-9a-f]{64}"', r'\1"<integrity>"', text)
    return text.encode()


def digests(folder: Path, root: Path) -> dict[str, str]:
    """``{path relative to folder: sha256}`` of every file under ``folder``."""
    found = {}
    for file in sorted(folder.rglob("*")):
        if file.is_dir():
            continue
        data = _manifest_bytes(file, root) if file.name == MANIFEST_NAME else file.read_bytes()
        found[file.relative_to(folder).as_posix()] = hashlib.sha256(data).hexdigest()
    return found


def run_cases(root: Path, names: list[str], workers: int = 1) -> dict[str, dict[str, str]]:
    """Run the named cases (in ``CASES`` order) under ``root``; the digests of each case's folder."""
    root = root.resolve()
    inputs = copy_inputs(root)
    result = {}
    for name in CASES:
        if name not in names:
            continue
        out = root / "cases" / name
        out.mkdir(parents=True)
        CASES[name](inputs, root, out, workers)
        result[name] = digests(out, root)
    return result


def mismatches(name: str, want: dict[str, str], got: dict[str, str]) -> list[str]:
    lines = []
    for path in sorted(set(want) | set(got)):
        if path not in got:
            lines.append(f"{name}: {path} is no longer written")
        elif path not in want:
            lines.append(f"{name}: {path} is new")
        elif want[path] != got[path]:
            lines.append(f"{name}: {path} changed (sha256 {want[path][:12]}… → {got[path][:12]}…)")
    return lines


# ---------------------------------------------------------------------------------------------
# The tests.

@pytest.fixture(scope="module")
def produced(tmp_path_factory) -> dict[str, dict[str, str]]:
    got = run_cases(tmp_path_factory.mktemp("golden"), list(CASES))
    if UPDATE:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    return got


def recorded() -> dict[str, dict[str, str]]:
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing: EMA_CKPT_UPDATE_GOLDEN=1 writes it")
    return json.loads(GOLDEN.read_text())


def test_every_case_recorded(produced):
    want = recorded()
    assert sorted(want) == sorted(CASES), (
        f"cases without digests: {sorted(set(CASES) - set(want))}; digests without a case: "
        f"{sorted(set(want) - set(CASES))} (EMA_CKPT_UPDATE_GOLDEN=1 rewrites {GOLDEN.name})")


@pytest.mark.parametrize("name", list(CASES))
def test_output_bytes_unchanged(produced, name):
    want = recorded().get(name, {})
    problems = mismatches(name, want, produced[name])
    assert not problems, ("output bytes differ from tests/golden/outputs.json (on purpose? rerun with "
                          "EMA_CKPT_UPDATE_GOLDEN=1):\n" + "\n".join(problems))


def test_second_run_same_bytes(produced, tmp_path):
    """Another run, in a folder whose path has another length, writes the same bytes."""
    again = run_cases(tmp_path / "a-second-run-in-a-longer-folder", list(CASES))
    problems = [line for name in CASES for line in mismatches(name, produced[name], again[name])]
    assert not problems, "\n".join(problems)


def test_two_workers_same_bytes(produced, tmp_path):
    got = run_cases(tmp_path, list(WORKER_CASES), workers=2)
    problems = [line for name in WORKER_CASES for line in mismatches(name, produced[name], got[name])]
    assert not problems, "with workers=2:\n" + "\n".join(problems)


def test_incremental_same_data_as_one_shot(produced):
    """Two ``accumulate`` runs (two checkpoints, then the third) write the data of one run over all three.

    Only the manifests differ: their warnings count the checkpoints of the run that wrote them."""
    one_shot = produced["accumulate/dcp-from-fsdp2-dcp"]
    incremental = produced["accumulate/incremental"]
    data = {path for path in one_shot if not path.endswith(MANIFEST_NAME)}
    assert data == {path for path in incremental if not path.endswith(MANIFEST_NAME)}
    assert all(one_shot[path] == incremental[path] for path in data), sorted(
        path for path in data if one_shot[path] != incremental[path])
