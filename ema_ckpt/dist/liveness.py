"""Bounded waits in a group of workers: joining it, and peers that fall silent.

torch.distributed waits hours for a peer, and never notices one that stops without closing its
sockets (a node powered off, a network cut). So the group is joined through its store with a
deadline, and every worker then keeps a heartbeat there: a peer whose counter has not moved for
``EMA_CKPT_PEER_TIMEOUT`` seconds (60), or a store unreachable as long, ends the run on every
surviving worker with :class:`PeerLostError` (exit 8). A worker whose launcher died stops at once,
as SIGTERM stops a run.

Example:
    >>> peer_timeout({"EMA_CKPT_PEER_TIMEOUT": "5"})
    5.0
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .._env import seconds
from ..errors import PeerLostError

PEER_TIMEOUT_VARIABLE = "EMA_CKPT_PEER_TIMEOUT"
JOIN_TIMEOUT_VARIABLE = "EMA_CKPT_JOIN_TIMEOUT"
_DEFAULT_PEER_TIMEOUT = 60.0
_DEFAULT_JOIN_TIMEOUT = 300.0
_DONE = b"done"


def peer_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds a silent peer is waited for (``EMA_CKPT_PEER_TIMEOUT``, default 60)."""
    return seconds(PEER_TIMEOUT_VARIABLE, _DEFAULT_PEER_TIMEOUT, env)


def join_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds every worker has to join the group (``EMA_CKPT_JOIN_TIMEOUT``, default 300)."""
    return seconds(JOIN_TIMEOUT_VARIABLE, _DEFAULT_JOIN_TIMEOUT, env)


def open_store(host: str, port: int, *, serve: bool, timeout: float, listening: socket.socket | None = None) -> Any:
    """A client of the group's TCP store at ``host:port`` (its server too when ``serve``, on the
    ``listening`` socket: clients arriving first then connect at once, not a back-off later)."""
    import torch.distributed as dist

    listen_fd = listening.detach() if serve and listening is not None else None
    # TCPStore and PrefixStore are documented torch.distributed API, not in its __all__
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, None, serve, datetime.timedelta(seconds=timeout), wait_for_workers=False,
            master_listen_fd=listen_fd)
    except (RuntimeError, ValueError) as err:  # DistNetworkError / DistStoreError: no store there in time
        raise PeerLostError(f"cannot reach the workers' store at {host}:{port} within {timeout:.0f} s "
                            f"({first_line(err)})") from None
    # torchrun's store outlives a restart of the workers: each attempt gets its own keys
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ema-ckpt/{attempt}/", store)  # type: ignore[attr-defined]


def first_line(err: BaseException) -> str:
    """An error's first line, at most 200 characters, for a one-line message."""
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def join(store: Any, rank: int, world_size: int, *, timeout: float,
         gone: Callable[[], str | None] = lambda: None, longest_pause: float = 0.2) -> None:
    """Announce this rank in ``store`` and wait until all ``world_size`` ranks have
    (:class:`PeerLostError` after ``timeout``, or at once when ``gone`` names a spawned worker
    that exited); polled at most ``longest_pause`` seconds apart."""
    store.set(f"beat/{rank}", "0")
    store.set(f"joined/{rank}", socket.gethostname())
    keys = [f"joined/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not store.check(keys):  # polled: a blocking wait logs a warning at every timeout
        reason = gone()
        if reason is not None:
            raise PeerLostError(f"{reason} before joining the workers")
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
            raise PeerLostError(f"worker{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                                f"{world_size} did not join within {timeout:.0f} s "
                                f"({JOIN_TIMEOUT_VARIABLE} sets the wait)")
        time.sleep(pause)
        pause = min(longest_pause, pause * 2)


class Heartbeat:
    """This rank's heartbeat in the group's store, and the watch on its peers' (a thread).

    ``lost`` becomes the error to raise once a peer is silent for ``timeout`` seconds; a process
    a launcher started (``watch_parent``) still running ``grace`` seconds later is ended.
    ``on_lost`` runs at once (rank 0 of ``--workers`` kills its workers, ending its collective).
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, timeout: float, grace: float = 5.0,
                 on_lost: Callable[[], None] = lambda: None, watch_parent: bool = False) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.on_lost, self.watch_parent = on_lost, watch_parent
        self.timeout, self.grace = timeout, grace
        self.interval = min(5.0, max(0.05, timeout / 6))
        self.lost: PeerLostError | None = None
        self._seen_by_run = False  # the run raised ``lost`` itself and is ending
        self._stop = threading.Event()
        self._parent = os.getppid()
        now = time.monotonic()
        self._reached = now  # the last store call that answered
        self._seen: dict[int, tuple[bytes, float]] = {r: (b"", now) for r in range(world_size) if r != rank}
        self._thread = threading.Thread(target=self._run, name="ema-ckpt-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Leave the group cleanly: peers stop watching this rank."""
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)
        with contextlib.suppress(Exception):  # the store went first: nobody is watching any more
            self.store.set(f"beat/{self.rank}", _DONE)

    def raise_if_lost(self) -> None:
        """Raise :attr:`lost`, if set: before a collective that could wait for the lost peer."""
        if self.lost is not None:
            self._seen_by_run = True
            raise self.lost

    def _run(self) -> None:
        """Judge from what :meth:`_beat` last saw; never blocks on the store itself."""
        beating = threading.Thread(target=self._beat, name="ema-ckpt-heartbeat-io", daemon=True)
        beating.start()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if self.watch_parent and os.getppid() != self._parent:
                self._orphaned()
                return
            if now - self._reached > self.timeout:  # a store call failing or hanging (a cut link)
                self._end(PeerLostError(f"worker {self.rank} lost the workers' store for {self.timeout:.0f} s "
                                        f"(the coordinator's node is down or unreachable)"))
                return
            for peer, (value, since) in list(self._seen.items()):
                if value != _DONE and now - since > self.timeout:
                    self._end(PeerLostError(f"worker {peer} has not answered for {self.timeout:.0f} s "
                                            f"(its node is down, unreachable or stopped; "
                                            f"{PEER_TIMEOUT_VARIABLE} sets the wait)"))
                    return

    def _beat(self) -> None:
        """Write this rank's counter, read the peers': the only thread that talks to the store."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        keys = [f"beat/{r}" for r in peers]
        count = 0
        while not self._stop.wait(self.interval):
            count += 1
            try:
                self.store.set(f"beat/{self.rank}", str(count))
                values = self.store.multi_get(keys)
            except Exception:
                continue
            now = time.monotonic()
            self._reached = now
            for peer, value in zip(peers, values, strict=True):
                if value != self._seen[peer][0]:
                    self._seen[peer] = (value, now)

    def _orphaned(self) -> None:
        """The launcher died (torchrun killed, rank 0 gone): stop as SIGTERM stops a run, at once."""
        self.lost = PeerLostError(f"worker {self.rank}: its launcher (process {self._parent}) is gone")
        sys.stderr.write(f"error: {self.lost}\n")
        sys.stderr.flush()
        self._seen_by_run = True  # said once, here
        os.kill(os.getpid(), signal.SIGTERM)  # the console script removes the staging and exits 143
        if not self._stop.wait(self.grace):
            os._exit(self.lost.exit_code)

    def _end(self, error: PeerLostError) -> None:
        self.lost = error
        with contextlib.suppress(Exception):
            self.on_lost()
        if not self.watch_parent:
            # a process no launcher started (rank 0 of --workers, maybe a caller's own program) is
            # never ended from here: killing its spawned workers has closed their sockets, which
            # ends its collective with an error
            return
        if self._stop.wait(self.grace):
            return  # the run ended in the meantime
        if self._seen_by_run and self._stop.wait(6 * self.grace):
            return  # it is ending on its own, message printed
        if not self._seen_by_run:
            sys.stderr.write(f"error: {error}\n")
            sys.stderr.flush()
        os._exit(error.exit_code)
