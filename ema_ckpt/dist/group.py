"""Workers: a group of processes over torch.distributed (gloo on CPU, NCCL on GPUs) and its collectives.

:func:`current_workers` joins ``workers=N``'s group (:mod:`.pool`) or ``torchrun``'s. Every rank
plans the same work, processes its share, and the coordinator (rank 0) writes metadata and the
manifest; an error on any rank is raised on every rank at the next synchronisation point.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .._gc import import_module, paused_gc
from ..errors import (
    CheckpointFormatError,
    EmaCkptError,
    NonFiniteError,
    PeerLostError,
    RecordChecksumError,
    UnsafePickleError,
)
from .liveness import Heartbeat, first_line, join, join_timeout, open_store, peer_timeout

T = TypeVar("T")
_TIMEOUT = datetime.timedelta(hours=6)


class WorkerFailed(EmaCkptError):
    """Another worker failed; its message (maybe a :class:`~ema_ckpt.errors.Note`) with its exit code."""

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
        """Like :meth:`all_gather`, but this rank's own entry is ``value`` itself, not an unpickled copy."""
        if self.world_size == 1:
            return [value]
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
        """The order :meth:`claims` offers items in: largest first among several workers, as given to one.

        Example:
            >>> Workers(rank=0, world_size=2).claim_order([3, 9, 5])
            [1, 2, 0]
        """
        if self.world_size == 1:
            return list(range(len(costs)))
        return sorted(range(len(costs)), key=lambda i: (-costs[i], i))

    def claims(self, costs: Sequence[int]) -> Claims:
        """The items (indices into ``costs``) this rank works on, first come first served.

        A collective: together the ranks take each item once, largest first, each the next when it
        is free, counted in the group's store (without one, shared out by :func:`assign_by_bytes`).

        Example:
            >>> list(Workers(rank=0, world_size=1).claims([3, 9, 5]))
            [0, 1, 2]
        """
        order = self.claim_order(costs)
        store = group_state.get("store")
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
        states = self.all_gather(portable_error(error) if error is not None else None)
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
        """Leave nothing more to claim, for any rank (this one failed)."""
        if self._store is None:
            self._next = len(self._order)
            return
        with contextlib.suppress(Exception):  # the group may be gone: the error matters, not this
            self._store.add(self._counter, len(self._order) + 1)


def _nothing() -> Any:
    return None


@contextlib.contextmanager
def _collective() -> Any:
    """Around each collective: a peer known lost is raised first, and a collective broken by a
    peer that left is a :class:`PeerLostError`."""
    heartbeat = group_state.get("heartbeat")
    if heartbeat is not None:
        heartbeat.raise_if_lost()
    try:
        yield
    except RuntimeError as err:  # gloo: "Connection closed by peer", "Timed out waiting …"
        if heartbeat is not None and heartbeat.lost is not None:
            raise heartbeat.lost from None
        raise PeerLostError(f"a worker left the group during a collective ({first_line(err)})") from err


# What this process's group shares with the pool that spawns it (:mod:`ema_ckpt.dist.pool`): its store
# and heartbeat; while run_workers runs, rank 0's spawned workers and its store's listening socket.
group_state: dict[str, Any] = {}
spawned_workers: list[Any] = []
store_socket: list[socket.socket] = []
SPAWNED_VARIABLE = "EMA_CKPT_SPAWNED_WORKER"  # set in a worker rank 0 spawned: it must not outlive rank 0


def _spawned_exited() -> str | None:
    for rank, proc in enumerate(spawned_workers, start=1):
        if proc.exitcode is not None:
            return f"worker {rank} (process {proc.pid}) exited with code {proc.exitcode}"
    return None


# errors about one checkpoint's files, raised as themselves on every rank (which must skip it alike)
_CHECKPOINT_ERRORS = (CheckpointFormatError, UnsafePickleError, RecordChecksumError)


def portable_error(error: BaseException, details: str = "") -> EmaCkptError:
    """``error`` as it crosses to the other ranks: itself when it pickles, else its type and
    message (``details`` appended), exit code 1."""
    if isinstance(error, EmaCkptError):
        try:
            pickle.dumps(error)
        except Exception:
            return WorkerFailed(error.note(), error.exit_code)
        return error
    return WorkerFailed(f"{type(error).__name__}: {error}{details}", 1)


def assign_by_bytes(sizes: Sequence[int], world_size: int) -> list[int]:
    """Owner rank of each item, balancing bytes (largest first onto the least loaded rank), alike on every rank.

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
        return Workers()
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
        atexit.register(shutdown)
    group = dist.new_group(backend="gloo", timeout=_TIMEOUT)  # object collectives stay on CPU
    return Workers(dist.get_rank(), dist.get_world_size(), group)


def _join_group(backend: str, world: int) -> None:
    """Form the group with bounded waits (:mod:`.liveness`), then start the heartbeat; the store is
    torchrun's agent's, else rank 0's."""
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    waits, silence = join_timeout(), peer_timeout()
    listening = store_socket.pop() if store_socket else None  # run_workers' socket on MASTER_PORT
    store = open_store(host, port, serve=rank == 0 and not agent, timeout=waits, listening=listening)
    # a few spawned workers on one machine: poll often; a launcher's many ranks: spare its store
    own_group = not agent and "TORCHELASTIC_RUN_ID" not in os.environ
    join(store, rank, world, timeout=waits, gone=_spawned_exited, longest_pause=0.02 if own_group else 0.2)
    group_store = dist.PrefixStore("group/", store)  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=group_store, rank=rank, world_size=world, timeout=_TIMEOUT)
    # its own connection, with a short timeout: a store that stops answering must not block the watch
    watch = open_store(host, port, serve=False, timeout=min(30.0, silence))
    # a worker started by a launcher (torchrun's agent, or rank 0's spawn) ends when the launcher does
    launched = agent or "TORCHELASTIC_RUN_ID" in os.environ or SPAWNED_VARIABLE in os.environ
    heartbeat = Heartbeat(watch, rank, world, timeout=silence, on_lost=_kill_spawned, watch_parent=launched)
    group_state.update(store=store, heartbeat=heartbeat.start())


def _kill_spawned() -> None:
    for proc in list(spawned_workers):
        with contextlib.suppress(Exception):
            proc.kill()


def shutdown() -> None:
    """Leave the group: stop the heartbeat, then destroy torch's process group."""
    import torch.distributed as dist

    heartbeat = group_state.pop("heartbeat", None)
    if heartbeat is not None:
        heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    group_state.clear()


def in_worker_group() -> bool:
    """True inside a spawned worker or under torchrun (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
