"""The django.tasks backend against the real broker: Django 6's django.tasks, or
Django 5.2 with the django-tasks backport (the same tests run on both in CI)."""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.db import transaction
from django.test import override_settings

from deferred import testing
from deferred.backends import InvalidTask, InvalidTaskBackend, RabbitMQBackend
from deferred.conf import get_settings
from deferred.core.jobs import Job, new_job_id
from deferred.core.topology import plan_topology
from deferred.django_tasks.framework import api as _api
from deferred.django_tasks.framework import signals as _signals
from deferred.producer.publishing import publish
from deferred.records.failures import list_failed
from tests.conftest import depth, total_waiting, wait_for
from tests.testapp.framework_tasks import double, email_users, flaky, note, note_async

pytestmark = pytest.mark.django_db(transaction=True)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_backend_says_what_it_supports():
    backend = _api.task_backends["default"]
    assert isinstance(backend, RabbitMQBackend)
    assert backend.supports_defer is True
    assert backend.supports_async_task is True
    # Results from the results stream, with no table; priorities, on Django's -100..100 scale.
    assert backend.supports_get_result is True
    assert backend.supports_priority is True
    # Without QUEUES, every target queue of DEFERRED.
    assert backend.queues == {"default", "other"}


def test_what_it_cannot_honour_is_refused_with_the_frameworks_exceptions(clean):
    with pytest.raises(InvalidTask, match="priority"):
        email_users.using(priority=101)  # the framework's own range check
    with pytest.raises(InvalidTask, match=r"not in DEFERRED\[.QUEUES.\]"):
        email_users.using(queue_name="nowhere")
    with pytest.raises(InvalidTask, match="aware"):
        email_users.using(run_after=datetime(2030, 1, 1)).enqueue(["a@example.com"], "s", "m")
    far = datetime.now(UTC) + timedelta(days=365 * 11)
    with pytest.raises(InvalidTask, match="run_after"):
        email_users.using(run_after=far).enqueue(["a@example.com"], "s", "m")
    with pytest.raises(_api.exceptions.TaskResultDoesNotExist):
        _api.task_backends["default"].get_result("anything")


def test_bad_arguments_are_refused_before_anything_is_published(clean, raw_channel):
    with pytest.raises(TypeError, match="Bad arguments"):
        email_users.enqueue(["a@example.com"], "subject")  # message missing
    with pytest.raises(TypeError, match="JSON"):
        email_users.enqueue([object()], "s", "m")
    with pytest.raises(TypeError, match="Bad arguments"):
        flaky.enqueue("only-one")  # context is passed by the worker, not the caller
    assert total_waiting(raw_channel, clean) == 0


def test_unknown_options_are_a_configuration_error():
    with pytest.raises(InvalidTaskBackend, match="PRIORITY"):
        RabbitMQBackend("x", {"OPTIONS": {"PRIORITY": 1}})
    with pytest.raises(InvalidTaskBackend, match="ON_COMMIT"):
        RabbitMQBackend("x", {"OPTIONS": {"ON_COMMIT": "yes"}})
    with pytest.raises(InvalidTaskBackend, match="MAX_RETRIES"):
        RabbitMQBackend("x", {"OPTIONS": {"MAX_RETRIES": -1}})


def test_the_docs_example_runs_through_the_worker_not_before_run_after(
    clean, worker_process, tmp_path, monkeypatch
):
    mail_dir = tmp_path / "mail"
    monkeypatch.setenv("DEFERRED_TEST_MAIL_DIR", str(mail_dir))
    worker = worker_process()
    run_after = datetime.now(UTC) + timedelta(milliseconds=400)
    result = email_users.using(run_after=run_after).enqueue(
        emails=["ada@example.com"], subject="You have mail", message="Hello"
    )
    assert result.status == _api.TaskResultStatus.READY
    assert result.backend == "default"
    assert re.fullmatch(r"[0-9a-f]{32}", result.id)

    # The file backend creates the file, then writes it: wait for the message, not the file.
    def sent_message() -> bool:
        return mail_dir.exists() and any("Subject:" in f.read_text() for f in mail_dir.iterdir())

    assert wait_for(sent_message, 15), worker.output()
    (sent,) = list(mail_dir.iterdir())
    ran_at = sent.stat().st_mtime
    assert ran_at >= run_after.timestamp(), "ran before run_after"
    assert ran_at < run_after.timestamp() + 5, "grossly late"
    assert "Subject: You have mail" in sent.read_text()
    # The result id is the job id the worker logs.
    assert wait_for(lambda: f"job={result.id}" in worker.output(), 5), worker.output()
    assert "outcome=succeeded" in worker.output()


def test_a_rollback_enqueues_nothing_a_commit_enqueues_after_it(clean, raw_channel, tmp_path):
    path = tmp_path / "notes.jsonl"
    enqueued: list[str] = []

    def on_enqueued(sender, task_result, **kwargs):
        enqueued.append(task_result.id)

    class Boom(Exception):
        pass

    _signals.task_enqueued.connect(on_enqueued)
    try:
        with pytest.raises(Boom), transaction.atomic():
            note.enqueue(str(path), "rolled back")
            raise Boom
        time.sleep(0.2)
        assert total_waiting(raw_channel, clean) == 0
        assert enqueued == []  # task_enqueued is not sent for a rollback

        with transaction.atomic():
            result = note.enqueue(str(path), "committed")
            # Neither published nor signalled before the commit.
            assert depth(raw_channel, clean.ready_queues["other"].name) == 0
            assert enqueued == []
        assert enqueued == [result.id]
        assert wait_for(lambda: depth(raw_channel, clean.ready_queues["other"].name) == 1, 5)
    finally:
        _signals.task_enqueued.disconnect(on_enqueued)


def test_queue_name_picks_the_target_queue_and_both_kinds_share_the_worker(
    clean, run_worker, tmp_path
):
    path = tmp_path / "notes.jsonl"
    run_worker(queues=["other"])
    note.enqueue(str(path), "django.tasks on other")
    from tests.testapp.tasks import on_other

    on_other.defer(0, str(path), "deferred on other")
    assert wait_for(lambda: len(lines(path)) == 2, 10)
    assert {line["label"] for line in lines(path)} == {
        "django.tasks on other",
        "deferred on other",
    }


def test_async_tasks_run(clean, run_worker, tmp_path):
    path = tmp_path / "notes.jsonl"
    run_worker()
    note_async.enqueue(str(path), "async")
    assert wait_for(lambda: lines(path), 10)
    assert lines(path)[0]["async"] is True


def test_a_task_that_takes_a_context_gets_the_attempt_number(clean, run_worker, tmp_path):
    path = tmp_path / "attempts.jsonl"
    events: list[tuple[str, str, int]] = []
    returned: list[object] = []

    def started(sender, task_result, **kwargs):
        events.append(("started", str(task_result.status), task_result.attempts))

    def finished(sender, task_result, **kwargs):
        events.append(("finished", str(task_result.status), task_result.attempts))
        if task_result.status == "SUCCESSFUL":
            returned.append(task_result.return_value)

    _signals.task_started.connect(started)
    _signals.task_finished.connect(finished)
    tasks_setting = {
        "default": {
            "BACKEND": "deferred.backends.RabbitMQBackend",
            "OPTIONS": {"MAX_RETRIES": 2, "RETRY_BACKOFF": [0.05]},
        }
    }
    try:
        with override_settings(TASKS=tasks_setting):
            run_worker()
            result = flaky.enqueue(str(path), 2)
            assert wait_for(lambda: len(lines(path)) == 3, 15)
            assert wait_for(lambda: len(events) == 6, 5), events
    finally:
        _signals.task_started.disconnect(started)
        _signals.task_finished.disconnect(finished)
    assert [line["attempt"] for line in lines(path)] == [1, 2, 3]
    assert {line["id"] for line in lines(path)} == {result.id}
    # An attempt that will be retried is READY ("ready to be executed again"),
    # not FAILED: the framework's handler would log it as a failed task.
    assert events == [
        ("started", "RUNNING", 1),
        ("finished", "READY", 1),
        ("started", "RUNNING", 2),
        ("finished", "READY", 2),
        ("started", "RUNNING", 3),
        ("finished", "SUCCESSFUL", 3),
    ]
    assert returned == [3]  # the task's return value, as the framework's backends give it


def test_a_failing_task_goes_to_the_failed_queue_with_its_job_id(clean, run_worker, tmp_path):
    finished: list[tuple[str, list[str]]] = []

    def on_finished(sender, task_result, **kwargs):
        paths = [error.exception_class_path for error in task_result.errors]
        finished.append((str(task_result.status), paths))

    run_worker()
    _signals.task_finished.connect(on_finished)
    try:
        result = flaky.enqueue(str(tmp_path / "a.jsonl"), 5)  # no retries by default
        assert wait_for(lambda: list_failed(get_settings()), 10)
    finally:
        _signals.task_finished.disconnect(on_finished)
    assert finished == [("FAILED", ["builtins.RuntimeError"])]
    (entry,) = list_failed(get_settings())
    assert entry.id == result.id
    assert entry.reason == "task_error"
    assert entry.job is not None and entry.job.backend == "default"


def forged_failure(task: str, args: tuple = ()):
    """Publish a django.tasks job naming ``task`` as if by anyone; return its failed entry."""
    job = Job(
        id=new_job_id(),
        task=task,
        args=args,
        kwargs={},
        due=datetime.now(UTC),
        queue="default",
        backend="default",
    )
    publish(job, 0)
    assert wait_for(lambda: list_failed(get_settings()), 10)
    (entry,) = list_failed(get_settings())
    return entry


def test_a_forged_job_naming_something_else_is_not_run(clean, run_worker):
    run_worker()
    entry = forged_failure("os.system", ("touch /tmp/owned",))
    assert entry.reason == "unknown_task"
    assert "not inside the package of an installed app" in (entry.error or "")


def test_a_task_in_any_module_of_an_installed_app_is_imported_and_run(
    clean, worker_process, tmp_path
):
    # tests/testapp/not_loaded.py is no tasks.py: the worker process has not
    # imported it when the job arrives, and imports it then.
    worker = worker_process()
    path = tmp_path / "stamp.txt"
    job = Job(
        id=new_job_id(),
        task="tests.testapp.not_loaded.stamp",
        args=(str(path),),
        kwargs={},
        due=datetime.now(UTC),
        queue="default",
        backend="default",
    )
    publish(job, 0)
    assert wait_for(path.exists, 15), worker.output()
    assert path.read_text() == f"ran in {worker.proc.pid}"
    assert wait_for(lambda: f"job={job.id}" in worker.output(), 5), worker.output()
    assert "outcome=succeeded" in worker.output()


@pytest.mark.parametrize(
    ("path", "why"),
    [
        # Outside every installed app: never imported, whatever it is.
        ("http.server.test", "not inside the package of an installed app"),
        ("antigravity.fly", "not inside the package of an installed app"),
        ("tests.fixtures_elsewhere.task", "not inside the package of an installed app"),
        # Inside an app, but private, or not a module path at all.
        ("tests.testapp._private.task", "is not a module path"),
        ("tests.testapp..task", "is not a module path"),
        ("task", "is not a module path"),
        # Inside an app, imported, but what it names is no task.
        ("tests.testapp.not_loaded.helper", "not a django.tasks task"),
        ("tests.testapp.not_loaded.missing", "not a django.tasks task"),
        # Inside an app, and importing it fails.
        ("tests.testapp.broken_import.task", "importing 'tests.testapp.broken_import' failed"),
        ("tests.testapp.no_such_module.task", "importing 'tests.testapp.no_such_module' failed"),
    ],
)
def test_a_job_naming_a_path_the_worker_must_not_import_is_refused(
    clean, run_worker, tmp_path, path, why
):
    imported_before = set(sys.modules)
    run_worker()
    entry = forged_failure(path, (str(tmp_path / "ran.txt"),))
    assert entry.reason == "unknown_task"
    assert why in (entry.error or ""), entry.error
    assert not (tmp_path / "ran.txt").exists()
    newly = set(sys.modules) - imported_before
    assert not {"http.server", "antigravity", "tests.fixtures_elsewhere"} & newly


def test_a_task_enqueued_through_another_kind_of_backend_is_refused(clean, run_worker):
    with override_settings(
        TASKS={
            "default": {"BACKEND": "deferred.backends.RabbitMQBackend"},
            "immediate": {"BACKEND": f"{_api.__name__}.backends.immediate.ImmediateBackend"},
        }
    ):
        run_worker()
        job = Job(
            id=new_job_id(),
            task="tests.testapp.framework_tasks.double",
            args=(1,),
            kwargs={},
            due=datetime.now(UTC),
            queue="default",
            backend="immediate",
        )
        publish(job, 0)
        assert wait_for(lambda: list_failed(get_settings()), 10)
        (entry,) = list_failed(get_settings())
    assert entry.reason == "unknown_task"
    assert "not RabbitMQBackend" in (entry.error or "")


def test_capture_and_eager_modes_take_django_tasks_too(tmp_path):
    path = tmp_path / "notes.jsonl"
    with testing.capture() as jobs:
        note.enqueue(str(path), "captured")
        double.enqueue(4)
    assert [job.task for job in jobs] == [
        "tests.testapp.framework_tasks.note",
        "tests.testapp.framework_tasks.double",
    ]
    assert [job.args for job in jobs.for_task(note)] == [(str(path), "captured")]
    assert [job.args for job in jobs.for_task(double)] == [(4,)]
    assert jobs.for_task(email_users) == []
    with pytest.raises(TypeError, match="takes a task or a task name"):
        jobs.for_task(42)
    assert not path.exists()
    jobs.run()
    assert [line["label"] for line in lines(path)] == ["captured"]
    with testing.eager():
        note.enqueue(str(path), "eager")
        result = double.enqueue(21)
    assert [line["label"] for line in lines(path)][-1] == "eager"
    # Run inline, as with Django's ImmediateBackend: the result is finished.
    assert result.status == "SUCCESSFUL"
    assert result.return_value == 42
    assert result.is_finished


def test_under_eager_a_failing_task_raises_and_its_result_is_failed(tmp_path):
    results = []

    def on_finished(sender, task_result, **kwargs):
        results.append(task_result)

    _signals.task_finished.connect(on_finished)
    try:
        with testing.eager(), pytest.raises(RuntimeError, match="attempt 1 fails"):
            flaky.enqueue(str(tmp_path / "a.jsonl"), 1)
    finally:
        _signals.task_finished.disconnect(on_finished)
    # eager() never retries, so the attempt is FAILED, not READY.
    assert [str(r.status) for r in results] == ["FAILED"]


def test_a_task_enqueued_receiver_that_raises_loses_no_job(clean, raw_channel, tmp_path, caplog):
    # Inside atomic(), each job waits for its own on-commit callback; a receiver
    # that raised used to stop Django from running the later ones.
    def broken(sender, task_result, **kwargs):
        raise RuntimeError("receiver bug")

    _signals.task_enqueued.connect(broken)
    try:
        with transaction.atomic():
            first = note.enqueue(str(tmp_path / "n.jsonl"), "first")
            second = note.enqueue(str(tmp_path / "n.jsonl"), "second")
        # Outside atomic(): published at once, and no exception tells the caller
        # to enqueue again (which would duplicate the job).
        third = note.enqueue(str(tmp_path / "n.jsonl"), "third")
    finally:
        _signals.task_enqueued.disconnect(broken)
    ready = clean.ready_queues["other"].name
    assert wait_for(lambda: depth(raw_channel, ready) == 3, 5), depth(raw_channel, ready)
    logged = [r for r in caplog.records if r.name == "deferred.backends"]
    assert {r.getMessage().split("(job ")[1][:32] for r in logged} == {
        first.id,
        second.id,
        third.id,
    }
    assert all("task_enqueued" in r.getMessage() and r.exc_info for r in logged)


def test_a_task_that_names_no_queue_goes_to_deferreds_default_queue():
    # DEFERRED without a queue named "default": @task's default queue_name
    # means DEFERRED's default queue (the first), as for defer().
    from deferred.worker.django_tasks import resolve_django_task

    tasks_setting = {"default": {"BACKEND": "deferred.backends.RabbitMQBackend"}}
    explicit = {"default": {"BACKEND": "deferred.backends.RabbitMQBackend", "QUEUES": ["default"]}}
    for setting in (tasks_setting, explicit):
        with override_settings(DEFERRED={"QUEUES": ["other"]}, TASKS=setting):
            with testing.capture() as jobs:
                double.enqueue(1)
            (job,) = jobs
            assert job.queue == "other"
            found = resolve_django_task(job)  # what the worker does with it
            assert found.task.func is double.func
            with pytest.raises(InvalidTask, match=r"not in DEFERRED\['QUEUES'\] \['other'\]"):
                email_users.using(queue_name="billing")


def test_a_backend_queue_outside_deferred_queues_fails_the_system_check():
    backend = RabbitMQBackend("x", {"QUEUES": ["default", "nope"]})
    (error,) = backend.check()
    assert error.id == "deferred.E010"
    assert "nope" in error.msg
    assert RabbitMQBackend("y", {}).check() == []


def test_a_bad_deferred_setting_does_not_crash_task_definitions():
    # Backends are built while tasks modules are imported; a bad DEFERRED is
    # for `manage.py check` to report (deferred.E001), not an import crash.
    with override_settings(DEFERRED={"RADIX": 1}):
        backend = RabbitMQBackend("z", {})
        assert backend.check() == []
        backend.validate_task(email_users)


def test_a_job_naming_a_backend_alias_that_is_not_ours_imports_nothing(clean, run_worker):
    run_worker()
    job = Job(
        id=new_job_id(),
        task="tests.testapp.import_marker.marked",
        args=(),
        kwargs={},
        due=datetime.now(UTC),
        queue="default",
        backend="nope",
    )
    publish(job, 0)
    assert wait_for(lambda: list_failed(get_settings()), 10)
    (entry,) = list_failed(get_settings())
    assert entry.reason == "unknown_task"
    assert "TASKS['nope']" in (entry.error or "")
    assert "tests.testapp.import_marker" not in sys.modules


def test_a_django_tasks_release_older_than_0_12_is_refused_by_name():
    from django.core.exceptions import ImproperlyConfigured

    from deferred.django_tasks.framework import check_backport_release as _check_backport_release

    for old in ("0.11.0", "0.9", "0.10.2"):  # SUCCEEDED, not Django 6's SUCCESSFUL
        with pytest.raises(ImproperlyConfigured, match=rf"0\.12 or newer; {re.escape(old)} is"):
            _check_backport_release(old)
    for new in ("0.12.0", "0.12", "0.13.1", "1.0.0rc1"):
        _check_backport_release(new)


def test_the_backend_options_time_limit_stops_sync_and_async_tasks(clean, run_worker, tmp_path):
    from tests.testapp.framework_tasks import spin, spin_async

    finished: list[tuple[str, list[str]]] = []

    def on_finished(sender, task_result, **kwargs):
        paths = [error.exception_class_path for error in task_result.errors]
        finished.append((str(task_result.status), paths))

    tasks_setting = {
        "default": {"BACKEND": "deferred.backends.RabbitMQBackend", "OPTIONS": {"TIME_LIMIT": 0.3}}
    }
    _signals.task_finished.connect(on_finished)
    try:
        with override_settings(TASKS=tasks_setting):
            run_worker(concurrency=2)
            ids = {spin.enqueue(str(tmp_path / "s"), "sync").id}
            ids.add(spin_async.enqueue(str(tmp_path / "s"), "async").id)
            assert wait_for(lambda: len(list_failed(get_settings())) == 2, 15)
            assert wait_for(lambda: len(finished) == 2, 5)
    finally:
        _signals.task_finished.disconnect(on_finished)
    entries = list_failed(get_settings())
    assert {e.id for e in entries} == ids
    assert {e.reason for e in entries} == {"timed_out"}
    assert finished == [("FAILED", ["deferred.TimeLimitExceeded"])] * 2


def test_a_bad_time_limit_option_is_a_configuration_error():
    setting = {"x": {"BACKEND": "deferred.backends.RabbitMQBackend", "OPTIONS": {"TIME_LIMIT": 0}}}
    with pytest.raises(InvalidTaskBackend, match=r"TASKS\['x'\]\['OPTIONS'\]\['TIME_LIMIT'\]"):
        RabbitMQBackend("x", setting["x"])


def test_a_priority_travels_with_the_job(clean, raw_channel):
    from deferred.core.jobs import Job

    result = email_users.using(priority=60).enqueue(["a@example.com"], "s", "m")
    queue = plan_topology(get_settings()).ready_queues["default"].name
    assert wait_for(lambda: depth(raw_channel, queue) == 1, 5)
    _, props, body = raw_channel.basic_get(queue, auto_ack=True)
    assert Job.decode(body).id == result.id and Job.decode(body).priority == 60
    assert props.priority == 7  # 41-60 on Django's scale: level 7 of 0-9


# ---------------------------------------------------------------------- results


def test_refresh_follows_a_task_from_ready_to_successful(clean, run_worker):
    result = double.using(run_after=datetime.now(UTC) + timedelta(milliseconds=300)).enqueue(21)
    # Enqueued here, not started: READY, from this process's memory
    result.refresh()
    assert result.status == _api.TaskResultStatus.READY
    worker = run_worker(concurrency=2)

    def successful() -> bool:
        result.refresh()
        return result.status == _api.TaskResultStatus.SUCCESSFUL

    assert wait_for(successful, 15), result.status
    assert result.return_value == 42
    assert result.worker_ids == [worker.worker_id]
    assert result.started_at is not None and result.finished_at >= result.started_at
    assert result.last_attempted_at == result.started_at
    assert result.errors == []
    # Another process has none of this memory: get_result() reads the stream alone.
    from deferred.django_tasks import backend as backends

    backends._enqueued.clear()
    fresh = _api.task_backends["default"].get_result(result.id)
    assert fresh.status == _api.TaskResultStatus.SUCCESSFUL
    assert fresh.return_value == 42
    assert fresh.task.name == double.name
    assert fresh.args == [21] and fresh.kwargs == {}
    assert fresh.enqueued_at is not None and fresh.enqueued_at <= fresh.started_at


def test_a_failed_task_reads_failed_with_every_attempts_error(clean, run_worker, tmp_path):
    path = tmp_path / "attempts.jsonl"
    with override_settings(
        TASKS={
            "default": {
                "BACKEND": "deferred.backends.RabbitMQBackend",
                "OPTIONS": {"MAX_RETRIES": 1, "RETRY_BACKOFF": [0.1]},
            }
        }
    ):
        result = flaky.enqueue(str(path), 5)
        run_worker(concurrency=1)

        def failed() -> bool:
            result.refresh()
            return result.status == _api.TaskResultStatus.FAILED

        assert wait_for(failed, 15), result.status
    assert len(result.errors) == 2
    assert result.errors[-1].exception_class is RuntimeError
    assert "attempt 2 fails" in result.errors[-1].traceback
    with pytest.raises(ValueError):
        result.return_value  # noqa: B018 - the framework raises for a failed task


def test_aget_result_reads_without_blocking_the_loop(clean, run_worker):
    import asyncio

    result = double.enqueue(4)
    run_worker(concurrency=1)

    async def poll() -> tuple[object, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        ticker = asyncio.create_task(tick())
        try:
            for _ in range(300):
                await result.arefresh()
                if result.status == _api.TaskResultStatus.SUCCESSFUL:
                    break
                await asyncio.sleep(0.05)
        finally:
            ticker.cancel()
        return result.status, ticks

    status, ticks = asyncio.run(poll())
    assert status == _api.TaskResultStatus.SUCCESSFUL and result.return_value == 8
    assert ticks > 0  # the loop ran while the reads went on


def test_a_cancelled_task_reads_failed_with_job_cancelled(clean, run_worker):
    from deferred import cancel

    result = double.using(run_after=datetime.now(UTC) + timedelta(milliseconds=300)).enqueue(1)
    cancel(result.id)
    run_worker(concurrency=1)

    def ended() -> bool:
        result.refresh()
        return result.status == _api.TaskResultStatus.FAILED

    assert wait_for(ended, 15), result.status
    assert result.errors[-1].exception_class_path == "deferred.results.JobCancelled"


def test_a_job_of_defer_is_no_task_result(clean, run_worker):
    from deferred import defer
    from tests.testapp.tasks import add

    job_id = defer(add, 0, 1, 2)
    run_worker(concurrency=1)
    from deferred import result as read

    assert wait_for(lambda: read(job_id).state == "succeeded", 15)
    with pytest.raises(_api.exceptions.TaskResultDoesNotExist, match="not a task"):
        _api.task_backends["default"].get_result(job_id)


def test_result_task_read_in_another_process_is_the_task_that_was_enqueued(clean, run_worker):
    # Given a task enqueued to another queue, with a priority and a run_after
    when = datetime.now(UTC) + timedelta(milliseconds=300)
    result = double.using(queue_name="other", priority=5, run_after=when).enqueue(2)
    run_worker(concurrency=1)
    assert wait_for(lambda: _succeeded(result), 15), result.status

    # When another process (none of this one's memory) reads it
    from deferred.django_tasks import backend as backends

    backends._enqueued.clear()
    fresh = _api.task_backends["default"].get_result(result.id)

    # Then its task is the one enqueued: path, queue, priority, run_after, backend
    assert fresh.task.module_path == double.module_path
    assert fresh.task.queue_name == "other" and fresh.task.priority == 5
    assert fresh.task.backend == "default"
    assert abs((fresh.task.run_after - when).total_seconds()) < 0.01, fresh.task.run_after


def _succeeded(result) -> bool:
    result.refresh()
    return result.status == _api.TaskResultStatus.SUCCESSFUL


def test_a_return_value_json_cannot_carry_fails_the_task_with_a_type_error(clean, run_worker):
    # Given a task that returns a lambda, with retries allowed
    from deferred.backends import ReturnValueNotJSON

    with override_settings(
        TASKS={
            "default": {
                "BACKEND": "deferred.backends.RabbitMQBackend",
                "OPTIONS": {"MAX_RETRIES": 2, "RETRY_BACKOFF": [0.1]},
            }
        }
    ):
        from tests.testapp.framework_tasks import returns_a_lambda

        result = returns_a_lambda.enqueue()
        run_worker(concurrency=1)

        def failed() -> bool:
            result.refresh()
            return result.status == _api.TaskResultStatus.FAILED

        # Then it reads FAILED with a TypeError, as under the framework's own backends
        assert wait_for(failed, 15), result.status
    (error,) = result.errors  # not retried: it ran, and would return the same again
    assert issubclass(error.exception_class, TypeError)
    assert error.exception_class is ReturnValueNotJSON
    assert "JSON" in error.traceback and "function" in error.traceback
    assert wait_for(lambda: any(e.id == result.id for e in list_failed(get_settings())), 10)


def test_the_signals_carry_what_get_result_gives_for_a_retried_task(clean, run_worker, tmp_path):
    # Given receivers of the framework's signals, and a task that fails once
    seen: list[tuple[str, object, object, list[str]]] = []

    def receiver(signal_name):
        def receive(sender, task_result, **kwargs):
            seen.append(
                (
                    signal_name,
                    task_result.started_at,
                    task_result.last_attempted_at,
                    [e.exception_class_path for e in task_result.errors],
                )
            )

        return receive

    started, finished = receiver("started"), receiver("finished")
    _signals.task_started.connect(started)
    _signals.task_finished.connect(finished)
    path = tmp_path / "attempts.jsonl"
    try:
        with override_settings(
            TASKS={
                "default": {
                    "BACKEND": "deferred.backends.RabbitMQBackend",
                    "OPTIONS": {"MAX_RETRIES": 1, "RETRY_BACKOFF": [0.5]},
                }
            }
        ):
            result = flaky.enqueue(str(path), 1)
            run_worker(concurrency=1)
            assert wait_for(lambda: _succeeded(result), 20), result.status
            assert wait_for(lambda: len(seen) == 4, 5), seen
    finally:
        _signals.task_started.disconnect(started)
        _signals.task_finished.disconnect(finished)

    # Then the second attempt's signals carry the first attempt's start and its error,
    # and this attempt's own start, as get_result() does
    (
        (s1, s1_start, s1_last, s1_errors),
        (f1, *_),
        (s2, s2_start, s2_last, s2_errors),
        (
            f2,
            f2_start,
            f2_last,
            f2_errors,
        ),
    ) = seen
    assert (s1, f1, s2, f2) == ("started", "finished", "started", "finished")
    assert s2_start == s1_start == f2_start and s2_last > s1_last
    assert s1_errors == [] and s2_errors == f2_errors == ["builtins.RuntimeError"]
    assert f2_last == s2_last
    assert result.started_at == s1_start
    assert [e.exception_class_path for e in result.errors] == f2_errors


def test_the_argument_check_judges_the_wrapper_a_decorator_made(clean, run_worker):
    from tests.testapp.framework_tasks import wrapped_double

    # A keyword only the wrapper takes (as django-periodic-tasks' @exactly_once passes)
    result = wrapped_double.enqueue(4, _execution_id="run-1")
    run_worker(concurrency=1)
    assert wait_for(lambda: _succeeded(result), 15), result.status
    assert result.return_value == 8
    # A call the wrapper itself cannot take is still refused at once
    with pytest.raises(TypeError, match="Bad arguments"):
        double.enqueue(1, 2)
