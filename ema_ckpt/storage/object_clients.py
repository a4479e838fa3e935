"""The fsspec filesystem of each storage protocol, built from the environment with bounded waits.

One client per protocol per process, configured as each store's own tools are, with the
timeouts of :func:`request_timeout` on connecting and on each wait for bytes, and each request
tried :func:`request_attempts` times with the store's own backoff.

Example:
    >>> request_timeout({}), request_attempts({})
    (20.0, 3)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from .._env import seconds, whole_number
from ..errors import RemoteStorageError
from . import object_outages

LISTING_SECONDS = 10.0
"""How long a folder's listing is trusted for the entries in it."""
TIMEOUT_ENV = "EMA_CKPT_REMOTE_TIMEOUT"
ATTEMPTS_ENV = "EMA_CKPT_REMOTE_ATTEMPTS"
_DEFAULT_TIMEOUT = 20.0
_DEFAULT_ATTEMPTS = 3
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
_FILESYSTEMS: dict[str, Any] = {}


def request_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds a request may wait to connect, or for the next bytes of an answer
    (``EMA_CKPT_REMOTE_TIMEOUT``, default 20)."""
    return seconds(TIMEOUT_ENV, _DEFAULT_TIMEOUT, env)


def request_attempts(env: Mapping[str, str] | None = None) -> int:
    """Attempts of a request that times out or fails for a while (``EMA_CKPT_REMOTE_ATTEMPTS``,
    default 3): a store that stops answering ends the run after about attempts × timeout."""
    return whole_number(ATTEMPTS_ENV, _DEFAULT_ATTEMPTS, "attempts", env)


def filesystem(protocol: str) -> Any:
    """The filesystem of ``protocol`` (``s3``, ``gs``, ``az``, …), built once per process.

    Raises:
        RemoteStorageError: its package is not installed, or fsspec knows no such protocol.
    """
    fs = _FILESYSTEMS.get(protocol)
    if fs is None:
        fs = _FILESYSTEMS[protocol] = _build(protocol)
    return fs


def forget_clients() -> None:
    """Drop every client built (the next is built from the environment as it is now)."""
    _FILESYSTEMS.clear()
    object_outages.clear()


def forget_listings() -> None:
    """Drop the folder listings kept, and ask again a store that stopped answering."""
    object_outages.clear()
    for fs in _FILESYSTEMS.values():
        cache = getattr(fs, "dircache", None)
        if cache is not None:
            cache.clear()


def _build(protocol: str) -> Any:
    try:
        import fsspec  # type: ignore[import-untyped]

        make: Callable[..., Any] = _MAKERS.get(_EXTRAS.get(protocol, ""), _plain)
        # A folder's listing answers the existence checks of its entries (one request, not one
        # per marker file) for a few seconds, so a long-lived process still sees new
        # checkpoints; the client is built from the environment, not fsspec's instance cache.
        return make(fsspec, protocol, use_listings_cache=True, listings_expiry_time=LISTING_SECONDS,
                    skip_instance_cache=True)
    except ImportError as err:
        extra = _EXTRAS.get(protocol)
        hint = f" (pip install 'ema-ckpt[{extra}]')" if extra else ""
        raise RemoteStorageError(f"{protocol}:// needs a filesystem package that is not installed{hint}: "
                                 f"{err}") from None
    except ValueError as err:
        raise RemoteStorageError(f"{protocol}:// is not a storage protocol fsspec knows ({err})") from None


def _plain(fsspec: Any, protocol: str, **options: Any) -> Any:
    try:
        return fsspec.filesystem(protocol, **options)
    except TypeError:  # a filesystem without a listings cache
        return fsspec.filesystem(protocol, skip_instance_cache=True)


def _s3(fsspec: Any, protocol: str, **options: Any) -> Any:
    """botocore's timeouts, each request tried :func:`request_attempts` times by botocore (its
    standard mode). s3fs's own retry loops run once: nested, their attempts would multiply."""
    timeout = request_timeout()
    fs = fsspec.filesystem(protocol, config_kwargs={
        "connect_timeout": timeout, "read_timeout": timeout,
        "retries": {"total_max_attempts": request_attempts(), "mode": "standard"}}, **options)
    fs.retries = 1
    return fs


def _gcs(fsspec: Any, protocol: str, **options: Any) -> Any:
    """aiohttp's timeouts on every request; gcsfs retries :func:`request_attempts` times."""
    import aiohttp

    timeout = request_timeout()
    waits = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        # gcsfs's default class first asks each bucket's type over gRPC with Google's
        # credentials, which an emulator never answers: its plain JSON-API class instead
        from gcsfs.core import GCSFileSystem  # type: ignore[import-untyped]

        base = GCSFileSystem
        if "FSSPEC_GS_TOKEN" not in os.environ:
            options["token"] = "anon"  # an emulator checks no credentials; none are looked for
    else:
        base = fsspec.get_filesystem_class(protocol)
    return _bounded_gcs_class(base, request_attempts())(requests_timeout=waits, **options)


def _bounded_gcs_class(base: type, attempts: int) -> type:
    """``base`` (a gcsfs class) whose requests are tried ``attempts`` times, not gcsfs's fixed 6;
    ``base`` itself where gcsfs no longer builds them on ``retry_request`` (``tests/test_compat.py``)."""
    try:
        from gcsfs.retry import retry_request  # type: ignore[import-untyped]

        once = base._request.__wrapped__  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return base
    return type(base.__name__, (base,), {"_request": retry_request(retries=attempts)(once)})


def _azure(fsspec: Any, protocol: str, **options: Any) -> Any:
    """adlfs's filesystem with this process's timeouts and a short retry policy (the SDK's waits
    15 s before its first retry)."""
    from adlfs import AzureBlobFileSystem  # type: ignore[import-untyped]
    from azure.storage.blob.aio import BlobServiceClient, ExponentialRetry

    timeout, attempts = request_timeout(), request_attempts()

    class BoundedAzureBlobFileSystem(AzureBlobFileSystem):  # type: ignore[misc]
        protocol = AzureBlobFileSystem.protocol

        def do_connect(self) -> None:
            super().do_connect()
            built: Any = self.service_client  # type: ignore[has-type]
            self.service_client = BlobServiceClient(
                account_url=built.url, credential=built.credential,
                retry_policy=ExponentialRetry(initial_backoff=0, increment_base=2, retry_total=attempts - 1,
                                              random_jitter_range=1),
                connection_timeout=timeout, read_timeout=timeout)

    del fsspec, protocol
    return BoundedAzureBlobFileSystem(connection_timeout=int(max(1, timeout)), read_timeout=int(max(1, timeout)),
                                      **options)


_MAKERS: dict[str, Callable[..., Any]] = {"s3": _s3, "gcs": _gcs, "azure": _azure}  # by extra

__all__ = ["ATTEMPTS_ENV", "LISTING_SECONDS", "TIMEOUT_ENV", "filesystem", "forget_clients", "forget_listings",
           "request_attempts", "request_timeout"]
