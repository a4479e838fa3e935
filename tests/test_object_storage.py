"""Checkpoints on S3: what only these tests hold the S3 path to, against moto's server on
loopback. The scenarios every store shares (reading in place, store to store, the lock,
faults, the recipe page's commands) run on S3 from ``tests/test_s3.py``.

Real FSDP2 checkpoints (torchrun + gloo) are uploaded with boto3, and each command's result on
``s3://`` paths is compared bit for bit with the same command on the local copies. Other test
files take the ``s3`` fixture and the helpers from here.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ema_ckpt.cli import app
from ema_ckpt.formats import open_checkpoint
from ema_ckpt.layout import Box
from ema_ckpt.storage import as_path, object_clients, object_paths, object_reads
from tests import object_stores
from tests.dcp_helpers import dcp_sequence_with_hole
from tests.object_store_scenarios import assert_same, cli, dcp_tensors, runner, steps_of
from tests.object_stores import BUCKET, SLOW_DOWN, Faults, fault_proxy
from tests.waiting import wait_for

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

s3 = object_stores.s3  # moto's server (module-scoped fixture; other test files take it from here)


def _use_endpoint(url: str) -> None:
    os.environ["AWS_ENDPOINT_URL"] = url
    object_clients.forget_clients()  # the next request builds its client from the environment


def upload(local: Path, prefix: str) -> str:
    """Every file under ``local`` to ``s3://ckpts/<prefix>/…``; the URL of the prefix."""
    client = boto3.client("s3")
    for file in sorted(local.rglob("*")):
        if file.is_file():
            client.upload_file(str(file), BUCKET, f"{prefix}/{file.relative_to(local).as_posix()}")
    return f"s3://{BUCKET}/{prefix}"


@pytest.fixture(scope="module")
def run(s3, fsdp_sequence, tmp_path_factory) -> tuple[Path, str]:
    """Real FSDP2 checkpoints (2 ranks, 5 steps): the local folder and its copy on S3."""
    local = tmp_path_factory.mktemp("s3-local") / "ckpts"
    for ckpt in fsdp_sequence("fsdp2", 2):
        shutil.copytree(ckpt, local / ckpt.name)
    return local, upload(local, "run/ckpts")


def test_a_hole_in_a_record_on_s3_is_exit_3_and_nothing_is_published(s3, tmp_path):
    damaged = dcp_sequence_with_hole(tmp_path / "ckpts")
    url = upload(tmp_path / "ckpts", "hole/ckpts")
    shown = f"{url}/step_2/{damaged.name}: key 'model.w': the "
    for args in (["accumulate", url, "--decay", "0.9", "--out", f"s3://{BUCKET}/hole/ema"],
                 ["consolidate", f"{url}/step_2", "--out", tmp_path / "c.safetensors"]):
        message = cli(*args, code=3)
        assert shown in message and "do not match their CRC-32" in message, message
    assert keys_under(f"s3://{BUCKET}/hole/ema") == [] and not (tmp_path / "c.safetensors").exists()


def test_safetensors_checkpoints_are_read_in_place(s3, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    # one file, and the HF sharded layout (index + shards), written by the safetensors library
    one = {"w": torch.randn(300, 70), "b": torch.randn(70).to(torch.bfloat16), "n": torch.tensor(7)}
    (tmp_path / "one").mkdir()
    save_file(one, tmp_path / "one" / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shards = {"model-00001-of-00002.safetensors": {"a": torch.randn(64, 9)},
              "model-00002-of-00002.safetensors": {"c": torch.randn(5, 3, 2), "d": torch.randn(11)}}
    for name, tensors in shards.items():
        save_file(tensors, sharded / name)
    index = {"metadata": {"total_size": 0}, "weight_map": {k: n for n, t in shards.items() for k in t}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("one", "sharded"):
        url = upload(tmp_path / name, f"st/{name}")
        cli("consolidate", url, "--out", tmp_path / f"{name}-from-s3.safetensors")
        cli("consolidate", tmp_path / name, "--out", tmp_path / f"{name}-local.safetensors")
        a, b = load_file(tmp_path / f"{name}-from-s3.safetensors"), load_file(tmp_path / f"{name}-local.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        there = json.loads(cli("inspect", url, "--json"))
        assert there["format"] == "safetensors"
    sequence = tmp_path / "seq"
    for step in (10, 20, 30):
        (sequence / f"checkpoint-{step}").mkdir(parents=True)
        save_file({"w": torch.full((40, 4), float(step))}, sequence / f"checkpoint-{step}" / "model.safetensors")
    url = upload(sequence, "st/seq")
    cli("average", url, "--last", "3", "--out", tmp_path / "avg-s3")
    cli("average", sequence, "--last", "3", "--out", tmp_path / "avg-local")
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("avg-s3", "avg-local"))
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["w"], torch.full((40, 4), 20.0))


def download(url: str, local: Path) -> Path:
    """Every object under ``url`` (``s3://ckpts/…``) to ``local`` (staging prefixes included)."""
    client = boto3.client("s3")
    prefix = url.removeprefix(f"s3://{BUCKET}/").rstrip("/") + "/"
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for item in page.get("Contents", []):
            target = local / item["Key"][len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(BUCKET, item["Key"], str(target))
    return local


def keys_under(url: str) -> list[str]:
    client = boto3.client("s3")
    prefix = url.removeprefix(f"s3://{BUCKET}/").rstrip("/") + "/"
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(item["Key"][len(prefix):] for page in pages for item in page.get("Contents", []))


def _ema_of_the_first_steps(local: Path, prefix: str, *options: str) -> tuple[str, str, list[Path]]:
    """Steps 1–3 uploaded to ``prefix/ckpts`` and folded from there into ``prefix/ema``: the
    two URLs, and every step (:func:`_upload_the_rest` uploads the others)."""
    steps = sorted(local.iterdir(), key=lambda p: int(p.name.split("_")[-1]))
    for step in steps[:3]:
        upload(step, f"{prefix}/ckpts/{step.name}")
    src, out = f"s3://{BUCKET}/{prefix}/ckpts", f"s3://{BUCKET}/{prefix}/ema"
    cli("accumulate", src, "--decay", "0.9", "--out", out, *options)
    return src, out, steps


def _upload_the_rest(steps: list[Path], prefix: str) -> None:
    for step in steps[3:]:
        upload(step, f"{prefix}/ckpts/{step.name}")


def _counting_reads(monkeypatch) -> dict[str, int]:
    """Bytes requested per object by every read from here on (ranged or whole)."""
    requested: dict[str, int] = {}
    real = object_paths.call

    def counting(where, func, *args, **kwargs):
        data = real(where, func, *args, **kwargs)
        if getattr(func, "__name__", "").lstrip("_") == "cat_file":
            requested[str(where)] = requested.get(str(where), 0) + len(data)
        return data

    monkeypatch.setattr(object_paths, "call", counting)
    monkeypatch.setattr(object_reads, "call", counting)
    return requested


def test_an_incremental_accumulate_downloads_the_previous_ema_once(run, tmp_path, monkeypatch):
    """Its CRC-32s are checked from the blocks the fold reads, not by a download before it."""
    local, _ = run
    src, out, steps = _ema_of_the_first_steps(local, "once")
    _upload_the_rest(steps, "once")
    client = boto3.client("s3")
    sizes = {f"{out}/{k}": client.head_object(Bucket=BUCKET, Key=f"once/ema/{k}")["ContentLength"]
             for k in keys_under(out) if k.endswith(".distcp")}
    requested = _counting_reads(monkeypatch)
    cli("accumulate", src, "--decay", "0.9", "--out", out)
    assert sizes and all(0 < requested.get(name, 0) <= size for name, size in sizes.items()), (requested, sizes)
    cli("accumulate", local, "--decay", "0.9", "--out", tmp_path / "ema-local")
    assert_same(dcp_tensors(download(out, tmp_path / "ema-s3")), dcp_tensors(tmp_path / "ema-local"))


def test_a_remote_files_crc32_comes_from_the_blocks_read_and_reads_only_the_rest(s3):
    import zlib

    block = 1 << 16
    data = os.urandom(5 * block + 123)
    boto3.client("s3").put_object(Bucket=BUCKET, Key="crc/object", Body=data)
    where = object_paths.RemotePath.from_url(f"s3://{BUCKET}/crc/object")
    for reads in ([], [(0, 10)], [(block + 5, 3 * block)], [(0, len(data))]):
        first = object_reads.RemoteFile(where, block=block, checksums=True)  # one worker's reader
        second = object_reads.RemoteFile(where, block=block, checksums=True)  # another's, which checks
        try:
            for offset, length in reads:
                assert first.pread(length, offset) == data[offset:offset + length]
            for future in list(first._blocks.values()):  # its reads ahead land: their checksums known
                future.result()
            known = first.block_checksums()
            before = second.bytes_requested
            assert second.crc32([known]) == zlib.crc32(data)
            unread = [i for i in range(6) if i not in known[1]]
            assert second.bytes_requested - before == sum(min(len(data), (i + 1) * block) - i * block
                                                          for i in unread)
        finally:
            first.close()
            second.close()
    with pytest.raises(ValueError, match="checksums=True"):
        object_reads.RemoteFile(where).crc32()


def test_a_damaged_ema_on_s3_is_refused_after_the_fold_and_nothing_is_published(run, tmp_path):
    local, _ = run
    src, out, steps = _ema_of_the_first_steps(local, "flip", "--workers", "2")
    _upload_the_rest(steps, "flip")
    client = boto3.client("s3")
    victim = max((k for k in keys_under(out) if k.endswith(".distcp")),
                 key=lambda k: client.head_object(Bucket=BUCKET, Key=f"flip/ema/{k}")["ContentLength"])
    data = bytearray(client.get_object(Bucket=BUCKET, Key=f"flip/ema/{victim}")["Body"].read())
    data[len(data) // 2] ^= 0x10  # one bit of tensor data: the size stays, the CRC-32 does not
    client.put_object(Bucket=BUCKET, Key=f"flip/ema/{victim}", Body=bytes(data))
    before = {k: client.get_object(Bucket=BUCKET, Key=f"flip/ema/{k}")["Body"].read()
              for k in keys_under(out) if not k.startswith(".ema-ckpt-staging/")}
    for workers in ("1", "2"):
        message = cli("accumulate", src, "--decay", "0.9", "--out", out, "--workers", workers, code=3)
        assert len(message.strip().splitlines()) == 1, message
        assert "does not match its manifest" in message and victim in message and "CRC-32" in message
        assert sorted(keys_under(out)) == sorted(before)  # what the run had uploaded is gone again
        after = {k: client.get_object(Bucket=BUCKET, Key=f"flip/ema/{k}")["Body"].read() for k in before}
        assert after == before  # the damaged EMA is left as it is; nothing was published over it


def test_single_file_and_resharded_outputs_on_s3(run, tmp_path):
    local, url = run
    step = max((p.name for p in local.iterdir()), key=lambda name: int(name.split("_")[-1]))
    cli("consolidate", f"{url}/{step}", "--out", f"s3://{BUCKET}/out/model.safetensors")
    cli("consolidate", local / step, "--out", tmp_path / "model.safetensors")
    boto3.client("s3").download_file(BUCKET, "out/model.safetensors", str(tmp_path / "from-s3.safetensors"))
    assert (tmp_path / "from-s3.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()
    # beside it only the record of its released lock
    assert keys_under(f"s3://{BUCKET}/out") == [".model.safetensors.lock/000000000001", "model.safetensors"]
    cli("reshard", local / step, "--world-size", "3", "--out", f"s3://{BUCKET}/out/resharded")
    cli("reshard", local / step, "--world-size", "3", "--out", tmp_path / "resharded")
    assert_same(dcp_tensors(download(f"s3://{BUCKET}/out/resharded", tmp_path / "r")),
                dcp_tensors(tmp_path / "resharded"))


def test_a_run_acting_on_a_stale_view_of_the_lock_never_takes_it_from_its_holder(s3, monkeypatch):
    """The interleavings a race can produce, made on purpose: a contender decides from a
    listing taken before another run took the lock (the dead holder's object still the
    highest, or no object at all), then acts. It must not end up holding the lock too."""
    from ema_ckpt.storage import as_path
    from ema_ckpt.storage.object_lock import RemoteLock

    final = as_path(f"s3://{BUCKET}/stale-view/ema")
    dead = {"owner": "dead-host:1:abc", "expires": time.time() - 1}
    boto3.client("s3").put_object(Bucket=BUCKET, Key="stale-view/.ema.lock/000000000001",
                                  Body=json.dumps(dead).encode())
    with RemoteLock(final, lease=60) as holder:
        assert holder.number == 2  # the dead run's object 1 deleted
        for stale in ((1, dead), (0, None)):  # what a contender saw before the holder took it
            late = RemoteLock(final, lease=60)
            monkeypatch.setattr(late, "_holder", lambda stale=stale: stale)
            taken, _ = late._try()
            assert not taken and late.number == 0
            holder.check()
        assert [k for k in keys_under(f"s3://{BUCKET}/stale-view") if ".lock" in k] == [".ema.lock/000000000002"]


def test_a_holder_whose_lease_ran_out_cannot_publish_or_release_the_next_holders_lock(s3):
    from ema_ckpt.errors import OutputError
    from ema_ckpt.storage import as_path
    from ema_ckpt.storage.object_lock import RemoteLock

    final = as_path(f"s3://{BUCKET}/stale/ema")
    slow = RemoteLock(final, lease=0.6)
    slow.__enter__()
    slow._stop.set()  # frozen (a stopped VM, a long pause): it renews no more
    slow._renewer.join()
    record = f"stale/.ema.lock/{slow.number:012d}"

    def expired() -> bool:  # by the clock the next run judges it with: its last renewal's lease is over
        doc = json.loads(boto3.client("s3").get_object(Bucket=BUCKET, Key=record)["Body"].read())
        return float(doc["expires"]) < time.time()

    wait_for(expired, 60, what=f"the lease of {record} to run out")
    with RemoteLock(final, lease=60) as fresh:
        assert fresh.number == slow.number + 1
        with pytest.raises(OutputError, match="was lost"):
            slow.check()  # before its commit: nothing is published
        slow.__exit__(None, None, None)  # its release touches nothing of the new holder's
        fresh.check()
        assert [k for k in keys_under(f"s3://{BUCKET}/stale") if ".lock" in k] == [f".ema.lock/{fresh.number:012d}"]


def _server_gone_after_one_write(data_key: str) -> Faults:
    """The server stopped after the first PUT of a data file (``data_key`` in its key): every
    request from then on is answered 503 SlowDown. Only keys count: a manifest that names the
    data files in its body is no write of one."""
    return Faults(refuse_after_writes=1, refuse_status=503, error_body=SLOW_DOWN, data_key=data_key,
                  name_in_body=False)


SHARD = "2KB"  # several shards of the test model


def _objects(url: str) -> dict[str, bytes]:
    """Every object under ``url``, by key relative to it."""
    client = boto3.client("s3")
    prefix = url.removeprefix(f"s3://{BUCKET}/").rstrip("/")
    return {k: client.get_object(Bucket=BUCKET, Key=f"{prefix}/{k}")["Body"].read() for k in keys_under(url)}


def _untagged(name: str) -> str:
    """``model-00001-of-00002.<generation>.safetensors`` → the local name ``model-00001-of-00002.safetensors``."""
    parts = name.split(".")
    return f"{parts[0]}.safetensors" if len(parts) == 3 and parts[2] == "safetensors" else name


def assert_hf_layout_as_local(url: str, local: Path) -> None:
    """The HF layout at ``url`` is ``local``'s: each shard byte for byte, the index but for the
    shards' generation tag, and nothing else there."""
    there = _objects(url)
    index = json.loads(there["model.safetensors.index.json"])
    named = set(index["weight_map"].values())
    assert set(there) == named | {"model.safetensors.index.json"}, sorted(there)
    assert {_untagged(n) for n in named} == {p.name for p in local.iterdir()} - {"model.safetensors.index.json"}
    for name in named:
        assert there[name] == (local / _untagged(name)).read_bytes(), name
    index["weight_map"] = {k: _untagged(v) for k, v in index["weight_map"].items()}
    assert index == json.loads((local / "model.safetensors.index.json").read_text())


def assert_reads_as(url: str, local: Path) -> None:
    """ema-ckpt's reader, straight from the bucket, gives ``local``'s tensors."""
    with open_checkpoint(as_path(url)) as there, open_checkpoint(local) as here:
        specs = here.specs()
        assert there.specs().keys() == specs.keys()
        for key, spec in specs.items():
            full = Box((0,) * len(spec.shape), tuple(spec.shape))
            assert torch.equal(there.read(key, full), here.read(key, full)), key


def test_hf_sharded_consolidate_to_s3_is_the_local_layout_and_loads(run, tmp_path):
    local, url = run
    steps = steps_of(local)
    out = f"s3://{BUCKET}/hf/model"
    cli("consolidate", f"{url}/{steps[-1].name}", "--out", f"{out}/", "--max-shard-size", SHARD, "--workers", "2")
    cli("consolidate", steps[-1], "--out", f"{tmp_path / 'hf'}/", "--max-shard-size", SHARD)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert_hf_layout_as_local(out, tmp_path / "hf")
    assert_reads_as(out, tmp_path / "hf")
    assert json.loads(cli("verify", out, "--json"))["ok"] is True
    shards = download(out, tmp_path / "hf-s3")
    loaded = {k: v for f in sorted(shards.glob("*.safetensors")) for k, v in load_file(f).items()}
    expected = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert_same(loaded, expected)
    # a rerun over it: a new generation of shards, the old ones removed, only the new index's names left
    first = set(keys_under(out))
    cli("consolidate", steps[1], "--out", f"{out}/", "--max-shard-size", SHARD, "--overwrite")
    cli("consolidate", steps[1], "--out", f"{tmp_path / 'hf1'}/", "--max-shard-size", SHARD)
    assert not (first - {"model.safetensors.index.json"}) & set(keys_under(out))
    assert_hf_layout_as_local(out, tmp_path / "hf1")
    # one shard (model.safetensors alone), then shards again: each layout replaces the other whole
    cli("consolidate", steps[1], "--out", f"{out}/", "--overwrite")
    assert keys_under(out) == ["model.safetensors"]
    cli("consolidate", steps[1], "--out", f"{out}/", "--max-shard-size", SHARD, "--overwrite")
    assert_hf_layout_as_local(out, tmp_path / "hf1")
    # a run holding the output's lock: the other refuses, writing nothing
    client = boto3.client("s3")
    held = sorted(k for k in keys_under(f"s3://{BUCKET}/hf") if k.startswith(".model.lock/"))[-1]
    number = int(held.rsplit("/", 1)[1]) + 1
    client.put_object(Bucket=BUCKET, Key=f"hf/.model.lock/{number:012d}",
                      Body=json.dumps({"owner": "other-host:1:abc", "expires": time.time() + 600}).encode())
    message = cli("consolidate", steps[-1], "--out", f"{out}/", "--max-shard-size", SHARD, "--overwrite", code=75)
    assert "another ema-ckpt run" in message
    client.delete_object(Bucket=BUCKET, Key=f"hf/.model.lock/{number:012d}")
    assert_hf_layout_as_local(out, tmp_path / "hf1")


def test_a_consolidate_killed_after_its_index_is_finished_by_the_next_run(run, tmp_path, monkeypatch):
    import ema_ckpt.storage.object_publish as remote_output

    local, _ = run
    steps = steps_of(local)
    out = f"s3://{BUCKET}/hf-after/model"
    cli("consolidate", steps[1], "--out", f"{out}/", "--max-shard-size", SHARD)
    old = set(keys_under(out))

    def killed(*args: object) -> None:
        raise KeyboardInterrupt  # as a run stopped between the index's PUT and the clean-up

    with monkeypatch.context() as patch:
        patch.setattr(remote_output, "_clean_up", killed)
        runner.invoke(app, ["consolidate", str(steps[-1]), "--out", f"{out}/", "--max-shard-size", SHARD,
                            "--overwrite"])
    cli("consolidate", steps[-1], "--out", f"{tmp_path / 'new'}/", "--max-shard-size", SHARD)
    assert_reads_as(out, tmp_path / "new")  # the new index is the output; the old shards are garbage
    assert old - {"model.safetensors.index.json"} <= set(keys_under(out))
    notes = remote_output.recover_remote(as_path(out))
    assert len(notes) == 1 and notes[0].startswith("finished"), notes
    assert_hf_layout_as_local(out, tmp_path / "new")


def test_a_consolidate_cut_off_mid_upload_leaves_the_previous_shards_and_the_rerun_recovers(run, s3, tmp_path,
                                                                                            monkeypatch):
    local, _ = run
    steps = steps_of(local)
    out = f"s3://{BUCKET}/hf-cut/model"
    cli("consolidate", steps[1], "--out", f"{out}/", "--max-shard-size", SHARD)
    cli("consolidate", steps[1], "--out", f"{tmp_path / 'old'}/", "--max-shard-size", SHARD)
    before = _objects(out)
    proxy, endpoint = fault_proxy(s3, _server_gone_after_one_write(".safetensors"))  # gone after one shard
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("EMA_CKPT_LOCK_LEASE", "2")
    try:
        _use_endpoint(endpoint)
        message = cli("consolidate", steps[-1], "--out", f"{out}/", "--max-shard-size", SHARD, "--overwrite", code=9)
    finally:
        _use_endpoint(s3)
        proxy.shutdown()
    assert len(message.strip().splitlines()) == 1
    after = _objects(out)
    assert any(k.startswith(".ema-ckpt-staging/") for k in after)
    assert {k: v for k, v in after.items() if k in before} == before  # the previous output, untouched
    assert_reads_as(out, tmp_path / "old")
    cli("consolidate", steps[-1], "--out", f"{out}/", "--max-shard-size", SHARD, "--overwrite", "--wait", "20")
    cli("consolidate", steps[-1], "--out", f"{tmp_path / 'new'}/", "--max-shard-size", SHARD)
    assert_hf_layout_as_local(out, tmp_path / "new")  # the cut-off run's shard and marker removed


def _same_sweep(url: str, local: Path, names: list[str]) -> None:
    for name in names:
        there = _objects(f"{url}/{name}")
        assert sorted(there) == ["ema-ckpt.json", "model.safetensors"], sorted(there)
        assert there["model.safetensors"] == (local / name / "model.safetensors").read_bytes(), name
        manifest = json.loads(there["ema-ckpt.json"])
        assert manifest["files"] == json.loads((local / name / "ema-ckpt.json").read_text())["files"]
        assert json.loads(cli("verify", f"{url}/{name}", "--json"))["ok"] is True


def test_posthoc_safetensors_sweep_to_s3_writes_each_local_output(run, tmp_path):
    local, url = run
    names = ["sigma_rel_0.05", "sigma_rel_0.1"]
    out = f"s3://{BUCKET}/sweep/posthoc"
    cli("posthoc", url, "--sigma-rel", "0.05,0.1", "--format", "safetensors", "--out", out)
    cli("posthoc", local, "--sigma-rel", "0.05,0.1", "--format", "safetensors", "--out", tmp_path / "posthoc")
    _same_sweep(out, tmp_path / "posthoc", names)
    assert keys_under(out) == [f"{n}/{f}" for n in names for f in ("ema-ckpt.json", "model.safetensors")]
    cli("average", url, "--last", "2", "--format", "safetensors", "--out", f"s3://{BUCKET}/sweep/avg")
    cli("average", local, "--last", "2", "--format", "safetensors", "--out", tmp_path / "avg")
    _same_sweep(f"s3://{BUCKET}/sweep", tmp_path, ["avg"])


def test_a_sweep_cut_off_between_an_outputs_data_and_manifest_is_finished_by_the_next_run(run, s3, tmp_path,
                                                                                          monkeypatch):
    from ema_ckpt.storage.object_publish import recover_remote

    local, _ = run
    steps = steps_of(local)
    for step in steps[:3]:
        upload(step, f"sweep-cut/ckpts/{step.name}")
    src, out = f"s3://{BUCKET}/sweep-cut/ckpts", f"s3://{BUCKET}/sweep-cut/posthoc"
    names = ["sigma_rel_0.05", "sigma_rel_0.1"]
    args = ["--sigma-rel", "0.05,0.1", "--format", "safetensors"]
    cli("posthoc", src, *args, "--out", out)
    before = {name: _objects(f"{out}/{name}") for name in names}
    for step in steps[3:]:
        upload(step, f"sweep-cut/ckpts/{step.name}")
    # the first output's model.safetensors is put (its switch); its manifest is not
    proxy, endpoint = fault_proxy(s3, _server_gone_after_one_write("model.safetensors"))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("EMA_CKPT_LOCK_LEASE", "2")
    try:
        _use_endpoint(endpoint)
        cli("posthoc", src, *args, "--out", out, "--overwrite", code=9)
    finally:
        _use_endpoint(s3)
        proxy.shutdown()
    first, second = (_objects(f"{out}/{name}") for name in names)
    assert first["model.safetensors"] != before[names[0]]["model.safetensors"]
    assert first["ema-ckpt.json"] == before[names[0]]["ema-ckpt.json"]  # the window: verify says so
    assert "CRC-32" in cli("verify", f"{out}/{names[0]}", code=3)
    assert {k: v for k, v in second.items() if not k.startswith(".ema-ckpt")} == before[names[1]]
    notes = recover_remote(as_path(f"{out}/{names[0]}")) + recover_remote(as_path(f"{out}/{names[1]}"))
    assert [n.split()[0] for n in notes] == ["finished", "removed"], notes
    assert json.loads(cli("verify", f"{out}/{names[0]}", "--json"))["ok"] is True
    assert _objects(f"{out}/{names[1]}") == before[names[1]]
    cli("posthoc", src, *args, "--out", out, "--overwrite", "--wait", "20")
    cli("posthoc", local, *args, "--out", tmp_path / "posthoc")
    _same_sweep(out, tmp_path / "posthoc", names)


def test_workers_and_a_sweep_write_to_s3_the_bytes_of_one_local_worker(run, tmp_path):
    local, url = run
    cli("accumulate", url, "--decay", "0.9", "--out", f"s3://{BUCKET}/w2/ema", "--workers", "2")
    cli("accumulate", local, "--decay", "0.9", "--out", tmp_path / "ema-local")
    assert_same(dcp_tensors(download(f"s3://{BUCKET}/w2/ema", tmp_path / "w2")), dcp_tensors(tmp_path / "ema-local"))
    cli("posthoc", url, "--sigma-rel", "0.05,0.1", "--out", f"s3://{BUCKET}/w2/posthoc")
    cli("posthoc", local, "--sigma-rel", "0.05,0.1", "--out", tmp_path / "posthoc")
    assert [k for k in keys_under(f"s3://{BUCKET}/w2/posthoc") if k.endswith("ema-ckpt.json")] == [
        "sigma_rel_0.05/ema-ckpt.json", "sigma_rel_0.1/ema-ckpt.json"]
    for name in ("sigma_rel_0.05", "sigma_rel_0.1"):
        there = download(f"s3://{BUCKET}/w2/posthoc/{name}", tmp_path / "p" / name)
        assert_same(dcp_tensors(there), dcp_tensors(tmp_path / "posthoc" / name))


def test_two_torchrun_agents_sharing_no_filesystem_write_the_bytes_of_one_worker(run, s3, tmp_path):
    """Inputs and output on S3; each agent ("node") stages on its own directory."""
    from tests.test_multinode import _agent_command, _env, _start
    from tests.torchrun import free_port

    local, url = run
    out = f"s3://{BUCKET}/nodes/ema"
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    agents, logs, disks = [], [], []
    for node in ("a", "b"):
        disk = tmp_path / f"node-{node}-disk"
        disk.mkdir()
        disks.append(disk)
        logs.append(tmp_path / f"node-{node}.log")
        env = _env(AWS_ENDPOINT_URL=s3, EMA_CKPT_STAGING_DIR=str(disk))
        cmd = _agent_command(endpoint, run_id, ["accumulate", url, "--decay", "0.9", "--out", out], host=node == "a")
        agents.append(_start(cmd, logs[-1], env))
    for agent, log in zip(agents, logs, strict=True):
        assert agent.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert all(not any(disk.iterdir()) for disk in disks)  # both nodes' stagings removed
    cli("accumulate", local, "--decay", "0.9", "--out", tmp_path / "ema-local")
    assert_same(dcp_tensors(download(out, tmp_path / "ema-s3")), dcp_tensors(tmp_path / "ema-local"))


TRAINERS = Path(__file__).resolve().parent / "fixtures" / "trainers"


@pytest.mark.parametrize("trainer", ["hf-trainer-fsdp", "accelerate-fsdp2", "torchtitan", "megatron-torch-dist",
                                     "lightning-ddp", "accelerate-plain-bin", "transformers4-bin-sharded"])
def test_trainers_folders_on_s3_fold_as_their_local_copies(s3, trainer, tmp_path):
    """Folders the trainers' own saving code wrote (tests/fixtures/trainers), uploaded as they are."""
    base = TRAINERS / trainer
    local = base / "ckpts"
    if not local.is_dir():  # the trainer's folder itself (torchtitan, Megatron): without the oracle
        local = tmp_path / "ckpts"
        shutil.copytree(base, local, ignore=shutil.ignore_patterns("oracle", "producer.json"))
    url = upload(local, f"trainers/{trainer}")
    cli("accumulate", url, "--decay", "0.9", "--out", tmp_path / "ema-s3")
    cli("accumulate", local, "--decay", "0.9", "--out", tmp_path / "ema-local")
    assert_same(dcp_tensors(tmp_path / "ema-s3"), dcp_tensors(tmp_path / "ema-local"))


def test_an_hf_sharded_output_on_s3_loads_with_from_pretrained(s3, tmp_path):
    """The generation-tagged shard names are what the index names: transformers loads them."""
    from tests.test_trainers import FIXTURES, _llama

    checkpoint = FIXTURES / "hf-trainer-fsdp" / "ckpts" / "checkpoint-6"
    out = f"s3://{BUCKET}/llama/model"
    cli("consolidate", checkpoint, "--out", f"{out}/", "--max-shard-size", "4KB")
    cli("consolidate", checkpoint, "--out", f"{tmp_path / 'local'}/", "--max-shard-size", "4KB")
    folder = download(out, tmp_path / "from-s3")
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(len(name.split(".")) == 3 for name in shards)  # model-…-of-….<generation>.…
    config, model_class = _llama(tie=False)
    config.save_pretrained(folder)
    model, info = model_class.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    local = {}
    for shard in (tmp_path / "local").glob("model-*.safetensors"):
        local.update(load_file(shard))
    state = model.state_dict()
    assert sorted(local) == sorted(state)
    for key, value in local.items():
        assert torch.equal(state[key], value.float()), key


@pytest.mark.parametrize("trainer", ["accelerate-plain", "olmo-core-style"])
def test_steps_recorded_in_torch_files_are_read_on_s3(s3, trainer):
    """A step recorded in a torch file beside the weights (accelerate's optimizer.bin counters,
    OLMo-core's train/rank0.pt) is read from object storage as from a local disk."""
    from ema_ckpt.discovery import discover

    local = TRAINERS / trainer / "ckpts"
    url = upload(local, f"steps/{trainer}")
    here, there = ([(c.step, str(c.step_source)) for c in discover([p]).checkpoints] for p in (local, as_path(url)))
    assert there == here and all(" in optimizer.bin" in s or "train/rank0.pt" in s for _, s in here), here
