"""The process pool behind ``workers=N``: rank 0 spawns ranks 1…N-1 here and collects their reports.

Each worker runs the same library call with its own rank and joins the group through
:func:`~ema_ckpt.dist.current_workers`; workers may start ahead, while the command line still
loads (:func:`start_standby_workers`).

Example:
    >>> run_workers(1, sum, [1, 2])
    3
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._gc import import_module, own_the_heap
from ..errors import EmaCkptError, OptionError, PeerLostError
from .group import (
    SPAWNED_VARIABLE,
    WorkerFailed,
    group_state,
    in_worker_group,
    portable_error,
    shutdown,
    spawned_workers,
    store_socket,
)

T = TypeVar("T")


def _listening_socket() -> socket.socket:
    """A socket listening on a free loopback port for rank 0's store, held from before the spawn."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


_GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _group_environment(rank: int, world: int, port: int) -> dict[str, str]:
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def _worker_main(rank: int, world: int, port: int, func: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any],
                 queue: Any) -> None:
    """A spawned worker (rank ≥ 1): run ``func`` in the group, leave it, then report."""
    os.environ.update(_group_environment(rank, world, port))
    os.environ[SPAWNED_VARIABLE] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report: tuple[int, str, Any]
    own_the_heap()  # a process of ema-ckpt's own
    try:
        torch = import_module("torch")
        torch.set_num_threads(1)
        func(*args, **kwargs)
        report = (rank, "ok", None)
    except BaseException as err:
        details = "\n" + traceback.format_exc() if os.environ.get("EMA_CKPT_DEBUG") else ""
        report = (rank, "error", portable_error(err, details))
    with contextlib.suppress(Exception):  # the group is gone either way; the report matters
        shutdown()  # before reporting: rank 0 (the parent) hosts the group's store
    queue.put(report)
    # everything is written and reported: skip tearing down an interpreter that loaded torch
    # (the parent would wait for it)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0 if report[1] == "ok" else 1)


def _standby_main(connection: Any, queue: Any) -> None:
    """A worker started before its command knew its job: import what every job needs, then wait
    for the job, or exit when the command ends without one."""
    import pkgutil
    import signal

    # Ctrl-C reaches the whole process group: the command reports it; a worker without a job just ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        own_the_heap()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import_module("torch")
        import_module("ema_ckpt.jobs")  # the modules a job's pickle names
        commands = import_module("ema_ckpt.commands")
        for found in pkgutil.iter_modules(commands.__path__):
            import_module(f"ema_ckpt.commands.{found.name}")
        rank, world, port, func, args, kwargs, environment = connection.recv()
    except BaseException:  # the command ended without a job for it (EOF), or went wrong before
        os._exit(0)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a worker spawned with its job
    os.environ.clear()
    os.environ.update(environment)  # the command's environment when the job began
    _worker_main(rank, world, port, func, args, kwargs, queue)


# workers started ahead: processes, connections, report queue and the store's socket, until a run takes them
_standby: dict[str, Any] = {}


def start_standby_workers(count: int) -> None:
    """Start ``count`` worker processes now, while the command line still loads (their start
    overlaps its own); the next :func:`run_workers` of ``count + 1`` workers gives them its job."""
    if count < 1 or _standby or in_worker_group():
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    listening = _listening_socket()
    procs, connections = [], []
    for rank in range(1, count + 1):
        mine, theirs = ctx.Pipe()
        procs.append(ctx.Process(target=_standby_main, args=(theirs, queue), name=f"ema-ckpt-worker-{rank}",
                                 daemon=True))
        procs[-1].start()
        theirs.close()
        connections.append(mine)
    _standby.update(procs=procs, connections=connections, queue=queue, listening=listening)


def _take_standby(count: int) -> dict[str, Any] | None:
    """The standby workers, if there are ``count`` of them and all still wait; else None (any are ended)."""
    taken = dict(_standby)
    _standby.clear()
    if not taken:
        return None
    if len(taken["procs"]) == count and all(p.exitcode is None for p in taken["procs"]):
        return taken
    _end_standby(taken)
    return None


def _end_standby(taken: dict[str, Any]) -> None:
    for connection in taken["connections"]:
        connection.close()  # a waiting worker reads the end of its pipe and exits
    for proc in taken["procs"]:
        proc.join(timeout=2.0)
        if proc.exitcode is None:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.join(timeout=2.0)
    taken["listening"].close()


def run_workers(world_size: int, func: Callable[..., T], /, *args: Any,
                local_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> T:
    """Run ``func(*args, **kwargs)`` as ``world_size`` workers; rank 0's result.

    This process is rank 0; ranks 1… are spawned (or standby) processes. ``local_kwargs`` go to
    rank 0 only (``on_progress``). An error on any rank, or a worker dying without a report, is
    raised here (the first by rank), with its exit code.
    """
    if world_size <= 1 or in_worker_group():
        _take_standby(0)  # none: any started for another run would only hold memory
    if world_size < 1:
        raise OptionError("workers", f"must be at least 1, got {world_size}", value=world_size)
    if world_size == 1 or in_worker_group():
        return func(*args, **kwargs, **(local_kwargs or {}))
    import multiprocessing

    # torch.distributed not imported yet means no group; torch itself loads after the spawn
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise OptionError("workers", "{workers}: this process already belongs to a torch.distributed group; "
                         "start it under torchrun instead (its ranks become the workers)")
    ctx = multiprocessing.get_context("spawn")  # a fork would copy this process's threads and locks
    standby = _take_standby(world_size - 1)
    queue = standby["queue"] if standby else ctx.SimpleQueue()
    listening = standby["listening"] if standby else _listening_socket()
    port = int(listening.getsockname()[1])
    store_socket[:] = [listening]
    procs: list[Any] = []
    saved = {name: os.environ.get(name) for name in _GROUP_VARIABLES}
    threads: int | None = None
    grace = 30.0  # for the workers to exit after they have reported
    try:
        if standby:
            environment = dict(os.environ)
            try:
                for rank, connection in enumerate(standby["connections"], start=1):
                    connection.send((rank, world_size, port, func, args, kwargs, environment))
                    procs.append(standby["procs"][rank - 1])
            except BaseException:  # a worker gone, or a job that cannot be sent: none may wait for it
                grace = 0.0
                procs[:] = standby["procs"]
                raise
            finally:
                for connection in standby["connections"]:
                    connection.close()
        for rank in range(len(procs) + 1, world_size):
            procs.append(ctx.Process(target=_worker_main, args=(rank, world_size, port, func, args, kwargs, queue),
                                     name=f"ema-ckpt-worker-{rank}", daemon=True))
            procs[-1].start()
        spawned_workers[:] = procs
        torch = import_module("torch")  # while the workers start and import it too
        threads = torch.get_num_threads()
        os.environ.update(_group_environment(0, world_size, port))
        torch.set_num_threads(max(1, threads // world_size))  # the workers share this machine's cores
        try:
            result = func(*args, **kwargs, **(local_kwargs or {}))
        except PeerLostError as err:  # a worker died or fell silent: its own report says why, if it made one
            grace = 0.0
            heartbeat = group_state.get("heartbeat")
            if heartbeat is not None and heartbeat.lost is not None:
                raise heartbeat.lost from None  # silent, then killed: its silence is the news
            cause = _failure(_collect(procs, queue, timeout=2.0), procs, only_reported=True)
            raise (cause if cause is not None else err) from None
        except EmaCkptError:  # peers learnt of it at the step's synchronisation and end too
            grace = 5.0
            raise
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: end the peers at once
            grace = 0.0
            raise
        except Exception as err:  # a collective failed (a peer died?) or a fault of this rank's own
            grace = 0.0  # peers still waiting for this rank in a collective would wait for hours
            # a peer that failed on its own reports soon (its error is the cause); peers waiting
            # for this rank in a collective do not
            cause = _failure(_collect(procs, queue, timeout=2.0), procs, only_reported=True)
            if cause is not None:
                raise cause from None
            raise WorkerFailed(f"worker 0: {type(err).__name__}: {err}", 1) from err
        failure = _failure(_collect(procs, queue), procs)
        if failure is not None:
            raise failure
        return result
    finally:
        spawned_workers.clear()
        store_socket.clear()
        listening.close()  # a no-op once the store has taken it
        try:
            shutdown()
            if threads is not None:
                import torch

                torch.set_num_threads(threads)
        except BaseException:
            grace = 0.0
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _end(procs, grace)


def _end(procs: Sequence[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _collect(procs: Sequence[Any], queue: Any, timeout: float | None = None) -> dict[int, tuple[str, Any]]:
    """The spawned workers' reports: all of them, or as many as came before every worker
    still without one exited (or ``timeout`` seconds passed)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    reports: dict[int, tuple[str, Any]] = {}
    while len(reports) < len(procs):
        if not queue.empty():
            rank, status, payload = queue.get()
            reports[rank] = (status, payload)
        elif (not any(p.is_alive() for p in procs) and queue.empty()) or (
                deadline is not None and time.monotonic() > deadline):
            break
        else:
            for proc in procs:
                proc.join(timeout=0.01)
    return reports


def _failure(reports: dict[int, tuple[str, Any]], procs: Sequence[Any], *, only_reported: bool = False
             ) -> WorkerFailed | None:
    """The error to raise for the spawned workers: the first reported error by rank, or a worker
    that exited without a report; None when all ran (``only_reported``: a worker still running
    without a report is none)."""
    errors = sorted((rank, payload) for rank, (status, payload) in reports.items() if status == "error")
    if errors:
        first: EmaCkptError = errors[0][1]
        return WorkerFailed(first.note(), first.exit_code)
    silent = [(rank, p) for rank, p in enumerate(procs, start=1) if rank not in reports and p.exitcode is not None]
    if silent:
        rank, proc = silent[0]
        how = f"killed by signal {-proc.exitcode}" if proc.exitcode < 0 else f"exit code {proc.exitcode}"
        return WorkerFailed(f"worker {rank} (process {proc.pid}) died without a report ({how}; out of memory?)", 1)
    if not only_reported and len(reports) < len(procs):
        return WorkerFailed("a worker process died without a report (out of memory?)", 1)
    return None
