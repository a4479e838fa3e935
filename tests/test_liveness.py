""":mod:`ema_ckpt.dist.liveness`: joining with a deadline, and the heartbeat that notices a silent peer."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from ema_ckpt.dist.liveness import Heartbeat, join, join_timeout, open_store, peer_timeout
from ema_ckpt.errors import OptionError, PeerLostError
from tests.torchrun import free_port
from tests.waiting import has_pending_connection, wait_for

TIMEOUT = 1.5
"""The heartbeats' timeout here: short, yet many times what a thread on a loaded machine may
wait for its turn (a beat every quarter of a second)."""


def test_timeouts_come_from_the_environment():
    assert peer_timeout({}) == 60 and join_timeout({}) == 300
    assert peer_timeout({"EMA_CKPT_PEER_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-3", "soon", "nan", "1e9"):
        with pytest.raises(OptionError, match="EMA_CKPT_PEER_TIMEOUT"):
            peer_timeout({"EMA_CKPT_PEER_TIMEOUT": bad})


@pytest.fixture
def store():
    port = free_port()
    server = open_store("127.0.0.1", port, serve=True, timeout=5)
    yield port, server
    del server


def test_join_names_the_workers_that_never_came(store):
    _port, server = store
    started = time.monotonic()
    with pytest.raises(PeerLostError, match=r"workers 1, 2 of 3 did not join within 1 s \(EMA_CKPT_JOIN_TIMEOUT"):
        join(server, 0, 3, timeout=1.0)
    assert 1.0 <= time.monotonic() - started < 10  # its own deadline, not the default 300 s


def test_join_ends_at_once_when_a_process_it_waits_for_is_gone(store):
    _port, server = store
    with pytest.raises(PeerLostError, match=r"worker 1 .* exited with code 3 before joining"):
        join(server, 0, 2, timeout=60, gone=lambda: "worker 1 (process 7) exited with code 3")


def test_a_peer_that_beats_is_alive_and_one_that_stops_is_lost(store):
    port, server = store
    for rank in (0, 1):
        server.set(f"joined/{rank}", "h")
        server.set(f"beat/{rank}", "0")
    watch = [open_store("127.0.0.1", port, serve=False, timeout=2) for _ in range(2)]
    beats = [Heartbeat(watch[r], r, 2, timeout=TIMEOUT, grace=60).start() for r in (0, 1)]
    try:
        wait_for(lambda: all(server.get(f"beat/{r}") not in (b"0", b"") for r in (0, 1)), what="both to beat")
        time.sleep(2 * TIMEOUT)  # beating for longer than the timeout
        assert beats[0].lost is None and beats[1].lost is None  # both beating
        beats[1]._stop.set()  # rank 1 falls silent without leaving
        started = time.monotonic()
        wait_for(lambda: beats[0].lost is not None, what="the silent peer to be lost")
        # its last beat came up to a beat before it fell silent (two, where its thread waited for its turn)
        assert TIMEOUT - 2 * beats[0].interval < time.monotonic() - started < TIMEOUT + 30
        assert f"worker 1 has not answered for {TIMEOUT:.0f} s" in str(beats[0].lost)
        with pytest.raises(PeerLostError):
            beats[0].raise_if_lost()
    finally:
        for beat in beats:
            beat.stop()


def test_a_peer_that_leaves_cleanly_is_not_lost(store):
    port, server = store
    for rank in (0, 1):
        server.set(f"beat/{rank}", "0")
    beats = [Heartbeat(open_store("127.0.0.1", port, serve=False, timeout=2), r, 2, timeout=TIMEOUT,
                       grace=60).start() for r in (0, 1)]
    try:
        wait_for(lambda: all(server.get(f"beat/{r}") not in (b"0", b"") for r in (0, 1)), what="both to beat")
        beats[1].stop()  # done: marks itself so
        time.sleep(3 * TIMEOUT)  # silent for longer than the timeout
        assert beats[0].lost is None
    finally:
        beats[0].stop()


def test_a_store_that_stops_answering_is_lost_too():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    client = open_store("127.0.0.1", port, serve=False, timeout=0.5)
    client.set("beat/0", "0")
    client.set("beat/1", "0")
    beat = Heartbeat(client, 0, 2, timeout=0.8, grace=60)
    beat._beat = lambda: None  # type: ignore[method-assign]  # as if every store call hung
    beat.start()
    try:
        wait_for(lambda: beat.lost is not None, what="the store to be lost")
        assert "lost the workers' store" in str(beat.lost)
    finally:
        beat.stop()
        del server


def test_a_store_served_on_a_listening_socket_takes_it_and_clients_may_come_first():
    import threading

    from ema_ckpt.dist.pool import _listening_socket

    listening = _listening_socket()
    port = listening.getsockname()[1]
    found: list[bytes] = []

    def early_client() -> None:  # connects before the store exists: the kernel holds the connection
        client = open_store("127.0.0.1", port, serve=False, timeout=10)
        found.append(client.get("ready"))

    thread = threading.Thread(target=early_client)
    thread.start()
    wait_for(lambda: has_pending_connection(listening), what="the client to connect")
    server = open_store("127.0.0.1", port, serve=True, timeout=10, listening=listening)
    assert listening.fileno() == -1  # the store owns the descriptor now
    server.set("ready", "yes")
    thread.join(timeout=10)
    assert found == [b"yes"]
    del server
