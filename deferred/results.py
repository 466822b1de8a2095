"""Results: what became of a job, from the results stream the workers write.

The public face of :mod:`deferred.records.results`, where the record format,
the reading and the worker's writing live: ``result()`` and ``aresult()``,
the :class:`Result` they return, the :class:`ResultError` it holds, and
:class:`JobCancelled`, the error django.tasks reads for a cancelled job.
"""

from deferred.records.results import JobCancelled, Result, ResultError, aresult, result

__all__ = ["JobCancelled", "Result", "ResultError", "aresult", "result"]
