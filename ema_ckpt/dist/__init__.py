"""Workers over torch.distributed: the group and its collectives, the pool behind ``workers=N``,
and the heartbeat that notices a silent peer.

Example:
    >>> workers = current_workers()          # doctest: +SKIP
    >>> workers.exchange(workers.rank)       # doctest: +SKIP
    [0, 1]
"""

from .group import Claims, WorkerFailed, Workers, assign_by_bytes, current_workers, in_worker_group

__all__ = ["Claims", "WorkerFailed", "Workers", "assign_by_bytes", "current_workers", "in_worker_group"]
