"""Workers over torch.distributed: the group and its few collectives (:mod:`.group`), the
process pool behind ``workers=N`` (:mod:`.pool`), and joining with a deadline and a heartbeat
that notices a silent peer (:mod:`.liveness`).

Example:
    >>> workers = current_workers()          # doctest: +SKIP
    >>> workers.exchange(workers.rank)       # doctest: +SKIP
    [0, 1]
"""

from .group import Claims, WorkerFailed, Workers, assign_by_bytes, current_workers, in_worker_group

__all__ = ["Claims", "WorkerFailed", "Workers", "assign_by_bytes", "current_workers", "in_worker_group"]
