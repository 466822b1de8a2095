"""The ``@task`` decorator and the registry of task functions.

The worker runs only functions registered here, looked up by the name a
message carries; it never imports a dotted path named by a message, so a
message forged on the broker cannot make the worker run arbitrary code.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

from deferred.core.keys import validate_key
from deferred.core.limits import parse_time_limit
from deferred.core.priorities import validate_priority
from deferred.core.retries import (
    Backoff,
    RetryPolicy,
    parse_backoff,
    validate_exception_types,
    validate_max_retries,
)

if TYPE_CHECKING:
    from deferred.conf import DeferredSettings
    from deferred.core.schedule import Schedule

#: ``@task(time_limit=...)`` not given: the task follows DEFERRED['TIME_LIMIT'].
SETTING: Any = type("Setting", (), {"__repr__": lambda self: "SETTING"})()

P = ParamSpec("P")
R = TypeVar("R")


class UnknownTask(LookupError, ValueError):
    """No task is registered under that name (``ValueError`` for ``defer``'s callers)."""


class DuplicateTask(ValueError):
    """Two functions were registered under one task name."""


_registry: dict[str, Task[..., Any]] = {}

#: How ``Task.defer()`` and ``Task.adefer()`` publish: ``deferred.producer.publishing``
#: and ``deferred.producer.asynchronous`` put ``defer`` and ``adefer`` here as they load.
#: The package imports both before any of its modules can be reached, so the
#: registry, a lower layer, never imports the publishing layer above it.
publishers: dict[str, Callable[..., Any]] = {}


@dataclasses.dataclass(frozen=True)
class Options:
    """Per-call options, kept apart from the task's own arguments.

    Set through :meth:`Task.using`; ``None`` means "the task's or the
    settings' default".
    """

    queue: str | None = None
    #: Publish after the surrounding transaction commits (``None``: DEFERRED['ON_COMMIT']).
    on_commit: bool | None = None
    #: -100 to 100, higher runs first (``None``: the task's own).
    priority: int | None = None
    #: The debounce key: of the jobs deferred with it, only the latest runs
    #: (``deferred.core.keys``); ``None``: the job stands alone.
    key: str | None = None


class Task(Generic[P, R]):
    """A registered function. Calling it runs the function here and now."""

    def __init__(
        self,
        func: Callable[P, R],
        *,
        name: str,
        queue: str | None = None,
        options: Options | None = None,
        max_retries: int | None = None,
        retry_backoff: Backoff | None = None,
        retry_for: tuple[type[BaseException], ...] = (Exception,),
        dont_retry_for: tuple[type[BaseException], ...] = (),
        schedule: Schedule | None = None,
        time_limit_s: float | None = SETTING,
        priority: int = 0,
        result: bool = True,
    ) -> None:
        self.func = func
        self.name = name
        #: The queue chosen with ``@task(queue=...)``; ``None``: the first of DEFERRED['QUEUES'].
        self.queue = queue
        self.options = options or Options()
        #: ``None``: DEFERRED['MAX_RETRIES'] / DEFERRED['RETRY_BACKOFF'].
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.retry_for = retry_for
        self.dont_retry_for = dont_retry_for
        #: When the task runs by itself (``@task(schedule=every(...) | cron(...))``).
        self.schedule = schedule
        #: Seconds an attempt may run (``None``: no limit; ``SETTING``: DEFERRED['TIME_LIMIT']).
        self.time_limit_s = time_limit_s
        #: -100 to 100, higher runs first among due jobs (``deferred.core.priorities``).
        self.priority = priority
        #: Whether workers record this task's results (``deferred.records.results``).
        self.result = result
        self.__wrapped__ = func
        self.__doc__ = func.__doc__
        self.__name__ = getattr(func, "__name__", name)
        self.__qualname__ = getattr(func, "__qualname__", name)
        self.__module__ = getattr(func, "__module__", __name__)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Task {self.name}>"

    def using(
        self,
        *,
        queue: str | None = None,
        on_commit: bool | None = None,
        priority: int | None = None,
        key: str | None = None,
    ) -> Task[P, R]:
        """A copy of this task with per-call options, e.g. ``t.using(queue="bulk").defer(5)``.

        ``on_commit=False`` publishes at once even inside ``transaction.atomic()``.
        ``priority`` (-100 to 100) overrides the task's for these calls.
        ``key`` debounces: of all jobs deferred with the same key, only the
        latest runs; the earlier ones are dropped as ``superseded`` when they
        come due (``deferred.core.keys`` states the guarantee).
        Options never travel in ``**kwargs``, so a task may have arguments
        called ``queue``, ``on_commit``, ``priority`` or ``key`` of its own.
        """
        changes: dict[str, Any] = {}
        if queue is not None:
            changes["queue"] = queue
        if on_commit is not None:
            changes["on_commit"] = on_commit
        if priority is not None:
            changes["priority"] = validate_priority(priority)
        if key is not None:
            changes["key"] = validate_key(key)
        options = dataclasses.replace(self.options, **changes)
        clone = copy.copy(self)
        clone.options = options
        return clone

    def retry_policy(self, settings: DeferredSettings) -> RetryPolicy:
        """The task's own retry options over the DEFERRED defaults."""
        return RetryPolicy(
            max_retries=settings.max_retries if self.max_retries is None else self.max_retries,
            backoff=settings.retry_backoff if self.retry_backoff is None else self.retry_backoff,
            retry_for=self.retry_for,
            dont_retry_for=self.dont_retry_for,
        )

    def time_limit(self, settings: DeferredSettings) -> float | None:
        """Seconds an attempt may run before TimeLimitExceeded; ``None``: no limit."""
        return settings.time_limit_s if self.time_limit_s is SETTING else self.time_limit_s

    def defer(
        self, delay: int | float | timedelta | datetime, /, *args: P.args, **kwargs: P.kwargs
    ) -> str:
        """Shorthand for ``deferred.defer(self, delay, *args, **kwargs)``."""
        job_id: str = publishers["defer"](self, delay, *args, **kwargs)
        return job_id

    async def adefer(
        self, delay: int | float | timedelta | datetime, /, *args: P.args, **kwargs: P.kwargs
    ) -> str:
        """Shorthand for ``await deferred.adefer(self, delay, *args, **kwargs)``."""
        job_id: str = await publishers["adefer"](self, delay, *args, **kwargs)
        return job_id

    @property
    def target_priority(self) -> int:
        """The priority of this call: ``using(priority=...)``, else the task's."""
        return self.priority if self.options.priority is None else self.options.priority

    @property
    def target_queue(self) -> str | None:
        """The queue this call goes to, or ``None`` for the settings' default."""
        return self.options.queue or self.queue

    def check_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise ``TypeError`` now if the function could not be called with these.

        Better at ``defer()`` time, in the caller's traceback, than hours
        later in the worker.
        """
        check_call(self.func, self.name, args, kwargs)


def check_call(
    func: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """``TypeError`` unless ``func`` could be called with ``args`` and ``kwargs``."""
    signature = _signature(func)
    if signature is None:
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"Bad arguments for task {name!r}: {exc}") from exc


@functools.lru_cache(maxsize=4096)
def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    """``func``'s signature, computed once: it is most of what checking a call costs."""
    try:
        # Not follow_wrapped: the callable that runs is the wrapper a decorator made
        # (functools.wraps), whose own parameters say what it takes.
        return inspect.signature(func, follow_wrapped=False)
    except (TypeError, ValueError):  # builtins without a signature
        return None


@overload
def task(func: Callable[P, R], /) -> Task[P, R]: ...


@overload
def task(
    *,
    name: str | None = None,
    queue: str | None = None,
    max_retries: int | None = None,
    retry_backoff: Any = None,
    retry_for: Any = (Exception,),
    dont_retry_for: Any = (),
    schedule: Schedule | None = None,
    time_limit: float | timedelta | None = SETTING,
    priority: int = 0,
    result: bool = True,
) -> Callable[[Callable[P, R]], Task[P, R]]: ...


def task(
    func: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    queue: str | None = None,
    max_retries: int | None = None,
    retry_backoff: Any = None,
    retry_for: Any = (Exception,),
    dont_retry_for: Any = (),
    schedule: Schedule | None = None,
    time_limit: float | timedelta | None = SETTING,
    priority: int = 0,
    result: bool = True,
) -> Task[P, R] | Callable[[Callable[P, R]], Task[P, R]]:
    """Register a function as a task: ``@task`` or ``@task(name=..., queue=..., ...)``.

    The name defaults to ``module.qualname``; it is what messages carry, so
    give long-lived tasks an explicit name that survives refactoring.

    Retries: ``max_retries`` (default DEFERRED['MAX_RETRIES']) more attempts
    after the first, waiting ``retry_backoff`` between them (a list of seconds
    whose last value repeats, or ``Exponential(base, factor, cap, jitter)``);
    only for exceptions in ``retry_for`` and not in ``dont_retry_for``.

    ``schedule=every(...)`` or ``cron(...)`` makes it recurring: the workers
    run it at each occurrence, once (see :mod:`deferred.worker.scheduler`). A
    scheduled task is called with no arguments; it can still be deferred by
    hand with arguments it accepts.

    ``time_limit`` (seconds or a ``timedelta``; ``None``: none; default
    DEFERRED['TIME_LIMIT']): how long one attempt may run before
    ``deferred.TimeLimitExceeded`` is raised in it (see :mod:`deferred.core.limits`).

    ``priority`` (-100 to 100, default 0): among jobs that are due, higher
    runs first (see :mod:`deferred.core.priorities`); ``using(priority=...)``
    overrides it per call.

    ``result`` (default ``True``): whether workers record the task's start
    and outcome for ``deferred.result(job_id)`` (see :mod:`deferred.records.results`);
    ``False`` for a task whose results nobody reads, or whose return value
    must not be kept.
    """
    if not isinstance(result, bool):
        raise TypeError(f"@task(result=...) takes True or False, not {result!r}.")
    limit_s = time_limit if time_limit is SETTING else parse_time_limit(time_limit)
    validate_priority(priority)
    policy_max = None if max_retries is None else validate_max_retries(max_retries)
    policy_backoff = None if retry_backoff is None else parse_backoff(retry_backoff)
    policy_for = validate_exception_types("retry_for", retry_for)
    policy_not_for = validate_exception_types("dont_retry_for", dont_retry_for)
    if schedule is not None:
        from deferred.core.schedule import Schedule, ScheduleError

        if not isinstance(schedule, Schedule):
            raise ScheduleError(
                f"@task(schedule=...) takes every(...) or cron(...), not {schedule!r}."
            )

    def decorate(f: Callable[P, R]) -> Task[P, R]:
        if isinstance(f, Task):
            raise TypeError(f"{f!r} is already a task.")
        if not callable(f):
            raise TypeError(f"@task needs a function, got {f!r}.")
        task_name = name if name is not None else f"{f.__module__}.{f.__qualname__}"
        if not isinstance(task_name, str) or not task_name:
            raise ValueError(f"A task name must be a non-empty string, got {task_name!r}.")
        if queue is not None:
            from deferred.core.parsers import validate_queue_name

            validate_queue_name(queue)
        if schedule is not None:
            try:
                check_call(f, task_name, (), {})
            except TypeError:
                raise TypeError(
                    f"Scheduled task {task_name!r} must be callable with no arguments (each "
                    "occurrence calls it so); give its parameters defaults."
                ) from None
        existing = _registry.get(task_name)
        if existing is not None and existing.func is not f:
            raise DuplicateTask(
                f"A task named {task_name!r} is already registered ({existing.func!r}); "
                "give one of them another name with @task(name=...)."
            )
        registered = Task(
            f,
            name=task_name,
            queue=queue,
            max_retries=policy_max,
            retry_backoff=policy_backoff,
            retry_for=policy_for,
            dont_retry_for=policy_not_for,
            schedule=schedule,
            time_limit_s=limit_s,
            priority=priority,
            result=result,
        )
        _registry[task_name] = registered
        return registered

    if func is not None:
        return decorate(func)
    return decorate


def get_task(name: str) -> Task[..., Any]:
    """The task registered under ``name``; ``UnknownTask`` if there is none."""
    try:
        return _registry[name]
    except KeyError:
        raise UnknownTask(
            f"No task is registered under the name {name!r}. Tasks are registered by "
            "@task in a module that has been imported (tasks.py of an installed app is "
            "imported automatically)."
        ) from None


def registered_tasks() -> dict[str, Task[..., Any]]:
    """A snapshot of the registry, by name."""
    return dict(_registry)


def unregister(name: str) -> None:
    """Forget a task (for tests that register throwaway tasks)."""
    _registry.pop(name, None)
