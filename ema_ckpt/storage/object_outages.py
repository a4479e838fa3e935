"""A store that stopped answering ends the run at its first exhausted request.

Against a store that never answers, each of a run's reads (read-ahead, several objects) would
spend its whole attempts × timeout before the run could end. Instead the first read that
exhausts its attempts marks its store out (:func:`trip`): its reads in flight are cancelled and
none starts (:func:`check`) until a new look (``forget_listings``, each watch interval) or a new
client (``forget_clients``) clears the mark. Only reads stop: the writes, deletes and lock
releases that clean up after a failed run are still tried.

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
    """Raises RemoteStorageError (the first exhausted read's) if ``protocol``'s store is out."""
    with _LOCK:
        message = _OUT.get(protocol)
    if message is not None:
        raise RemoteStorageError(message)


def trip(protocol: str, error: RemoteStorageError) -> RemoteStorageError:
    """Mark ``protocol``'s store out and cancel its reads in flight; the error every read of it
    raises from now (the first one's)."""
    with _LOCK:
        message = _OUT.setdefault(protocol, str(error))
        pending = list(_IN_FLIGHT.get(protocol, ()))
    for future in pending:
        future.cancel()
    return error if message == str(error) else RemoteStorageError(message)


def started(protocol: str, future: Future[Any]) -> None:
    """A read of ``protocol``'s store in flight (cancelled at once if the store is out)."""
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
