"""The worker: ``run_deferred_worker``'s process and everything it runs.

The consumer loop and one job's walk through it (``pipeline``), held jobs, the
thread pool, the supervisor of worker processes, and its services: metrics,
health, the keeper that repairs broker restarts and the scheduler of recurring
jobs. It imports every package but ``operate``.
"""

from deferred.worker.worker import Worker

__all__ = ["Worker"]
