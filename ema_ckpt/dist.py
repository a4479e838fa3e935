"""Workers: the same run split over N processes with torch.distributed (gloo on CPU, NCCL on GPUs).

Two ways in:

* ``--workers N`` on one machine: :func:`run_workers` spawns N processes on a free local
  port; each runs the same library call with its own rank.
* under ``torchrun`` (one or many nodes over a shared filesystem): RANK, WORLD_SIZE and
  MASTER_ADDR/PORT come from the environment and :func:`current_workers` joins that group.

Every rank plans the same work from metadata (the plan is deterministic), processes its own
share of output files, and the coordinator (rank 0) writes metadata and the manifest. An
error on any rank is raised on every rank at the next synchronisation point, so no rank
waits forever on a failed peer.

Example:
    >>> w = Workers.single()
    >>> w.rank, w.world_size, w.all_gather("x")
    (0, 1, ['x'])
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import EmaCkptError, NonFiniteError, UsageError

T = TypeVar("T")
_TIMEOUT = datetime.timedelta(hours=6)


class WorkerFailed(EmaCkptError):
    """Another worker failed; its message is carried here with its exit code."""

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
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def broadcast(self, value: T) -> T:
        """The coordinator's ``value``, on every rank."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def check(self, error: BaseException | None) -> None:
        """A synchronisation point: raise on every rank if any rank hit an error."""
        states = self.all_gather(_describe(error) if error is not None else None)
        failed = [(rank, s) for rank, s in enumerate(states) if s is not None]
        if error is not None:
            raise error
        if failed:
            rank, (message, code) = failed[0]
            source = next((s[2] for _, s in failed if len(s) > 2), None)
            if source is not None:
                raise NonFiniteError(source, message)
            raise WorkerFailed(f"worker {rank}: {message}", code)

    def run(self, step: Callable[[], T]) -> T:
        """Run ``step`` on this rank, then synchronise: every rank fails if one did."""
        try:
            result = step()
        except BaseException as err:  # noqa: BLE001 - re-raised after telling the peers
            self.check(err)
            raise
        self.check(None)
        return result


def _describe(error: BaseException) -> tuple:
    if isinstance(error, NonFiniteError):
        return str(error), error.exit_code, error.source
    if isinstance(error, EmaCkptError):
        return str(error), error.exit_code
    return f"{type(error).__name__}: {error}", 1


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
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=_TIMEOUT)
        # tear the group down before interpreter exit: gloo's threads abort the process
        # ("terminate called without an active exception") when left to static destructors
        atexit.register(_shutdown)
    group = dist.new_group(backend="gloo", timeout=_TIMEOUT)  # object collectives stay on CPU
    return Workers(dist.get_rank(), dist.get_world_size(), group)


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_main(rank: int, world: int, port: int, device: str, func: Callable[..., Any],
                 args: tuple, kwargs: dict, queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        result = func(*args, **kwargs)
        queue.put((rank, "ok", result if rank == 0 else None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        message, code = _describe(err)[:2]
        if not isinstance(err, EmaCkptError) and os.environ.get("EMA_CKPT_DEBUG"):
            message += "\n" + traceback.format_exc()
        queue.put((rank, "error", (message, code)))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(world_size: int, func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``func(*args, **kwargs)`` on ``world_size`` local processes; rank 0's result.

    Each process sees RANK/WORLD_SIZE in its environment, so ``func`` joins the group through
    :func:`current_workers`. The first error (by rank) is raised here with its exit code.
    """
    if world_size < 1:
        raise UsageError(f"--workers must be at least 1, got {world_size}")
    if world_size == 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return func(*args, **kwargs)
    import torch.multiprocessing as mp

    device = str(kwargs.get("device", "cpu"))
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker_main, args=(r, world_size, port, device, func, args, kwargs, queue))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        while len(results) < world_size:
            if queue.empty() and not any(p.is_alive() for p in procs) and queue.empty():
                break
            if not queue.empty():
                rank, status, payload = queue.get()
                results[rank] = (status, payload)
            else:
                for p in procs:
                    p.join(timeout=0.05)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = sorted((r, p) for r, (s, p) in results.items() if s == "error")
    if errors:
        message, code = errors[0][1]
        raise WorkerFailed(message, code)
    if 0 not in results:
        raise WorkerFailed("a worker process died without a report (out of memory?)", 1)
    return results[0][1]


def in_worker_group() -> bool:
    """True inside a spawned worker or under torchrun (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
