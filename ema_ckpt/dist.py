"""Workers: the same run split over N processes with torch.distributed (gloo on CPU, NCCL on GPUs).

Two ways in:

* ``workers=N`` on one machine: :func:`run_workers` makes the calling process rank 0 and
  spawns ranks 1…N-1 on a free local port; each runs the same library call with its own rank.
* under ``torchrun`` (one or many nodes over a shared filesystem): RANK, WORLD_SIZE and
  MASTER_ADDR/PORT come from the environment and :func:`current_workers` joins that group.

Every rank plans the same work from metadata (the plan is deterministic), processes its own
share of output files, and the coordinator (rank 0) writes metadata and the manifest. An
error on any rank is raised on every rank at the next synchronisation point; a rank that
never joins or falls silent ends the others within a bound (:mod:`ema_ckpt._liveness`), so
no rank waits forever on a failed peer.

Example:
    >>> w = Workers.single()
    >>> w.rank, w.world_size, w.all_gather("x")
    (0, 1, ['x'])
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ._gc import import_module, own_the_heap, paused_gc
from ._liveness import Heartbeat, join, join_timeout, open_store, peer_timeout
from .errors import (
    CheckpointFormatError,
    EmaCkptError,
    NonFiniteError,
    OptionError,
    PeerLostError,
    RecordChecksumError,
    UnsafePickleError,
)

T = TypeVar("T")
_TIMEOUT = datetime.timedelta(hours=6)


class WorkerFailed(EmaCkptError):
    """Another worker failed; its message is carried here with its exit code.

    The message may be a worker's error as a :class:`~ema_ckpt.errors.Note`: the parameters
    it names stay data, so the CLI words them as flags on rank 0 too.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Workers:
    """This process's place among the workers, with the few collectives the engine needs."""

    rank: int = 0
    world_size: int = 1
    _group: Any = None

    @classmethod
    def single(cls) -> Workers:
        return cls()

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.world_size == 1:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        with _collective():
            dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def exchange(self, value: T) -> list[T]:
        """Like :meth:`all_gather`, but this rank's own entry is ``value`` itself, not a copy.

        Unpickling costs as much as pickling; a rank never needs its own value back.
        """
        if self.world_size == 1:
            return [value]
        import pickle

        import torch
        import torch.distributed as dist

        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        with _collective():
            dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self._group)
        longest = max(int(s) for s in sizes)
        buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with _collective():
            dist.all_gather(buffers, mine, group=self._group)
        with paused_gc():  # many small long-lived objects (parsed indexes): see ema_ckpt._gc
            return [value if rank == self.rank else pickle.loads(buffers[rank][: int(sizes[rank])].numpy().tobytes())
                    for rank in range(self.world_size)]

    def broadcast(self, value: T) -> T:
        """The coordinator's ``value``, on every rank."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        with _collective():
            dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def claim_order(self, costs: Sequence[int]) -> list[int]:
        """The order :meth:`claims` offers items in: largest first among several workers (the
        shares then end close together), as given to one.

        Example:
            >>> Workers(rank=0, world_size=2).claim_order([3, 9, 5])
            [1, 2, 0]
        """
        if self.world_size == 1:
            return list(range(len(costs)))
        return sorted(range(len(costs)), key=lambda i: (-costs[i], i))

    def claims(self, costs: Sequence[int]) -> Claims:
        """The items (indices into ``costs``) this rank works on, first come first served.

        Every rank calls it, with the same costs (a collective); together they take each item
        exactly once. Items are offered largest first and each rank takes the next one when it
        is free, so a faster or less loaded worker takes more: the shares end within about one
        item of each other. The group's store counts the claims, under a name the coordinator
        chooses for this call. Without such a store (a group this process did not form) the
        items are shared out by cost beforehand (:func:`assign_by_bytes`).

        Example:
            >>> list(Workers(rank=0, world_size=1).claims([3, 9, 5]))
            [0, 1, 2]
        """
        order = self.claim_order(costs)
        store = _group_state.get("store")
        if self.world_size == 1:
            return Claims(order)
        if store is None:
            owners = assign_by_bytes(costs, self.world_size)
            return Claims([i for i in order if owners[i] == self.rank])
        import secrets

        name = self.broadcast(secrets.token_hex(8) if self.is_coordinator else "")
        return Claims(order, store, f"claims/{name}")

    def check(self, error: BaseException | None) -> None:
        """A synchronisation point: raise on every rank if any rank hit an error."""
        states = self.all_gather(_portable(error) if error is not None else None)
        failed = [(rank, s) for rank, s in enumerate(states) if s is not None]
        if failed:
            # An error about one checkpoint (NaN/Inf, damaged files) is raised alike on every rank,
            # the lowest rank's, so a run that skips it and goes on skips the same one everywhere.
            rank, first = failed[0]
            if isinstance(first, NonFiniteError) or type(first) in _CHECKPOINT_ERRORS:
                raise first
        if error is not None:
            raise error
        if failed:
            raise WorkerFailed(f"worker {rank}: " + first.note(), first.exit_code)

    def on_coordinator(self, step: Callable[[], T]) -> T:
        """Run ``step`` on the coordinator only; every rank gets its result, or its error."""
        chosen: Callable[[], T] = step if self.is_coordinator else _nothing
        return self.broadcast(self.run(chosen))

    def run(self, step: Callable[[], T]) -> T:
        """Run ``step`` on this rank, then synchronise: every rank fails if one did."""
        try:
            result = step()
        except BaseException as err:
            self.check(err)
            raise
        self.check(None)
        return result


class Claims:
    """This rank's items from :meth:`Workers.claims`, each claimed when the iteration asks for it."""

    def __init__(self, order: Sequence[int], store: Any = None, counter: str = "") -> None:
        self._order, self._store, self._counter = list(order), store, counter
        self._next = 0  # without a store: the position in this rank's own list

    def __iter__(self) -> Claims:
        return self

    def __next__(self) -> int:
        if self._store is None:
            if self._next >= len(self._order):
                raise StopIteration
            self._next += 1
            return self._order[self._next - 1]
        with _collective():
            taken = int(self._store.add(self._counter, 1)) - 1
        if taken >= len(self._order):
            raise StopIteration
        return self._order[taken]

    def stop(self) -> None:
        """Leave nothing more to claim, for any rank (this one failed: the run ends at the next
        synchronisation, so the others need not do the rest first)."""
        if self._store is None:
            self._next = len(self._order)
            return
        with contextlib.suppress(Exception):  # the group may be gone: the error matters, not this
            self._store.add(self._counter, len(self._order) + 1)


def _nothing() -> Any:
    return None


@contextlib.contextmanager
def _collective() -> Any:
    """Around each collective: a peer already known lost is raised before waiting for it, and
    a collective broken by a peer that left (its sockets closed) is a :class:`PeerLostError`."""
    heartbeat = _group_state.get("heartbeat")
    if heartbeat is not None:
        heartbeat.raise_if_lost()
    try:
        yield
    except RuntimeError as err:  # gloo: "Connection closed by peer", "Timed out waiting …"
        if heartbeat is not None and heartbeat.lost is not None:
            raise heartbeat.lost from None
        raise PeerLostError(f"a worker left the group during a collective ({_first_line(err)})") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


_group_state: dict[str, Any] = {}
"""This process's group: its store and heartbeat (set by :func:`current_workers`)."""
_spawned: list[Any] = []
"""Rank 0's spawned workers while :func:`run_workers` runs, watched while the group forms."""
_listening: list[socket.socket] = []
"""Rank 0's socket for the group's store while :func:`run_workers` runs, until the store takes it."""


def _spawned_exited() -> str | None:
    for rank, proc in enumerate(_spawned, start=1):
        if proc.exitcode is not None:
            return f"worker {rank} (process {proc.pid}) exited with code {proc.exitcode}"
    return None


_CHECKPOINT_ERRORS = (CheckpointFormatError, UnsafePickleError, RecordChecksumError)
"""Errors about one checkpoint's files, raised again as themselves on every rank (a run may
skip that checkpoint and go on, which every rank must decide alike)."""


def _portable(error: BaseException, details: str = "") -> EmaCkptError:
    """``error`` as it crosses to the other ranks: itself, data included, when it pickles.

    Any other exception goes as its type and message (``details`` appended), exit code 1.
    """
    if isinstance(error, EmaCkptError):
        try:
            pickle.dumps(error)
        except Exception:
            return WorkerFailed(error.note(), error.exit_code)
        return error
    return WorkerFailed(f"{type(error).__name__}: {error}{details}", 1)


def assign_by_bytes(sizes: Sequence[int], world_size: int) -> list[int]:
    """Owner rank of each item, balancing bytes (largest first onto the least loaded rank).

    Deterministic: the same sizes give the same assignment on every rank.

    Example:
        >>> assign_by_bytes([5, 4, 3, 3], 2)
        [0, 1, 1, 0]
    """
    loads = [0] * world_size
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[index] = rank
        loads[rank] += sizes[index]
    return owner


def current_workers(device: str = "cpu") -> Workers:
    """The workers this process belongs to: torchrun's group, a spawned group, or just itself."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Workers.single()
    import_module("torch")
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            import torch

            gpus = max(1, torch.cuda.device_count())
            if int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) > gpus:
                # more workers than GPUs share them round-robin; NCCL takes one rank per GPU, and
                # the workers exchange only small objects, which gloo carries as well
                backend = "gloo"
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
        _join_group(backend, world)
        # tear the group down before interpreter exit: gloo's threads abort the process
        # ("terminate called without an active exception") when left to static destructors
        atexit.register(_shutdown)
    group = dist.new_group(backend="gloo", timeout=_TIMEOUT)  # object collectives stay on CPU
    return Workers(dist.get_rank(), dist.get_world_size(), group)


def _join_group(backend: str, world: int) -> None:
    """Form the group with bounded waits (see :mod:`ema_ckpt._liveness`), then start the heartbeat.

    Under torchrun the store is the agent's (every worker a client); otherwise rank 0 serves it.
    """
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    waits, silence = join_timeout(), peer_timeout()
    listening = _listening.pop() if _listening else None  # run_workers' socket on MASTER_PORT
    store = open_store(host, port, serve=rank == 0 and not agent, timeout=waits, listening=listening)
    # a few spawned workers on one machine: poll often; a launcher's many ranks: spare its store
    own_group = not agent and "TORCHELASTIC_RUN_ID" not in os.environ
    join(store, rank, world, timeout=waits, gone=_spawned_exited, longest_pause=0.02 if own_group else 0.2)
    group_store = dist.PrefixStore("group/", store)  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=group_store, rank=rank, world_size=world, timeout=_TIMEOUT)
    # its own connection, with a short timeout: a store that stops answering must not block the watch
    watch = open_store(host, port, serve=False, timeout=min(30.0, silence))
    # a worker started by a launcher (torchrun's agent, or rank 0's spawn) ends when the launcher does
    launched = agent or "TORCHELASTIC_RUN_ID" in os.environ or _SPAWNED_VARIABLE in os.environ
    heartbeat = Heartbeat(watch, rank, world, timeout=silence, on_lost=_kill_spawned, watch_parent=launched)
    _group_state.update(store=store, heartbeat=heartbeat.start())


def _kill_spawned() -> None:
    for proc in list(_spawned):
        with contextlib.suppress(Exception):
            proc.kill()


def _shutdown() -> None:
    import torch.distributed as dist

    heartbeat = _group_state.pop("heartbeat", None)
    if heartbeat is not None:
        heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    _group_state.clear()


def _listening_socket() -> socket.socket:
    """A socket listening on a free loopback port, for the store rank 0 serves: held from before
    the spawn, so no other process can take the port and the workers never find it closed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


_SPAWNED_VARIABLE = "EMA_CKPT_SPAWNED_WORKER"
_GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _group_environment(rank: int, world: int, port: int) -> dict[str, str]:
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def _worker_main(rank: int, world: int, port: int, func: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any],
                 queue: Any) -> None:
    """A spawned worker (rank ≥ 1): run ``func`` in the group, leave it, then report."""
    os.environ.update(_group_environment(rank, world, port))
    os.environ[_SPAWNED_VARIABLE] = "1"
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
        report = (rank, "error", _portable(err, details))
    with contextlib.suppress(Exception):  # the group is gone either way; the report matters
        _shutdown()  # before reporting: rank 0 (the parent) hosts the group's store
    queue.put(report)
    # everything is written and reported: skip tearing down an interpreter that loaded torch
    # (the parent would wait for it)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0 if report[1] == "ok" else 1)


def _standby_main(connection: Any, queue: Any) -> None:
    """A worker started before its command knew its job (:func:`start_standby_workers`): import
    what every job needs, then wait for the job, or exit when the command ends without one."""
    import pkgutil
    import signal

    # Ctrl-C reaches the whole process group: the command reports it; a worker without a job just ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        own_the_heap()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import_module("torch")
        import_module("ema_ckpt.jobs")  # the modules a job's pickle names
        import_module("ema_ckpt.reading")
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


_standby: dict[str, Any] = {}
"""Workers started ahead by :func:`start_standby_workers`: processes, connections, report
queue and the store's socket, until :func:`run_workers` takes them."""


def start_standby_workers(count: int) -> None:
    """Start ``count`` worker processes now, while the command line still loads and checks its
    options; the next :func:`run_workers` of ``count + 1`` workers gives them its job.

    A worker's own start (an interpreter, ema-ckpt's modules, torch) then overlaps the
    command's instead of following it. Workers not given a job exit when this process does.
    """
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
    """The standby workers, if there are ``count`` of them and all still wait; else None (any
    there were are ended)."""
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


def release_standby_workers() -> None:
    """End the workers :func:`start_standby_workers` started, if no run took them."""
    taken = dict(_standby)
    _standby.clear()
    if taken:
        _end_standby(taken)


def run_workers(world_size: int, func: Callable[..., T], /, *args: Any,
                local_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> T:
    """Run ``func(*args, **kwargs)`` as ``world_size`` workers; rank 0's result.

    ``local_kwargs`` go to rank 0 only (this process): callbacks that cannot cross processes,
    such as ``on_progress``, which then counts the work every worker has claimed.

    This process is rank 0; ranks 1… are spawned processes. They start (and import torch)
    while this one goes on, so a run of N workers pays about one interpreter start, not two.
    Each worker sees RANK/WORLD_SIZE in its environment, so ``func`` joins the group through
    :func:`current_workers`. An error on any rank is raised here (the first by rank), with
    its exit code; a worker that dies without a report (killed, out of memory) is one too.
    """
    if world_size <= 1 or in_worker_group():
        release_standby_workers()  # started for another run: they would only hold memory
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
    _listening[:] = [listening]
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
        _spawned[:] = procs
        torch = import_module("torch")  # while the workers start and import it too
        threads = torch.get_num_threads()
        os.environ.update(_group_environment(0, world_size, port))
        torch.set_num_threads(max(1, threads // world_size))  # the workers share this machine's cores
        try:
            result = func(*args, **kwargs, **(local_kwargs or {}))
        except PeerLostError as err:  # a worker died or fell silent: its own report says why, if it made one
            grace = 0.0
            heartbeat = _group_state.get("heartbeat")
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
        _spawned.clear()
        _listening.clear()
        listening.close()  # a no-op once the store has taken it
        try:
            _shutdown()
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
    """Wait up to ``timeout`` s for the spawned workers to exit (they do once they have
    reported), then kill any left."""
    import time

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
    import time

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
    """The error to raise for the spawned workers (ranks 1…): the first reported error by rank,
    or a worker that exited without a report; None when all ran. ``only_reported``: a worker
    still running without a report is no failure (rank 0 stopped waiting for it)."""
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


def in_worker_group() -> bool:
    """True inside a spawned worker or under torchrun (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
