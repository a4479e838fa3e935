"""Checkpoints on S3, Google Cloud Storage and Azure Blob Storage, against their emulators: the
scenarios, run once per store by ``tests/test_s3.py``, ``tests/test_gcs.py`` and
``tests/test_azure.py`` (one file a store, so that test workers share them out).

moto's server (``s3://``, through s3fs), fake-gcs-server (``gs://``, through gcsfs) and azurite
(``az://``, through adlfs) run on 127.0.0.1, started by the ``store`` fixture of the file that
runs the scenarios. Real FSDP2 checkpoints (torchrun + gloo) are uploaded, and every result on
the store is compared bit for bit with the same command on the local copies: reading in place
with ranged reads, outputs published whole or not at all, the lock taken with the store's own
precondition (a create-only write: S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure
``If-None-Match: *``), recovery after a run cut off mid-upload, and faults (5xx, dropped
connections, a store that stops answering). What only one store has is tested beside it
(``tests/test_object_storage.py`` for S3).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.layout import Box
from ema_ckpt.storage import as_path, object_reads
from tests import object_stores
from tests.dcp_helpers import write_dcp
from tests.object_stores import BUCKET, Emulator, Faults, race_for_lock, through_proxy

runner = CliRunner()


def cli(*args: object, code: int = 0) -> str:
    """``ema-ckpt ARGS`` in process: its stdout, or its stderr where ``code`` is not 0."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.stdout if code == 0 else result.stderr


def dcp_tensors(path: Path) -> dict[str, object]:
    """A DCP checkpoint's entries, read by torch's own converter (the oracle)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = path.parent / f"{path.name}.oracle.pt"
    dcp_to_torch_save(path, target)
    loaded = torch.load(target, weights_only=False)
    target.unlink()
    flat: dict[str, object] = {}

    def walk(value: object, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = value

    walk(loaded, "")
    return flat


def assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    """The same entries, each tensor of the same dtype and bytes."""
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and value.dtype == other.dtype, key
            assert torch.equal(value.view(torch.uint8) if value.dim() else value, other.view(torch.uint8)
                               if other.dim() else other), key
        else:
            assert value == other, key


def steps_of(local: Path) -> list[Path]:
    """The checkpoints of a local run folder (``step_<N>``), in step order."""
    return sorted(local.iterdir(), key=lambda p: int(p.name.split("_")[-1]))


def assert_read_in_place(local: Path, url: str) -> None:
    """``inspect``, ``verify`` and ``diff`` of the checkpoint at ``url`` (object storage) read
    it in place and find what they find in its local copy ``local``."""
    here = json.loads(cli("inspect", local, "--json"))
    there = json.loads(cli("inspect", url, "--json"))
    assert there["path"] == url
    for doc in (here, there):
        doc.pop("path"), doc.pop("model_path", None)
    assert here == there
    assert json.loads(cli("verify", url, "--json"))["ok"] is True
    same = json.loads(cli("diff", url, local, "--json"))
    assert same["equal"] is True and same["compared"] > 0


def assert_each_byte_requested_once(url: str, local: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Reading every tensor of the DCP checkpoint at ``url`` (uploaded from ``local``) gives
    ``tensors`` and requests no data file's byte more than once."""
    reader = open_checkpoint(url)
    try:
        for key, spec in reader.specs().items():
            assert torch.equal(reader.read(key, Box.full(tuple(spec.shape))), tensors[key]), key
        files = dict(reader._fds)
        sizes = {p.name: p.stat().st_size for p in local.glob("*.distcp")}
        assert set(files) == set(sizes)
        for name, fd in files.items():
            assert isinstance(fd, object_reads.RemoteFile)
            assert fd.bytes_requested <= sizes[name], name
    finally:
        reader.close()


def running_store(protocol: str) -> Iterator[Emulator]:
    """The ``store`` fixture of a file running these scenarios: ``protocol``'s emulator on
    loopback, its client configured from the environment."""
    with object_stores.running(protocol) as emulator:
        yield emulator


@pytest.fixture(scope="module")
def run(store: Emulator, fsdp_sequence, tmp_path_factory) -> tuple[Path, str]:
    """Real FSDP2 checkpoints (2 ranks, 5 steps): the local folder and its copy on the store."""
    local = tmp_path_factory.mktemp(f"{store.protocol}-local") / "ckpts"
    for ckpt in fsdp_sequence("fsdp2", 2):
        shutil.copytree(ckpt, local / ckpt.name)
    return local, store.upload(local, "run/ckpts")


def _first_steps(store: Emulator, local: Path, prefix: str) -> tuple[str, str, list[Path]]:
    """Steps 1–3 uploaded to ``prefix/ckpts`` and folded from there into ``prefix/ema``."""
    steps = steps_of(local)
    for step in steps[:3]:
        store.upload(step, f"{prefix}/ckpts/{step.name}")
    src, out = store.url(f"{prefix}/ckpts"), store.url(f"{prefix}/ema")
    cli("accumulate", src, "--decay", "0.9", "--out", out)
    return src, out, steps


def _upload_the_rest(store: Emulator, steps: list[Path], prefix: str) -> None:
    for step in steps[3:]:
        store.upload(step, f"{prefix}/ckpts/{step.name}")


def _local_ema(local: Path, tmp_path: Path) -> dict[str, object]:
    cli("accumulate", local, "--decay", "0.9", "--out", tmp_path / "ema-local")
    return dcp_tensors(tmp_path / "ema-local")


def test_reading_commands_read_objects_in_place(store, run, tmp_path):
    """Every reading command, from the store to a local output, gives the bytes it gives from
    the local copies."""
    local, url = run
    step = steps_of(local)[-1].name
    assert_read_in_place(local / step, f"{url}/{step}")
    for where, src in ((store.protocol, url), ("local", local)):
        cli("accumulate", src, "--decay", "0.9", "--out", tmp_path / where / "ema")
        cli("posthoc", src, "--sigma-rel", "0.05,0.1", "--out", tmp_path / where / "posthoc")
        cli("average", src, "--last", "3", "--out", tmp_path / where / "average")
        cli("consolidate", f"{src}/{step}", "--out", tmp_path / where / "model.safetensors")
        cli("reshard", f"{src}/{step}", "--world-size", "3", "--out", tmp_path / where / "reshard")
    for name in ("ema", "posthoc/sigma_rel_0.05", "posthoc/sigma_rel_0.1", "average", "reshard"):
        assert_same(dcp_tensors(tmp_path / store.protocol / name), dcp_tensors(tmp_path / "local" / name))
    a, b = (load_file(tmp_path / w / "model.safetensors") for w in (store.protocol, "local"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the EMA's manifest records the checkpoints by their URLs (a later run folds from there)
    manifest = json.loads((tmp_path / store.protocol / "ema" / "ema-ckpt.json").read_text())
    assert manifest["checkpoints"] and all(c["path"].startswith(f"{url}/") for c in manifest["checkpoints"])


def test_accumulate_store_to_store_is_bit_identical_incremental_and_loads_with_dcp(store, run, tmp_path):
    local, _ = run
    src, out, steps = _first_steps(store, local, "io")
    first = store.keys_under("io/ema")
    assert ".metadata" in first and "ema-ckpt.json" in first and not any(k.startswith(".ema-ckpt") for k in first)
    _upload_the_rest(store, steps, "io")
    summary = json.loads(cli("accumulate", src, "--decay", "0.9", "--out", out, "--json"))
    assert [c["step"] for c in summary["folded"]] == [int(s.name.split("_")[-1]) for s in steps[3:]]
    second = store.keys_under("io/ema")
    assert not set(first) & {k for k in second if k.endswith(".distcp")}  # a new generation, the old removed
    assert not any(k.startswith(".ema-ckpt") for k in second)  # no staging left
    expected = _local_ema(local, tmp_path)
    there = store.download("io/ema", tmp_path / "ema-store")
    assert_same(dcp_tensors(there), expected)
    import torch.distributed.checkpoint as dcp  # torch's own reader, of the downloaded objects

    state = {k: torch.empty_like(v) for k, v in expected.items() if isinstance(v, torch.Tensor)}
    dcp.load(state, checkpoint_id=str(there))
    assert all(torch.equal(state[k], expected[k]) for k in state)
    assert json.loads(cli("verify", out, "--json"))["ok"] is True
    assert "up to date" in cli("accumulate", src, "--decay", "0.9", "--out", out)


def test_each_input_byte_is_requested_once(store, tmp_path):
    tensors = {f"model.big{i}": torch.randn(3_000_000 + i) for i in range(2)}
    tensors.update({f"model.small{i}": torch.randn(100) for i in range(20)})
    write_dcp(tmp_path / "ckpt", tensors, world_size=2)
    assert_each_byte_requested_once(store.upload(tmp_path / "ckpt", "once/ckpt"), tmp_path / "ckpt", tensors)


def test_safetensors_and_hf_outputs_on_the_store_are_the_local_bytes(store, tmp_path):
    torch.manual_seed(0)
    sequence = tmp_path / "seq"
    for step in (10, 20, 30):
        (sequence / f"checkpoint-{step}").mkdir(parents=True)
        save_file({"w": torch.randn(300, 70), "b": torch.full((70,), float(step)).to(torch.bfloat16)},
                  sequence / f"checkpoint-{step}" / "model.safetensors")
    url = store.upload(sequence, "st/seq")
    cli("average", url, "--last", "3", "--out", store.url("st/avg"), "--format", "safetensors")
    cli("average", sequence, "--last", "3", "--out", tmp_path / "avg", "--format", "safetensors")
    assert store.fs().cat_file(f"{BUCKET}/st/avg/model.safetensors") == (tmp_path / "avg" / "model.safetensors"
                                                                          ).read_bytes()
    cli("consolidate", f"{url}/checkpoint-30", "--out", store.url("st/hf") + "/", "--max-shard-size", "40KB")
    cli("consolidate", sequence / "checkpoint-30", "--out", f"{tmp_path / 'hf'}/", "--max-shard-size", "40KB")
    # the shards under generation-tagged names (the index names them), each the local shard's bytes
    index = json.loads(store.fs().cat_file(f"{BUCKET}/st/hf/model.safetensors.index.json"))
    local = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(local["weight_map"]) and len(set(local["weight_map"].values())) > 1
    for key, name in index["weight_map"].items():
        shard = store.fs().cat_file(f"{BUCKET}/st/hf/{name}")
        assert shard == (tmp_path / "hf" / local["weight_map"][key]).read_bytes(), key
    assert len(store.keys_under("st/hf")) == len(list((tmp_path / "hf").iterdir()))


def test_a_held_lock_refuses_and_an_expired_one_is_taken_over(store, run):
    local, _ = run
    fs, out = store.fs(), store.url("locked/ema")
    lock = {"owner": "other-host:1:abc", "expires": time.time() + 600}
    fs.pipe_file(f"{BUCKET}/locked/.ema.lock/000000000003", json.dumps(lock).encode())
    message = cli("accumulate", local, "--decay", "0.9", "--out", out, code=75)
    assert "another ema-ckpt run" in message and "other-host:1:abc" in message
    assert store.keys_under("locked") == [".ema.lock/000000000003"]
    lock["expires"] = time.time() - 1  # its run died a lease ago
    fs.pipe_file(f"{BUCKET}/locked/.ema.lock/000000000003", json.dumps(lock).encode())
    cli("accumulate", local, "--decay", "0.9", "--out", out)
    assert [k for k in store.keys_under("locked") if ".lock" in k] == [".ema.lock/000000000004"]
    released = json.loads(fs.cat_file(f"{BUCKET}/locked/.ema.lock/000000000004"))
    assert released["released"] is True and released["expires"] == 0
    cli("accumulate", local, "--decay", "0.9", "--out", out)  # a released lock is free
    assert [k for k in store.keys_under("locked") if ".lock" in k] == [".ema.lock/000000000005"]


def test_of_runs_racing_for_an_expired_lock_one_gets_it(store):
    """Eight contenders start at once on a lock whose holder died: exactly one holds it, because
    the store creates a key for one conditional write only; each refusal names it."""
    final = as_path(store.url("race/ema"))
    dead = {"owner": "dead-host:1:abc", "expires": time.time() - 1}
    store.fs().pipe_file(f"{BUCKET}/race/.ema.lock/000000000001", json.dumps(dead).encode())
    held, refused = race_for_lock(final, 8)
    try:
        assert len(held) == 1 and len(refused) == 7, (len(held), refused)
        assert all(held[0].owner in message for message in refused), (held[0].owner, refused)
        held[0].check()
        assert [k for k in store.keys_under("race") if ".lock" in k] == [f".ema.lock/{held[0].number:012d}"]
    finally:
        for lock in held:
            lock.__exit__(None, None, None)


def test_a_create_only_write_is_refused_when_the_key_exists(store):
    where = as_path(store.url("create-only/object"))
    where.write_bytes(b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        where.write_bytes(b"second", exclusive=True)
    assert where.read_bytes() == b"first"


def test_a_run_cut_off_mid_upload_leaves_the_previous_ema_and_the_rerun_recovers(store, run, tmp_path,
                                                                                  monkeypatch):
    local, _ = run
    src, out, steps = _first_steps(store, local, "cut")
    before = {k: store.fs().cat_file(f"{BUCKET}/cut/ema/{k}") for k in store.keys_under("cut/ema")}
    _upload_the_rest(store, steps, "cut")
    monkeypatch.setenv("EMA_CKPT_REMOTE_ATTEMPTS", "1")
    monkeypatch.setenv("EMA_CKPT_LOCK_LEASE", "2")  # its lock, which it cannot remove, expires soon
    # after the new generation's first data file, the store refuses everything (credentials
    # revoked mid-run): nothing the run does after that, its clean-up included, reaches it
    with through_proxy(store, Faults(refuse_after_writes=1)):
        message = cli("accumulate", src, "--decay", "0.9", "--out", out, code=9)
    assert len(message.strip().splitlines()) == 1, message
    assert any(k.startswith(".ema-ckpt-staging/") for k in store.keys_under("cut/ema"))
    for key, data in before.items():  # the previous EMA, untouched
        assert store.fs().cat_file(f"{BUCKET}/cut/ema/{key}") == data, key
    summary = json.loads(cli("accumulate", src, "--decay", "0.9", "--out", out, "--json", "--wait", "20"))
    assert any("interrupted" in note for note in summary.get("notes", [])), summary.get("notes")
    assert not any(k.startswith(".ema-ckpt-staging/") for k in store.keys_under("cut/ema"))
    assert_same(dcp_tensors(store.download("cut/ema", tmp_path / "ema-store")), _local_ema(local, tmp_path))


def test_transient_errors_and_dropped_connections_are_retried_to_the_same_result(store, run, tmp_path,
                                                                                 monkeypatch):
    local, url = run
    monkeypatch.setenv("EMA_CKPT_REMOTE_TIMEOUT", "5")  # a dropped connection that a client waits out
    with through_proxy(store, Faults(every=41, drop_every=29, error_body=store.error_body)) as faults:
        cli("accumulate", url, "--decay", "0.9", "--out", store.url("flaky/ema"), "--workers", "2")
    assert faults.answered_503 > 0 and faults.dropped > 0, faults
    expected = _local_ema(local, tmp_path)
    assert_same(dcp_tensors(store.download("flaky/ema", tmp_path / "ema-store")), expected)


def test_a_store_that_stops_answering_ends_the_run_within_the_bound(store, run, tmp_path, monkeypatch):
    _, url = run
    monkeypatch.setenv("EMA_CKPT_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("EMA_CKPT_REMOTE_ATTEMPTS", "2")
    started = time.monotonic()
    with through_proxy(store, Faults(stall_ranges=True)):
        message = cli("accumulate", url, "--decay", "0.9", "--out", tmp_path / "ema", code=9)
    # 2 attempts of 1 s, with the store client's backoff between them (Azure 1–3 s, gcsfs 1–2 s,
    # botocore up to 1 s)
    assert time.monotonic() - started < 20
    assert len(message.strip().splitlines()) == 1, message
    named = re.search(rf"error: {re.escape(url)}/step_\d+/(\S+): no answer", message)  # the object it waited for
    assert named, message
    # a data file, whose ranged read went unanswered (adlfs reads even ``.metadata`` by ranges)
    assert named.group(1).endswith(".distcp") or store.protocol == "az", message
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".ema.lock") == []


def test_an_unreachable_endpoint_or_a_missing_bucket_is_one_line(store, run, tmp_path, monkeypatch):
    local, url = run
    message = cli("inspect", f"{store.protocol}://no-such-bucket-here/ckpt", code=9)  # the store's refusal
    assert len(message.strip().splitlines()) == 1 and "no-such-bucket-here/ckpt: no such bucket" in message, message
    message = cli("inspect", f"{url}/missing", code=3)  # no such checkpoint: as on a local disk
    assert len(message.strip().splitlines()) == 1 and f"{url}/missing" in message, message
    message = cli("accumulate", f"{url}/missing", "--decay", "0.9", "--out", tmp_path / "ema", code=3)
    assert len(message.strip().splitlines()) == 1 and "no such file or directory" in message, message
    assert not (tmp_path / "ema").exists()
    monkeypatch.setenv("EMA_CKPT_REMOTE_ATTEMPTS", "1")
    try:
        store.use(f"http://127.0.0.1:{object_stores.free_port()}")
        message = cli("inspect", f"{url}/{steps_of(local)[-1].name}", code=9)
    finally:
        store.use()
    assert len(message.strip().splitlines()) == 1 and f"{store.protocol}://" in message, message


RECIPES_DIR = Path(__file__).resolve().parents[1] / "docs" / "recipes"
RECIPES = {
    "s3": ("object-storage.md", ("## Reading from S3", "## Writing to S3"), 13),
    "gs": ("gcs.md", ("## Commands",), 7),
    "az": ("azure.md", ("## Commands",), 7),
}
"""Each store's recipe page, the headings of its blocks of commands (the first ``bash`` block
under each), and how many ``ema-ckpt`` lines they hold."""
RUN_IN_ORDER = """
import json, sys
from ema_ckpt.cli import run
for words in json.loads(sys.argv[1]):
    if run(words[1:]) != 0:
        sys.exit(f"exit != 0: {words}")
"""
"""Each command line of ``argv[1]`` (a JSON list), in order, by the CLI's own ``run`` (what the
console script runs), in one process; stops at the first that fails."""
ENTRIES = (".metadata", "ema-ckpt.json", "model.safetensors", "model.safetensors.index.json")
"""The names a finished output folder holds one of at its top (DCP's, a manifest, the HF layout's)."""


def _recipe(protocol: str) -> tuple[list[str], list[list[str]]]:
    """The variables the page's blocks ``export``, and their ``ema-ckpt`` commands, in order."""
    page, headings, _ = RECIPES[protocol]
    text = (RECIPES_DIR / page).read_text()
    exported: list[str] = []
    commands: list[list[str]] = []
    for heading in headings:
        block = text.split(f"{heading}\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
        for line in (line.split("#", 1)[0].strip() for line in block.splitlines()):
            if line.startswith("export "):
                exported.append(line.removeprefix("export ").split("=", 1)[0])
            elif line.startswith("ema-ckpt "):
                commands.append(shlex.split(line.replace("$BUCKET", BUCKET)))
    return exported, commands


def _outputs(words: list[str]) -> list[str]:
    """Where a command writes: its ``--out``, or for ``posthoc`` one folder under it per σ_rel."""
    if "--out" not in words:
        return []
    out = words[words.index("--out") + 1].rstrip("/")
    if words[1] != "posthoc":
        return [out]
    return [f"{out}/sigma_rel_{sigma}" for sigma in words[words.index("--sigma-rel") + 1].split(",")]


def _holds_an_output(store: Emulator, where: str, cwd: Path) -> bool:
    """A finished output is at ``where`` (a URL on ``store`` or a path under ``cwd``): the file,
    or a folder holding one of :data:`ENTRIES` at its top."""
    if where.startswith(f"{store.protocol}://"):
        key = where.removeprefix(f"{store.protocol}://{BUCKET}/")
        if where.endswith((".safetensors", ".pt")):
            return store.fs().exists(f"{BUCKET}/{key}")
        return bool(set(store.keys_under(key)) & set(ENTRIES))
    local = cwd / where
    if where.endswith((".safetensors", ".pt")):
        return local.is_file()
    return local.is_dir() and any((local / name).is_file() for name in ENTRIES)


def test_the_recipes_commands_run_as_written(store, run, tmp_path):
    """Every ``ema-ckpt`` line of the store's recipe page, run in order in a fresh process that has
    only the emulator's environment to find the store by (the page's own ``export`` lines show the
    variables a user sets; the values here are the emulator's), and each output it names there.
    One process for all of them: each would otherwise spend most of its time importing torch."""
    exported, commands = _recipe(store.protocol)
    assert exported and set(exported) <= set(store.env), exported
    assert len(commands) == RECIPES[store.protocol][2], commands
    env = {**os.environ, **store.env}
    done = subprocess.run([sys.executable, "-c", RUN_IN_ORDER, json.dumps(commands)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    written = [where for words in commands for where in _outputs(words)]
    assert len(written) >= 5 and any(w.startswith(f"{store.protocol}://") for w in written), written
    missing = [where for where in written if not _holds_an_output(store, where, tmp_path)]
    assert not missing, missing
