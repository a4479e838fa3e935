"""An exclusive lock on an output in object storage: numbered objects created by conditional
PUTs, with a lease its holder renews (a killed run's lock expires).

Example:
    >>> with RemoteLock(RemotePath.from_url("s3://b/ema")):   # doctest: +SKIP
    ...     ...
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from typing import Any, Protocol

from .._env import seconds
from ..errors import OutputError, OutputLockedError
from .object_paths import RemotePath, delete_objects

LOCK_LEASE_SECONDS = 60.0
"""How long a lock is honoured after its holder last renewed it (``EMA_CKPT_LOCK_LEASE``)."""
LEASE_ENV = "EMA_CKPT_LOCK_LEASE"


class HeldLock(Protocol):
    """A held output lock; :meth:`check` raises if it was lost."""

    def check(self) -> None: ...


class RemoteLock:
    """An exclusive lock on an output in object storage, under ``.<name>.lock/`` beside it.

    Numbered objects (``.ema.lock/000000000007``), each created with a conditional PUT
    (``If-None-Match: *``), so of runs creating one number, one succeeds. The highest is the
    lock: its owner and an expiry :data:`LOCK_LEASE_SECONDS` ahead, renewed by the owner (a
    thread, a third of the lease apart) rewriting its own object. A run takes a free lock (none,
    or the highest released or expired) by creating the next number, then confirms it is still
    the highest and deletes those below. No run that does not hold the lock overwrites or
    deletes anything, so of two runs racing for an expired lock, one gets it. A store without
    conditional writes is refused (:class:`~ema_ckpt.errors.OutputError`): two runs could both publish.
    """

    def __init__(self, final: RemotePath, *, wait_seconds: float = 0.0, lease: float | None = None) -> None:
        self.final = final
        self.path = final.parent / f".{final.name}.lock"
        self.wait_seconds = wait_seconds
        self.lease = lease if lease is not None else seconds(LEASE_ENV, LOCK_LEASE_SECONDS)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}"
        self.number = 0  # the lock object this run holds (0: none)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = False

    def _object(self, number: int) -> RemotePath:
        return self.path / f"{number:012d}"

    def _body(self, *, released: bool = False) -> bytes:
        doc: dict[str, Any] = {"owner": self.owner, "expires": 0.0 if released else time.time() + self.lease}
        if released:
            doc["released"] = True
        return json.dumps(doc).encode()

    def _numbers(self) -> list[int]:
        try:
            names = [p.name for p in self.path.iterdir(fresh=True)]
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def _read(self, number: int) -> dict[str, Any] | None:
        try:
            doc = json.loads(self._object(number).read_bytes())
        except FileNotFoundError:
            return None
        except ValueError:
            return {"owner": "?", "expires": 0.0}  # unreadable: treated as expired
        return doc if isinstance(doc, dict) else {"owner": "?", "expires": 0.0}

    @staticmethod
    def _free(holder: dict[str, Any] | None) -> bool:
        return holder is None or float(holder.get("expires", 0)) <= time.time()

    def _holder(self) -> tuple[int, dict[str, Any] | None]:
        """The highest lock object's number and what it holds (0, None: no lock yet)."""
        numbers = self._numbers()
        return (numbers[-1], self._read(numbers[-1])) if numbers else (0, None)

    def _try(self) -> tuple[bool, dict[str, Any] | None]:
        """One attempt: (taken, the holder that kept it from this run)."""
        top, holder = self._holder()
        if top and not self._free(holder):
            return False, holder
        mine = top + 1
        try:
            self._object(mine).write_bytes(self._body(), exclusive=True)
        except FileExistsError:
            return False, None  # another run took this number first: look again
        except (TypeError, NotImplementedError):
            raise OutputError(f"{self.path}: {self.path.protocol}:// offers no conditional write, so "
                              "two runs could both publish this output; write it to a local disk or a "
                              "shared filesystem instead") from None
        if self._numbers()[-1:] != [mine]:  # a run that listed earlier made a higher one
            delete_objects([self._object(mine)])
            return False, None
        self.number = mine
        delete_objects([self._object(n) for n in self._numbers() if n < mine])
        return True, None

    def __enter__(self) -> RemoteLock:
        deadline = time.monotonic() + self.wait_seconds
        pause = 0.05
        while True:
            taken, holder = self._try()
            if taken:
                break
            if holder is None:
                continue  # a race for a free lock, lost: look again at once
            if time.monotonic() >= deadline:
                raise OutputLockedError(
                    f"{self.final}: another ema-ckpt run is writing this output (lock {self.path.name}, "
                    f"held by {holder.get('owner')}); retry later or pass {{wait_seconds=SECONDS}}",
                    remedy="wait_seconds")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2.0, pause * 2)
        self._renewer = threading.Thread(target=self._renew, name="ema-ckpt-lock-lease", daemon=True)
        self._renewer.start()
        return self

    def _still_mine(self) -> bool:
        """This run's object is the highest, names it, and its lease has not run out."""
        top, holder = self._holder()
        return (top == self.number and holder is not None and holder.get("owner") == self.owner
                and not self._free(holder))

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 3):
            with contextlib.suppress(Exception):  # a failed renewal is retried; the lease covers two misses
                if not self._still_mine():
                    self.lost = True
                    return
                self._object(self.number).write_bytes(self._body())

    def check(self) -> None:
        """Raise if the lock was lost (its lease ran out and another run took it)."""
        if self.lost or not self._still_mine():
            raise OutputError(f"{self.final}: the output's lock {self.path.name} was lost (its lease of "
                              f"{self.lease:.0f} s ran out); nothing was published")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with contextlib.suppress(Exception):
            if self.number and self._still_mine():
                self._object(self.number).write_bytes(self._body(released=True))


__all__ = ["LOCK_LEASE_SECONDS", "RemoteLock"]
