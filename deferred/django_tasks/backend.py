"""The producer side of the django.tasks backend: ``RabbitMQBackend`` enqueues
django.tasks tasks as deferred jobs, and answers ``get_result()``.

Django 6 ships the ``django.tasks`` API (``@task``, ``.enqueue()``,
``.using(run_after=...)``) with no production backend; Django 5.2 gets the
same API from the ``django-tasks`` backport. This backend puts such tasks on
the same delay topology, on-commit rule and worker as ``defer()``: a task
enqueued here is a job like any other, so ``run_deferred_worker`` runs both
kinds from the same queues.

Results: ``get_result()`` and ``aget_result()`` (so ``TaskResult.refresh()``)
read the workers' records from the results stream (:mod:`deferred.records.results`),
with no table. A task no worker has started reads ``READY`` in any process,
from its record in the ledger stream (:mod:`deferred.records.pending`), the copy the
broker keeps of every job published; the process that enqueued it answers
from memory. A cancelled or superseded task reads
``FAILED`` with a :class:`deferred.results.JobCancelled` error, the
framework having no status of its own for it.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.apps import apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from deferred.conf import SETTINGS_BY_KEY, DeferredSettings, get_settings
from deferred.core.delays import delay_ms
from deferred.core.jobs import Job, due_of, new_job_id, utcnow
from deferred.core.retries import (
    Backoff,
    RetryPolicy,
)
from deferred.django_tasks.framework import (
    DEFAULT_TASK_QUEUE_NAME,
    BaseTaskBackend,
    FrameworkTask,
    InvalidTask,
    InvalidTaskBackend,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    api,
    inline_result,
    normalize_json,
    send,
)
from deferred.producer.asynchronous import asubmit
from deferred.producer.publishing import submit
from deferred.producer.tasks import SETTING, UnknownTask, check_call
from deferred.records import pending
from deferred.records.result_format import CANCELLED, FAILED, PENDING, RUNNING, SUCCEEDED
from deferred.records.results import Result, result

logger = logging.getLogger("deferred.backends")

#: OPTIONS this backend understands; each defaults to the DEFERRED key of the same name.
OPTION_NAMES = ("ON_COMMIT", "MAX_RETRIES", "RETRY_BACKOFF", "TIME_LIMIT")


class RabbitMQBackend(BaseTaskBackend):  # type: ignore[misc]
    """Enqueue django.tasks tasks as deferred jobs; ``run_deferred_worker`` runs them.

    ``QUEUES`` (default: every queue of ``DEFERRED['QUEUES']``) are the queue
    names a task may use, each one a target queue of DEFERRED. The framework's
    default queue name, ``"default"``, is always accepted: a task that names
    no queue goes to DEFERRED's default queue (the first of its QUEUES), as a
    job of ``defer()`` does. ``OPTIONS`` may set ``ON_COMMIT``,
    ``MAX_RETRIES``, ``RETRY_BACKOFF`` and ``TIME_LIMIT`` for this backend's
    tasks (django.tasks' ``@task`` has no time limit of its own); unset, they
    follow ``DEFERRED``.
    """

    supports_defer = True
    supports_async_task = True
    #: From the results stream the workers write (deferred.records.results), with no table.
    supports_get_result = True
    #: Django's -100..100, as ``@deferred.task(priority=...)``: among due jobs, higher runs
    #: first, as far as the queues allow (see :mod:`deferred.core.priorities`).
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        if "QUEUES" not in params:
            # Backends are made when tasks are decorated, at import time: a bad
            # DEFERRED must not crash that, it is reported by `manage.py check`.
            self.queues = {*_configured_queues(), DEFAULT_TASK_QUEUE_NAME}
        options = dict(self.options)
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise InvalidTaskBackend(
                f"Unknown OPTIONS for TASKS[{alias!r}]: {', '.join(unknown)}. "
                f"Known: {', '.join(OPTION_NAMES)}."
            )
        self.on_commit: bool | None = _option(alias, options, "ON_COMMIT")
        self.max_retries: int | None = _option(alias, options, "MAX_RETRIES")
        self.retry_backoff: Backoff | None = _option(alias, options, "RETRY_BACKOFF")
        #: Seconds an attempt may run; ``SETTING``: DEFERRED['TIME_LIMIT'] (``None``: no limit).
        self.time_limit_s: float | None = (
            _option(alias, options, "TIME_LIMIT") if "TIME_LIMIT" in options else SETTING
        )

    def validate_task(self, task: Any) -> None:
        """The queue is a target queue of DEFERRED, then the framework's own checks.

        Ours first: the framework's "Queue ... is not valid for backend" does
        not say where the valid ones come from.
        """
        if isinstance(task.run_after, timedelta):
            raise InvalidTask(
                f"run_after must be an aware datetime, not a timedelta ({task.run_after!r}): "
                "write run_after=timezone.now() + timedelta(...), or use deferred.defer(), "
                "which takes a delay."
            )
        configured = _configured_queues()
        if configured and _target_queue(task.queue_name, configured) is None:
            raise InvalidTask(
                f"Queue {task.queue_name!r} is not in DEFERRED['QUEUES'] {list(configured)!r}: "
                "add it there and run declare_delay_topology."
            )
        super().validate_task(task)

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        """Publish the task as a job (after the commit inside ``atomic()``).

        The result's id is the job id, the one the worker logs and
        ``deferred_failed`` lists. Raises ``InvalidTask`` for a task this
        backend cannot run as asked, ``TypeError`` for arguments the function
        cannot take or JSON cannot carry, ``deferred.BrokerError`` if the
        broker cannot take the job.
        """
        enqueuing = self._enqueuing(task, args, kwargs)
        # task_enqueued once the job is on the broker: after the commit inside
        # atomic(), never for a rollback.
        token = inline_result.set(enqueuing.result)
        try:
            submit(enqueuing.job, enqueuing.wait_ms, **enqueuing.submit_options)
        finally:
            inline_result.reset(token)
        _remember(enqueuing.result)
        return enqueuing.result

    async def aenqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        """:meth:`enqueue` for async code: the checks at once, the publish in a thread.

        The framework's default runs all of ``enqueue()`` through
        ``sync_to_async``, one call at a time in one thread; this one
        publishes as ``deferred.adefer()`` does, many at once.
        """
        enqueuing = self._enqueuing(task, args, kwargs)
        token = inline_result.set(enqueuing.result)
        try:
            await asubmit(enqueuing.job, enqueuing.wait_ms, **enqueuing.submit_options)
        finally:
            inline_result.reset(token)
        _remember(enqueuing.result)
        return enqueuing.result

    def get_result(self, result_id: str) -> Any:
        """The task's result from the workers' records (``deferred.result()``), or, for a
        task no worker has started, ``READY`` from its record in the ledger
        (:mod:`deferred.records.pending`): in any process, once ``enqueue()`` returned.

        ``TaskResultDoesNotExist`` for an id nothing names (unknown, older than
        ``RESULT_TTL``, or none found before the read ran out of time), and
        for a job that is not this backend's; ``deferred.BrokerUnavailable``
        if no broker node answers; ``deferred.TopologyNotDeclared`` if the
        streams are not there.
        """
        try:
            found = result(result_id)
        except ValueError:
            raise TaskResultDoesNotExist(f"{result_id!r} is not a task result id.") from None
        if found.outcome is None:
            enqueued = _enqueued_here(result_id)
            if enqueued is not None and enqueued.backend == self.alias:
                return enqueued
            if not found.complete:
                raise TaskResultDoesNotExist(
                    f"No result found for {result_id!r} before the read of the results "
                    "stream ran out of time (DEFERRED['PUBLISH_TIMEOUT'])."
                )
            settings = get_settings()
            waiting = pending.find(settings, result_id) if _may_be_waiting(result_id) else None
            if waiting is not None and waiting.job is not None:
                return self._ready_result(waiting.job)
            if waiting is not None and not waiting.complete:
                raise TaskResultDoesNotExist(
                    f"No task found for {result_id!r} before the read of the ledger ran "
                    "out of time (DEFERRED['PUBLISH_TIMEOUT']): a busy ledger, or a task "
                    "published long after it was enqueued."
                )
            raise TaskResultDoesNotExist(
                f"No task enqueued with id {result_id!r}: the id is unknown, or older than "
                "DEFERRED['RESULT_TTL']."
            )
        if found.backend != self.alias:
            raise TaskResultDoesNotExist(
                f"{result_id!r} is not a task of TASKS[{self.alias!r}] "
                f"(it is {found.task!r}, enqueued through {found.backend or 'defer()'})."
            )
        return self._task_result(found)

    async def aget_result(self, result_id: str) -> Any:
        """:meth:`get_result` for async code: the read runs in a worker thread, so the
        event loop goes on meanwhile."""
        from asgiref.sync import sync_to_async

        return await sync_to_async(self.get_result, thread_sensitive=False)(result_id)

    def _task_result(self, found: Result) -> Any:
        """The framework's ``TaskResult`` for what the records say."""
        enqueued = _enqueued_here(found.id)
        task = enqueued.task if enqueued is not None else self._framework_task(found)
        errors = [
            TaskError(exception_class_path=e.type, traceback=e.traceback) for e in found.errors
        ]
        if found.state == CANCELLED:
            errors.append(
                TaskError(
                    exception_class_path="deferred.results.JobCancelled",
                    traceback=f"deferred.results.JobCancelled: {found.outcome}\n",
                )
            )
        task_result = TaskResult(
            task=task,
            id=found.id,
            status=_STATUSES[found.state],
            enqueued_at=found.enqueued_at,
            started_at=found.started_at,
            finished_at=found.finished_at,
            last_attempted_at=found.last_attempted_at,
            args=list(found.args),
            kwargs=dict(found.kwargs),
            backend=self.alias,
            errors=errors,
            worker_ids=list(found.workers),
        )
        if found.state == SUCCEEDED:
            object.__setattr__(task_result, "_return_value", found.value)
        return task_result

    def _ready_result(self, job: Job) -> Any:
        """The ``READY`` result of a task as its ledger record has it (not started)."""
        if job.backend != self.alias:
            raise TaskResultDoesNotExist(
                f"{job.id!r} is not a task of TASKS[{self.alias!r}] "
                f"(it is {job.task!r}, enqueued through {job.backend or 'defer()'})."
            )
        first_due = due_of(job.id)
        task = self._framework_task(
            Result(
                id=job.id,
                task=job.task,
                args=job.args,
                kwargs=job.kwargs,
                queue=job.queue,
                priority=job.priority,
                run_after=first_due if first_due and first_due > job.created else None,
            )
        )
        return _ready(task, job.id, job.created, job.args, job.kwargs, self.alias)

    def _framework_task(self, found: Result) -> Any:
        """The django.tasks ``Task`` a record names, looked up as the worker does."""
        job = Job(
            id=found.id,
            task=found.task or "",
            args=found.args,
            kwargs=found.kwargs,
            due=found.enqueued_at or utcnow(),
            queue=found.queue or "",
            backend=self.alias,
        )
        try:
            task, _ = find_task(job)
            # As it was enqueued: the queue (above), the priority and the run_after.
            if found.priority is not None:
                task = task.using(priority=found.priority)
            return task.using(run_after=found.run_after) if found.run_after else task
        except (UnknownTask, InvalidTask) as exc:
            raise TaskResultDoesNotExist(f"{found.id!r}: {exc}") from None

    def _enqueuing(self, task: Any, args: Any, kwargs: Any) -> _Enqueuing:
        """Every check of ``enqueue()``, the job it publishes and the result it returns."""
        self.validate_task(task)
        settings = get_settings()
        try:
            # As the framework's TaskResult has them (bytes as text, tuples as lists):
            # what the task receives under its own backends too.
            args, kwargs = normalize_json(list(args)), normalize_json(dict(kwargs))
        except (TypeError, ValueError):
            pass  # job.encode() below raises the TypeError, naming the task
        _check_arguments(task, tuple(args), dict(kwargs))
        now = utcnow()
        wait_ms = self._wait_ms(task.run_after, now, settings)
        due = now + timedelta(milliseconds=wait_ms)
        job = Job(
            id=new_job_id(due, now=now),
            task=task.module_path,
            args=tuple(args),
            kwargs=dict(kwargs),
            due=due,
            queue=_target_queue(task.queue_name, settings.queues) or task.queue_name,
            created=now,
            backend=self.alias,
            priority=task.priority,
        )
        body = job.encode()  # TypeError now, naming the task, if JSON cannot carry the arguments
        result = _ready(task, job.id, now, args, kwargs, self.alias)
        return _Enqueuing(
            job,
            wait_ms,
            result,
            {
                "on_commit": self.on_commit,
                "settings": settings,
                "on_published": partial(send, "task_enqueued", type(self), result),
                "body": body,
            },
        )

    @staticmethod
    def _wait_ms(run_after: datetime | None, now: datetime, settings: DeferredSettings) -> int:
        if run_after is None:
            return 0
        try:
            return delay_ms(
                run_after,
                now=now,
                resolution_ms=settings.resolution_ms,
                max_delay_ms=settings.max_delay_ms,
            )
        except (TypeError, ValueError) as exc:
            raise InvalidTask(f"run_after: {exc}") from exc

    def time_limit(self, settings: DeferredSettings) -> float | None:
        """Seconds an attempt of this backend's tasks may run; ``None``: no limit."""
        return settings.time_limit_s if self.time_limit_s is SETTING else self.time_limit_s

    def retry_policy(self, settings: DeferredSettings) -> RetryPolicy:
        """This backend's OPTIONS over the DEFERRED defaults."""
        return RetryPolicy(
            max_retries=settings.max_retries if self.max_retries is None else self.max_retries,
            backoff=settings.retry_backoff if self.retry_backoff is None else self.retry_backoff,
        )

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        if not apps.is_installed("deferred"):
            # The worker command, the topology's declaration and its checks are the app's.
            return [
                checks.Error(
                    f"TASKS[{self.alias!r}] uses deferred.backends.RabbitMQBackend, but the "
                    "deferred app is not installed.",
                    hint="Add 'deferred' to INSTALLED_APPS.",
                    id="deferred.E011",
                )
            ]
        configured = _configured_queues()
        if not configured:
            return []  # DEFERRED itself is wrong: deferred's own check says how
        missing = sorted(q for q in self.queues if _target_queue(q, configured) is None)
        if not missing:
            return []
        return [
            checks.Error(
                f"TASKS[{self.alias!r}]['QUEUES'] names {', '.join(missing)}, not in "
                f"DEFERRED['QUEUES'] {list(configured)!r}.",
                hint="Every queue of the backend must be a target queue of DEFERRED.",
                id="deferred.E010",
            )
        ]


#: What a result's state is in the framework's terms: a cancelled task "was
#: unable to start", which the framework calls FAILED.
_STATUSES = {
    PENDING: TaskResultStatus.READY,
    RUNNING: TaskResultStatus.RUNNING,
    SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    FAILED: TaskResultStatus.FAILED,
    CANCELLED: TaskResultStatus.FAILED,
}

#: The results this process enqueued lately, newest last: until a worker writes
#: a record, they are what ``get_result()`` answers (READY) for them.
_ENQUEUED_MAX = 10_000
_enqueued: OrderedDict[str, Any] = OrderedDict()
_enqueued_lock = threading.Lock()


def _may_be_waiting(result_id: str) -> bool:
    """Whether no record of ``result_id`` in the results means "not started yet": only
    with results on, for an id the results stream still has records of. A task that
    ran with results off, or longer ago than ``RESULT_TTL``, has a ledger record
    too, and must not read READY again."""
    settings = get_settings()
    if not (settings.ledger and settings.results):
        return False
    due = due_of(result_id)
    return due is not None and due > utcnow() - timedelta(milliseconds=settings.result_ttl_ms)


def _remember(task_result: Any) -> None:
    with _enqueued_lock:
        _enqueued[task_result.id] = task_result
        while len(_enqueued) > _ENQUEUED_MAX:
            _enqueued.popitem(last=False)


def _ready(
    task: Any, result_id: str, enqueued_at: datetime, args: Any, kwargs: Any, backend: str
) -> Any:
    """A ``READY`` result: enqueued, not started (at enqueue, from this process's memory,
    or from the ledger)."""
    return TaskResult(
        task=task,
        id=result_id,
        status=TaskResultStatus.READY,
        enqueued_at=enqueued_at,
        started_at=None,
        finished_at=None,
        last_attempted_at=None,
        args=list(args),
        kwargs=dict(kwargs),
        backend=backend,
        errors=[],
        worker_ids=[],
    )


def _enqueued_here(result_id: str) -> Any:
    """A fresh READY copy of a result this process enqueued, or ``None``."""
    with _enqueued_lock:
        known = _enqueued.get(result_id)
    if known is None:
        return None
    return _ready(known.task, known.id, known.enqueued_at, known.args, known.kwargs, known.backend)


@dataclass(frozen=True)
class _Enqueuing:
    """A django.tasks call turned into a job, ready for ``submit()``."""

    job: Job
    wait_ms: int
    result: Any
    submit_options: dict[str, Any]


def _option(alias: str, options: dict[str, Any], name: str) -> Any:
    """``OPTIONS[name]`` parsed by its DEFERRED twin's row of the settings table, so
    that both take the same values and say the same of a bad one; ``None`` if unset."""
    if options.get(name) is None:
        return None
    try:
        return SETTINGS_BY_KEY[name].parse(f"TASKS[{alias!r}]['OPTIONS'][{name!r}]", options[name])
    except ImproperlyConfigured as exc:
        raise InvalidTaskBackend(str(exc)) from exc


def _target_queue(queue_name: str, configured: tuple[str, ...]) -> str | None:
    """The DEFERRED queue a django.tasks ``queue_name`` means; ``None`` if none.

    ``"default"``, what ``@task`` gives a task that names no queue, means
    DEFERRED's default queue when DEFERRED has no queue of that name.
    """
    if queue_name in configured:
        return queue_name
    if queue_name == DEFAULT_TASK_QUEUE_NAME and configured:
        return configured[0]
    return None


def _configured_queues() -> tuple[str, ...]:
    """DEFERRED['QUEUES'], or nothing while DEFERRED is invalid (the system check reports it)."""
    try:
        return get_settings().queues
    except ImproperlyConfigured:
        return ()


def _check_arguments(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``TypeError`` now, in the caller, rather than in the worker hours later."""
    if task.takes_context:
        args = (None, *args)  # the worker passes the context first
    check_call(task.func, task.module_path, args, kwargs)


def _task_module(path: str, module_name: str) -> Any:
    """The module of a django.tasks task, imported if it lies inside an installed app.

    django.tasks' own workers import a task's module path, so a task may
    live in any module of an app (``accounts/jobs.py``), not only in the
    ``tasks.py`` the worker loads at start. Only dotted names of public
    identifiers under an installed app's package are looked up, loaded or
    not (``os`` is loaded, and still refused); an error
    while importing is the job's ``unknown_task``, not the worker's crash.
    """
    parts = module_name.split(".") if module_name else []
    if not parts or not all(p.isidentifier() and not p.startswith("_") for p in parts):
        raise UnknownTask(f"django.tasks task {path!r}: {module_name!r} is not a module path.")
    inside = any(
        module_name == config.name or module_name.startswith(f"{config.name}.")
        for config in apps.get_app_configs()
    )
    if not inside:
        raise UnknownTask(
            f"django.tasks task {path!r}: module {module_name!r} is not inside the package "
            "of an installed app, and the worker imports tasks from those only. Define "
            "django.tasks tasks in a module of an app listed in INSTALLED_APPS."
        )
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        return loaded
    try:
        return importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any import failure refuses the job
        raise UnknownTask(
            f"django.tasks task {path!r}: importing {module_name!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from None


def find_task(job: Job) -> tuple[Any, RabbitMQBackend]:
    """The django.tasks task a job names, and its backend; ``UnknownTask`` if it cannot
    be run here. The worker runs it; ``get_result()`` rebuilds a result's ``task`` with it.

    A message names a module path: the worker imports it only when it lies
    inside the package of an installed app (see :func:`_task_module`), and
    the object found must be a django.tasks ``Task`` enqueued through a
    ``RabbitMQBackend`` of this worker's settings. A forged message can
    neither import a module elsewhere (``os``, a package outside
    ``INSTALLED_APPS``) nor call anything that is not such a task.
    """
    assert job.backend is not None
    # The backend first: a job naming an alias that is not ours imports nothing.
    try:
        backend = api.task_backends[job.backend]
    except InvalidTaskBackend as exc:
        raise UnknownTask(
            f"Job {job.id} was enqueued through TASKS[{job.backend!r}], which this worker's "
            f"settings do not have: {exc}"
        ) from None
    if not isinstance(backend, RabbitMQBackend):
        raise UnknownTask(
            f"TASKS[{job.backend!r}] is {type(backend).__name__} here, not RabbitMQBackend."
        )
    module_name, _, attribute = job.task.rpartition(".")
    module = _task_module(job.task, module_name)
    found = getattr(module, attribute, None)
    if not isinstance(found, FrameworkTask):
        raise UnknownTask(f"{job.task!r} is not a django.tasks task (got {found!r}).")
    # The job holds its DEFERRED queue; "default" is how a task names the
    # default one when the backend's QUEUES do not list it by name.
    queue_name = job.queue if job.queue in backend.queues else DEFAULT_TASK_QUEUE_NAME
    try:
        task = found.using(backend=job.backend, queue_name=queue_name)
    except InvalidTask as exc:
        raise UnknownTask(f"django.tasks task {job.task!r} cannot run here: {exc}") from None
    return task, backend
