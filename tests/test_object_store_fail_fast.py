"""A store that takes reads and never answers: the first read that exhausts its attempts ends the run.

A loopback proxy in front of moto's server forwards every listing, ``HEAD`` and small read, but
takes each ``GET`` of a data file (``.distcp``) and never answers it. ``ema-ckpt accumulate``
runs as its own process (its exit, not only its error, must not wait for the reads in flight),
with the default settings but a shorter ``EMA_CKPT_REMOTE_TIMEOUT``.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ema_ckpt.errors import RemoteStorageError
from ema_ckpt.storage import object_clients, object_outages
from ema_ckpt.storage.object_paths import RemotePath, read_call
from ema_ckpt.storage.object_reads import RemoteFile
from tests import object_stores
from tests.dcp_helpers import write_dcp
from tests.object_stores import BUCKET, ProxyServer, start_proxy
from tests.waiting import wait_for

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")

s3 = object_stores.s3  # moto's server (module-scoped fixture)

EMA_CKPT = Path(sys.executable).with_name("ema-ckpt")
TIMEOUT = 2.0
"""``EMA_CKPT_REMOTE_TIMEOUT`` of the test (the default, 20 s, makes the bound about a minute)."""
ATTEMPTS = 3
"""``EMA_CKPT_REMOTE_ATTEMPTS``' default: left as it is."""
BACKOFF = 1.0 + 2.0
"""botocore's most between 3 attempts (standard mode: a random wait of up to 1, then 2 s)."""


@dataclass
class Stalls:
    """What a :func:`stalling_proxy` took and never answered: (arrival, key, range) of each ``GET``."""

    suffix: str = ".distcp"
    taken: list[tuple[float, str, str]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


def stalling_proxy(target: str, stalls: Stalls) -> tuple[ProxyServer, str]:
    """A :func:`~tests.object_stores.start_proxy` in front of ``target`` that takes each ``GET`` of
    an object whose key ends with ``stalls.suffix``, and not a byte comes back until
    ``stalls.release`` is set."""

    def intercept(handler: http.server.BaseHTTPRequestHandler, body: bytes) -> bool:
        key = urllib.parse.unquote(urllib.parse.urlsplit(handler.path).path)
        if handler.command != "GET" or not key.endswith(stalls.suffix):
            return False
        with stalls.lock:
            stalls.taken.append((time.monotonic(), key, handler.headers.get("Range") or ""))
        stalls.release.wait()
        handler.close_connection = True
        return True

    return start_proxy(target, intercept)


@pytest.fixture(scope="module")
def run_url(s3: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Three DCP checkpoints of two ranks each (two data files a step, several MiB each) on S3."""
    local = tmp_path_factory.mktemp("fail-fast") / "ckpts"
    for step in (10, 20, 30):
        tensors = {f"model.w{i}": torch.full((1 << 19,), float(step + i)) for i in range(4)}
        write_dcp(local / f"step_{step}", tensors, world_size=2)
    client = boto3.client("s3")
    for file in sorted(local.rglob("*")):
        if file.is_file():
            client.upload_file(str(file), BUCKET, f"stall/ckpts/{file.relative_to(local).as_posix()}")
    return f"s3://{BUCKET}/stall/ckpts"


def test_the_first_exhausted_read_ends_the_run(s3: str, run_url: str, tmp_path: Path) -> None:
    stalls = Stalls()
    proxy, endpoint = stalling_proxy(s3, stalls)
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, EMA_CKPT_REMOTE_TIMEOUT=f"{TIMEOUT:g}")
    env.pop("EMA_CKPT_REMOTE_ATTEMPTS", None)
    out = tmp_path / "ema"
    try:
        started = time.monotonic()
        done = subprocess.run([str(EMA_CKPT), "accumulate", run_url, "--decay", "0.9", "--out", str(out)],
                              env=env, capture_output=True, text=True, timeout=300)
        ended = time.monotonic()
    finally:
        stalls.release.set()
        proxy.shutdown()
    assert done.returncode == 9, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"error: {run_url}/" in lines[0] and ".distcp" in lines[0], done.stderr
    assert f"no answer within {TIMEOUT:g} s" in lines[0], lines[0]
    assert not out.exists() or sorted(p.name for p in out.iterdir() if p.name != ".ema.lock") == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in ("ema", ".ema.lock")) == []
    assert stalls.taken, "no data file was read through the proxy"

    first = min(at for at, _, _ in stalls.taken)
    bound = ATTEMPTS * TIMEOUT + BACKOFF
    # the run ends once the first read exhausted its attempts: not after the others' attempts,
    # nor after reads started later (margin for a loaded machine, the exit and torch's start)
    assert ended - first < bound + 10, (ended - first, bound, stalls.taken)
    assert ended - started < 120
    # each read tried ATTEMPTS times in all (not ATTEMPTS² by s3fs's two loops), and no read
    # first asked after the first one could have exhausted its attempts
    seen: dict[tuple[str, str], list[float]] = {}
    for at, key, span in stalls.taken:
        seen.setdefault((key, span), []).append(at)
    assert all(len(times) <= ATTEMPTS for times in seen.values()), seen
    assert all(min(times) - first < ATTEMPTS * TIMEOUT for times in seen.values()), seen


def test_reads_in_flight_are_cancelled_and_later_ones_not_started(s3: str, run_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks read ahead side by side (four at once): the first to exhaust its attempts ends
    the read, the others are cancelled, and the blocks queued behind them never asked."""
    stalls = Stalls()
    proxy, endpoint = stalling_proxy(s3, stalls)
    monkeypatch.setenv("EMA_CKPT_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    object_clients.forget_clients()
    try:
        size = boto3.client("s3").head_object(Bucket=BUCKET, Key="stall/ckpts/step_10/__0_0.distcp")["ContentLength"]
        remote = RemoteFile(RemotePath.from_url(f"{run_url}/step_10/__0_0.distcp"), size=size, concurrency=4,
                            block=256 << 10)
        started = time.monotonic()
        with pytest.raises(RemoteStorageError, match="no answer within 1 s") as caught:
            remote.pread(1 << 20, 0)  # 4 blocks wanted, 4 more ahead: 8 requests for 4 workers
        took = time.monotonic() - started
        assert "__0_0.distcp" in str(caught.value)
        assert took < ATTEMPTS * 1.0 + BACKOFF + 5, took
        # every request in flight ends at once; none queued behind them is ever started
        wait_for(lambda: all(f.done() for f in remote._blocks.values()), 60, what="the reads in flight to end")
        first = min(at for at, _, _ in stalls.taken)
        spans = {span for _, _, span in stalls.taken}
        assert len(spans) <= 4, spans
        first_asked = {span: min(at for at, _, s in stalls.taken if s == span) for span in spans}
        assert all(at - first < ATTEMPTS * 1.0 for at in first_asked.values()), stalls.taken
        remote.close()
    finally:
        stalls.release.set()
        proxy.shutdown()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
        object_clients.forget_clients()


def test_a_store_marked_out_is_read_again_at_the_next_look(s3: str, run_url: str) -> None:
    """The mark that stops reads lasts until a new look (a watch tries the store again then)."""
    path = RemotePath.from_url(f"{run_url}/step_10/.metadata")
    object_clients.forget_clients()
    object_outages.trip("s3", RemoteStorageError(f"{path}: no answer (a test)"))
    with pytest.raises(RemoteStorageError, match="a test"):
        read_call(path, path.fs.cat_file, path.key)
    object_clients.forget_listings()
    assert read_call(path, path.fs.cat_file, path.key, start=0, end=4)


def test_each_s3_request_is_tried_the_attempts_set_in_all(s3: str) -> None:
    """botocore tries each request ``EMA_CKPT_REMOTE_ATTEMPTS`` times; s3fs's two loops around it
    (a request, and a ranged read around its request) run once, so the attempts never multiply."""
    fs = object_clients.filesystem("s3")
    assert fs.retries == 1
    retries = fs.config_kwargs["retries"]
    assert retries == {"total_max_attempts": object_clients.request_attempts(), "mode": "standard"}
