"""A store that stopped answering ends the run at its first exhausted request.

The reads of one run fan out (blocks read ahead, several objects open); against a store that
takes requests and never answers, each would spend its whole budget of attempts × timeout, one
after another or side by side, before the run could end. Instead the first read that exhausts
its attempts (or fails for good at the connection: the endpoint unreachable, 5xx past the
retries) marks its store as out (:func:`trip`): the reads of that store still in flight are
cancelled on the client's event loop (their waiters get the same error at once), and no read of
it starts again (:func:`check`) until the mark is cleared, by a new look for checkpoints
(:func:`~ema_ckpt.storage.object_clients.forget_listings`, which a watch takes each interval:
it tries the store again then) or a new client (``forget_clients``).

Only reads are marked and stopped: the writes, deletes and lock releases that clean up after a
failed run are still tried (each within its own bound).

Example:
    >>> clear(); check("s3") is None
    True
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from ..errors import RemoteStorageError

_LOCK = threading.Lock()
_OUT: dict[str, str] = {}  # protocol -> the message of the read that exhausted its attempts
_IN_FLIGHT: dict[str, set[Future[Any]]] = {}


def check(protocol: str) -> None:
    """Raise the store's first exhausted read's error again if ``protocol``'s store is out.

    Raises:
        RemoteStorageError: a read of this store already exhausted its attempts.
    """
    with _LOCK:
        message = _OUT.get(protocol)
    if message is not None:
        raise RemoteStorageError(message)


def trip(protocol: str, error: RemoteStorageError) -> RemoteStorageError:
    """Mark ``protocol``'s store out with ``error`` (the first such error is kept) and cancel its
    reads in flight; the error every read of it raises from now (the first one's)."""
    with _LOCK:
        message = _OUT.setdefault(protocol, str(error))
        pending = list(_IN_FLIGHT.get(protocol, ()))
    for future in pending:
        future.cancel()
    return error if message == str(error) else RemoteStorageError(message)


def started(protocol: str, future: Future[Any]) -> None:
    """A read of ``protocol``'s store in flight (cancelled if the store is marked out); when it
    is already out, the read is cancelled at once."""
    with _LOCK:
        _IN_FLIGHT.setdefault(protocol, set()).add(future)
        out = protocol in _OUT
    if out:
        future.cancel()


def finished(protocol: str, future: Future[Any]) -> None:
    with _LOCK:
        _IN_FLIGHT.get(protocol, set()).discard(future)


def clear() -> None:
    """Every store may be asked again (a new look, new clients)."""
    with _LOCK:
        _OUT.clear()


__all__ = ["check", "clear", "finished", "started", "trip"]
