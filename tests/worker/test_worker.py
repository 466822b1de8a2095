"""The worker against the real broker: failures, heartbeats, signals, kills, reconnects."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from io import StringIO

import pika
import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from deferred import defer
from deferred.core.jobs import Job, new_job_id, utcnow
from tests.conftest import ROOT, depth, rabbitmqctl, signed, topology_of_its_own, wait_for
from tests.testapp.tasks import explode, read_records, record, says, sleepy

pytestmark = pytest.mark.usefixtures("clean")


def failed_records(channel, plan) -> list[dict]:
    """Take every record out of the failed queue."""
    out = []
    while True:
        method, props, body = channel.basic_get(plan.failed_queue.name, auto_ack=True)
        if method is None:
            return out
        out.append({**json.loads(body), "_headers": props.headers})


def test_a_raising_task_goes_to_the_failed_queue_with_its_traceback(
    clean, raw_channel, run_worker, records
):
    run_worker()
    job_id = defer(explode, 0, "kaboom")
    defer(record, 0.05, records, "after")
    assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 1, 10)
    # deferred_failed list shows the job and its error; -v 2 its traceback too
    listed = StringIO()
    call_command("deferred_failed", "list", stdout=listed)
    lines = listed.getvalue().splitlines()
    (head,) = [n for n, line in enumerate(lines) if line.startswith(job_id)]
    assert "tests.explode  task_error  attempts=1" in lines[head]
    assert lines[head + 1] == "    builtins.RuntimeError: kaboom", lines
    assert "raise RuntimeError" not in listed.getvalue()
    listed = StringIO()
    call_command("deferred_failed", "list", "--tracebacks", stdout=listed)
    assert "      " in listed.getvalue() and "raise RuntimeError(message)" in listed.getvalue()
    (failed,) = failed_records(raw_channel, clean)
    assert failed["reason"] == "task_error"
    assert failed["job"]["id"] == job_id and failed["job"]["task"] == "tests.explode"
    assert failed["error"]["type"] == "builtins.RuntimeError"
    assert failed["error"]["message"] == "kaboom"
    assert "raise RuntimeError(message)" in failed["error"]["traceback"]
    assert failed["attempts"] == 1 and failed["due"] and failed["failed_at"]
    assert failed["_headers"]["x-deferred-reason"] == "task_error"
    # The worker goes on.
    assert wait_for(lambda: len(read_records(records)) == 1, 5)


def publish_raw(channel, queue: str, body: bytes) -> None:
    """Publish ``body`` as deferred would (signed), but straight into ``queue``."""
    channel.basic_publish(
        "", queue, body, pika.BasicProperties(delivery_mode=2, headers=signed(body))
    )


def test_unknown_task_and_garbage_land_in_the_failed_queue(clean, raw_channel, run_worker, records):
    run_worker()
    ready = clean.ready_queues["default"].name
    unknown = Job(
        id=new_job_id(), task="no.such.task", args=(), kwargs={}, due=utcnow(), queue="default"
    )
    publish_raw(raw_channel, ready, unknown.encode())
    publish_raw(raw_channel, ready, b"\x00\xffnot json at all")
    publish_raw(raw_channel, ready, b'{"version": 1, "id": "x"}')
    defer(record, 0.1, records, "still-alive")
    assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 3, 10)
    by_reason = sorted(r["reason"] for r in failed_records(raw_channel, clean))
    assert by_reason == ["invalid", "undecodable", "unknown_task"]
    assert wait_for(lambda: len(read_records(records)) == 1, 5)


def test_a_job_delivered_early_waits_for_the_rest(clean, raw_channel, run_worker, records):
    # A message put straight into the ready queue before its due time (clock skew
    # between hosts, or a hand-made message) goes back to wait: never early.
    run_worker()
    due = utcnow().timestamp() + 0.4
    from datetime import UTC, datetime

    job = Job(
        id=new_job_id(),
        task=record.name,
        args=(records, "early"),
        kwargs={},
        due=datetime.fromtimestamp(due, UTC),
        queue="default",
    )
    publish_raw(raw_channel, clean.ready_queues["default"].name, job.encode())
    assert wait_for(lambda: len(read_records(records)) == 1, 5)
    assert read_records(records)[0]["at"] >= due


def test_long_task_keeps_heartbeats_alive(clean, broker_url, run_worker, records):
    # Heartbeat every 2 s; the task runs for six. If the I/O thread stopped
    # heart-beating, RabbitMQ would close the connection and redeliver the job.
    # (Not every second: one stall of a loaded host could miss two beats.)
    url = broker_url + ("&" if "?" in broker_url else "?") + "heartbeat=2"
    with override_settings(
        DEFERRED={"BROKER_URL": url, "PREFIX": clean.prefix, "QUEUES": ["default", "other"]}
    ):
        worker = run_worker()
        generation = worker.consumer.generation
        defer(sleepy, 0, records, "long", 6)
        assert wait_for(lambda: any(r["event"] == "end" for r in read_records(records)), 15)
        time.sleep(1.5)
        assert [r["event"] for r in read_records(records)] == ["start", "end"]
        assert worker.consumer.generation == generation, "the connection was lost"


def test_sigterm_mid_job_finishes_it_and_exits_0(clean, raw_channel, worker_process, records):
    worker = worker_process()
    defer(sleepy, 0, records, "term", 2)
    assert wait_for(lambda: read_records(records), 10)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.output()
    assert [r["event"] for r in read_records(records)] == ["start", "end"]
    assert "SIGTERM received" in worker.output()
    # It was acked: nothing is left to redeliver.
    assert depth(raw_channel, clean.ready_queues["default"].name) == 0


def test_sigint_stops_too(worker_process):
    worker = worker_process("--queue", "default")
    worker.signal(signal.SIGINT)
    assert worker.wait(30) == 0, worker.output()


def test_sigkill_mid_job_redelivers_it(clean, worker_process, records):
    first = worker_process()
    defer(sleepy, 0, records, "killed", 2)
    assert wait_for(lambda: read_records(records), 10)
    first.kill()
    worker_process()
    assert wait_for(
        lambda: [r["event"] for r in read_records(records)] == ["start", "start", "end"], 20
    ), read_records(records)


@pytest.mark.alone
def test_worker_reconnects_after_connections_are_closed(clean, run_worker, records):
    worker = run_worker(concurrency=2)
    generation = worker.consumer.generation
    start = time.time()
    # Due after rabbitmqctl has closed the connections (it takes a second or two
    # to start), so that they wait through the reconnect.
    for n in range(10):
        defer(record, 4.0 + n * 0.1, records, str(n))
    rabbitmqctl("close_all_connections", "test: the worker must reconnect")
    assert wait_for(
        lambda: worker.consumer.generation > generation and worker.consuming.is_set(), 30
    )
    # Pending delayed jobs still run, not early; and defer() reconnects too.
    defer(record, 0, records, "after")
    expected = {*(str(n) for n in range(10)), "after"}
    labels = lambda: [r["label"] for r in read_records(records)]  # noqa: E731
    assert wait_for(lambda: set(labels()) == expected, 30), read_records(records)
    # Each once, but for a job running at the very moment the connections
    # closed (at least once): no more than the concurrency, 2, ran again.
    assert labels().count("after") == 1
    assert len(labels()) - len(expected) <= 2, labels()
    for r in read_records(records):
        if r["label"] != "after":
            assert r["at"] >= start + 4.0 + int(r["label"]) * 0.1


def test_bad_command_line_options_are_refused():
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="nowhere"):
        call_command("run_deferred_worker", "--queue", "nowhere")
    with pytest.raises(CommandError):
        call_command("run_deferred_worker", "--concurrency", "0")


def test_close_old_connections_runs_around_each_job(clean, run_worker, records, monkeypatch):
    calls = []
    monkeypatch.setattr(
        "deferred.worker.pipeline.close_old_connections", lambda: calls.append(time.time())
    )
    run_worker()
    defer(record, 0, records, "db")
    assert wait_for(lambda: len(calls) >= 2, 5)
    ran = read_records(records)[0]["at"]
    assert calls[0] <= ran <= calls[1]


@pytest.fixture(params=["classic", "quorum"])
def typed_topology(request, clean, broker_url):
    """The session topology (classic), or a quorum one of the test's own, in force."""
    if request.param == "classic":
        yield clean
        return
    with override_settings(DEFERRED={**settings.DEFERRED, "QUEUE_TYPE": "quorum"}):
        with topology_of_its_own(broker_url) as plan:
            yield plan


def held(channel, plan, records: str, jobs: int) -> tuple[int, dict[str, int]] | None:
    """How many of ``jobs`` (all due, all deferred) the worker holds unacked, and how many
    still wait in each ready queue; ``None`` if a job started or ended meanwhile.

    A job neither waiting nor finished is one a worker took and has not acked.
    Passive declares count a quorum queue's waiting jobs at once, where
    ``rabbitmqctl list_queues`` shows counts a few seconds old.
    """
    before = read_records(records)
    waiting = {name: depth(channel, q.name) for name, q in plan.ready_queues.items()}
    if read_records(records) != before:
        return None
    finished = sum(1 for r in before if r["event"] in ("end", "ran"))
    return jobs - finished - sum(waiting.values()), waiting


def test_prefetch_caps_unacked_jobs_at_the_concurrency_across_queues(
    typed_topology, raw_channel, run_worker, records
):
    # Given a worker of concurrency 1 over two queues, both holding jobs
    run_worker(concurrency=1)
    for n in range(4):
        defer(sleepy, 0, records, f"d{n}", 1.0)
        sleepy.using(queue="other").defer(0, records, f"o{n}", 1.0)
    assert wait_for(lambda: read_records(records), 10)

    # Then, while both queues still hold jobs, it holds one of them, not one
    # per queue (a prefetch of 1 per queue would show 2)
    reads: list[int] = []
    deadline = time.monotonic() + 20
    while len(reads) < 5 and time.monotonic() < deadline:
        read = held(raw_channel, typed_topology, records, 8)
        if read is None:
            continue
        unacked, waiting = read
        if min(waiting.values()) == 0:
            break
        reads.append(unacked)
        time.sleep(0.2)
    assert len(reads) >= 2 and max(reads) == 1, reads


def test_with_a_slot_per_queue_the_busy_queue_takes_every_slot_and_the_idle_one_the_next(
    typed_topology, raw_channel, run_worker, records
):
    # Given a worker of concurrency 3 over two queues, and slow jobs in one of them
    run_worker(concurrency=3)
    for n in range(4):
        defer(sleepy, 0, records, f"d{n}", 2.0)
    assert wait_for(lambda: sum(r["event"] == "start" for r in read_records(records)) >= 3, 10)

    # When a job comes to the idle queue while they run
    record.using(queue="other").defer(0, records, "other")
    reads = [held(raw_channel, typed_topology, records, 5) for _ in range(3)]

    # Then the busy queue ran three at once, every slot, never more
    assert wait_for(lambda: sum(r["event"] == "end" for r in read_records(records)) == 4, 20)
    at = {(r["label"], r["event"]): r["at"] for r in read_records(records)}
    spans = [(at[(f"d{n}", "start")], at[(f"d{n}", "end")]) for n in range(4)]
    most = max(sum(1 for s, e in spans if s <= start < e) for start, _end in spans)
    assert most == 3, spans
    assert all(read is None or read[0] <= 3 for read in reads), reads
    # And the idle queue's job took one of the first slots that freed: it did not wait
    # for the busy queue to drain
    assert at[("other", "ran")] < at[("d3", "end")], read_records(records)


@pytest.mark.alone
def test_pending_jobs_survive_a_broker_restart(clean, run_worker, records):
    # stop_app/start_app: the broker goes away with jobs waiting in delay queues.
    # The delay leaves room for rabbitmqctl itself, which takes seconds to start
    # an Erlang VM on a loaded machine: the jobs must still be waiting when the
    # broker goes down, or the test proves nothing.
    delay = 20.0
    worker = run_worker()
    generation = worker.consumer.generation
    start = time.time()
    for n in range(5):
        defer(record, delay + n * 0.1, records, str(n))
    rabbitmqctl("stop_app")
    assert read_records(records) == [], "jobs ran before the broker stopped"
    rabbitmqctl("start_app")
    rabbitmqctl("await_startup")
    assert wait_for(lambda: len(read_records(records)) == 5, 90), read_records(records)
    at = {r["label"]: r["at"] for r in read_records(records)}
    assert all(at[str(n)] >= start + delay + n * 0.1 for n in range(5)), "ran early"
    assert wait_for(lambda: worker.consumer.generation > generation, 60)


def test_worker_recovers_when_its_ready_queue_is_deleted_and_declared_again(
    clean, raw_channel, run_worker, records
):
    from django.core.management import call_command

    worker = run_worker()
    generation = worker.consumer.generation
    raw_channel.queue_delete(clean.ready_queues["default"].name)
    assert wait_for(lambda: not worker.consuming.is_set(), 10), "the cancel went unnoticed"
    call_command("declare_delay_topology", verbosity=0)
    assert wait_for(lambda: worker.consuming.is_set(), 30)
    assert worker.consumer.generation > generation
    defer(record, 0.05, records, "after")
    assert wait_for(lambda: len(read_records(records)) == 1, 10)


@pytest.mark.alone
def test_the_health_file_is_fresh_while_consuming_and_gone_when_not(
    clean, worker_process, tmp_path
):
    health = tmp_path / "healthy"
    worker = worker_process("--health-file", str(health))
    assert wait_for(health.exists, 5), worker.output()
    first = health.stat().st_mtime
    assert wait_for(lambda: health.exists() and health.stat().st_mtime > first, 6)
    # The broker closes every connection: not consuming until the worker is back.
    rabbitmqctl("close_all_connections", "test: the health file goes with the connection")
    assert wait_for(lambda: not health.exists(), 10), worker.output()
    assert wait_for(health.exists, 30), worker.output()  # reconnected, consuming again
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert not health.exists()


def test_a_health_file_in_a_missing_directory_is_refused(clean, worker_process, tmp_path):
    worker = worker_process(
        "--health-file", str(tmp_path / "nowhere" / "healthy"), expect_exit=True
    )
    assert worker.wait() != 0
    assert "does not exist" in worker.output()


def child_pids(parent_pid: int) -> set[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(parent_pid)], capture_output=True, text=True
    ).stdout
    return {int(pid) for pid in out.split()}


def test_processes_run_jobs_restart_a_dead_child_and_stop_cleanly(
    clean, records, worker_process, tmp_path
):
    health = tmp_path / "healthy"
    worker = worker_process("--processes", "2", "--health-file", str(health))
    assert wait_for(lambda: worker.output().count("Worker consuming") == 2, 20), worker.output()
    children = child_pids(worker.proc.pid)
    assert len(children) == 2
    assert wait_for(health.exists, 10), worker.output()

    # Two slow jobs at once: each process takes one (prefetch 1 each).
    defer(sleepy, 0, records, "a", 1.0)
    defer(sleepy, 0, records, "b", 1.0)
    assert wait_for(lambda: len(read_records(records)) == 4, 15), worker.output()
    ran_in = {r["pid"] for r in read_records(records)}
    assert ran_in == children

    # A child dies: it is started again, and jobs still run.
    victim = sorted(children)[0]
    os.kill(victim, signal.SIGKILL)
    assert wait_for(lambda: "exited with signal SIGKILL" in worker.output(), 10), worker.output()
    assert wait_for(lambda: worker.output().count("Worker consuming") == 3, 30), worker.output()
    replaced = child_pids(worker.proc.pid)
    assert len(replaced) == 2 and victim not in replaced

    # SIGTERM to the parent: running jobs finish, every child exits, then the parent, with 0.
    defer(sleepy, 0, records, "last", 1.5)
    assert wait_for(
        lambda: any(r["label"] == "last" and r["event"] == "start" for r in read_records(records)),
        10,
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.output()
    assert [r["event"] for r in read_records(records) if r["label"] == "last"] == ["start", "end"]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in replaced)
    assert not health.exists()


def test_bad_processes_values_are_refused(clean, worker_process):
    for value in ("0", "-1", "many"):
        worker = worker_process("--processes", value, expect_exit=True)
        assert worker.wait() != 0
        assert "--processes" in worker.output()
    worker = worker_process("--processes", "2", "--queue", "nowhere", expect_exit=True)
    assert worker.wait() != 0
    assert "nowhere" in worker.output()


def test_a_stop_while_processes_are_still_starting_is_a_clean_exit(clean, worker_process):
    worker = worker_process("--processes", "2")  # returns once the first one consumes
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.output()
    assert "exited with" not in worker.output()


def test_a_health_file_left_by_a_killed_worker_is_removed_at_start(clean, worker_process, tmp_path):
    health = tmp_path / "healthy"
    health.write_text("left by a worker killed with SIGKILL")
    worker = worker_process("--health-file", str(health), "--queue", "nowhere", expect_exit=True)
    assert worker.wait() != 0
    assert not health.exists()


def test_a_tasks_info_logging_shows_with_timestamps_under_the_default_logging(
    clean, worker_process
):
    # Given a project with no LOGGING of its own
    worker = worker_process(env={"DJANGO_SETTINGS_MODULE": "tests.settings_plain"})
    marker = f"hello from a task {os.getpid()}"

    # When a task logs at INFO
    says.defer(0, marker)

    # Then its line shows in the worker's stderr, with a timestamp and its logger
    pattern = re.compile(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO tests\.says " + re.escape(marker) + "$",
        re.M,
    )
    assert wait_for(lambda: pattern.search(worker.output()), 15), worker.output()
    # And so does the worker's own line for the job, and none of pika's INFO lines
    assert re.search(r"^\S+ \S+ INFO deferred\.worker job=", worker.output(), re.M)
    assert " INFO pika" not in worker.output()


def test_a_worker_started_before_the_topology_says_so_in_one_short_line(tmp_path):
    # Given a worker whose topology was never declared
    log = tmp_path / "worker.log"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DEFERRED_TEST_PREFIX": f"never-declared-{os.getpid()}",
    }
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "run_deferred_worker"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            # When it has tried for a few seconds (reconnects after 0.5, 1 and 2 s)
            time.sleep(5)
        finally:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(30)

    # Then it said once what to do, in a short line, and nothing else went wrong
    lines = log.read_text().splitlines()
    said = [line for line in lines if "topology is not declared" in line]
    assert len(said) == 1, lines
    assert "declare_delay_topology" in said[0] and len(said[0]) < 200, said
    assert len(lines) <= 5 and all(len(line) < 200 for line in lines), lines
    assert code == 0
