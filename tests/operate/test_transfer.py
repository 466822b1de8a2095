"""``deferred_transfer`` against real brokers: from the system's RabbitMQ 3.10 (BROKER_URL) to
RabbitMQ 4.3 beside it (scripts/rabbitmq-release.sh), with jobs still pending.

Each test has a PREFIX of its own, declared on the old broker and removed from both
brokers afterwards. The 4.3 node is started for the session when it does not run
already, and stopped again at the end only if the session started it; a session that
cannot start it fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pika
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

import deferred
from deferred import cancel, defer, defer_many
from deferred.broker import BrokerUnavailable, admin_channel, answers, peek, send_record
from deferred.broker.transfer import Drain, Staging
from deferred.conf import get_settings
from deferred.core.jobs import Job, new_job_id, utcnow
from deferred.core.topology import Plan, plan_topology
from deferred.operate.transfer import Transfer
from deferred.operate.transfer_plan import staging_plan
from deferred.records import failures
from deferred.records.schedules import Command, Entry, Records
from deferred.worker import Worker
from tests.conftest import ROOT, signed, wait_for
from tests.testapp.tasks import read_records, timed

RELEASE = ROOT / "scripts" / "rabbitmq-release.sh"
#: The 4.3 node that `scripts/rabbitmq-release.sh 4.3 start` runs beside the system broker.
NEW_URL = "amqp://guest:guest@127.0.0.1:5643/%2F"


# --------------------------------------------------------------------------- the new broker


@pytest.fixture(scope="session")
def new_broker() -> Iterator[str]:
    """RabbitMQ 4.3 on 127.0.0.1:5643, left as it was found.

    Inside `scripts/rabbitmq-release.sh VERSION run -- ...` (a network namespace of
    its own) the node starts in a PID namespace of its own, with a folder of its own,
    and goes when that namespace's first process is killed: the script's `stop` there
    would look for the node by name and folder, and the test's node must never be
    confused with another.
    """
    if answers(NEW_URL):
        yield NEW_URL
        return
    if os.environ.get("DEFERRED_RABBITMQ_RELEASE"):
        with _private_node() as url:
            yield url
        return
    started = subprocess.run(
        ["bash", str(RELEASE), "4.3", "start"], capture_output=True, text=True, timeout=600
    )
    try:
        if started.returncode != 0 or not wait_for(lambda: answers(NEW_URL), 30, 0.5):
            pytest.fail(
                f"RabbitMQ 4.3 is required by these tests and did not start:\n"
                f"{started.stdout}\n{started.stderr}"
            )
        yield NEW_URL
    finally:
        subprocess.run(["bash", str(RELEASE), "4.3", "stop"], capture_output=True, timeout=120)


@contextmanager
def _private_node() -> Iterator[str]:
    # Not a private /tmp (a tmpfs over it): the checkout itself may live under /tmp, as
    # scripts/test-wheel.sh's clone does, and the script would vanish. The node's folder
    # goes under /tmp, which the release's chroot binds in.
    folder = Path(tempfile.mkdtemp(prefix="deferred-transfer-", dir="/tmp"))
    folder.chmod(0o755)
    log = folder / "start.log"
    script = '"$0" 4.3 start && exec sleep infinity'
    with log.open("w") as out:
        unshare = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--", "bash", "-c", script, RELEASE],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "DEFERRED_RABBITMQ_RUN_DIR": str(folder)},
        )
    try:
        if not wait_for(lambda: answers(NEW_URL) or unshare.poll() is not None, 600, 0.5):
            pytest.fail(f"RabbitMQ 4.3 did not start in its namespace:\n{log.read_text()}")
        if unshare.poll() is not None:
            pytest.fail(
                "RabbitMQ 4.3 could not start in its namespace (there is no network there: "
                f"run `scripts/rabbitmq-release.sh 4.3 setup` before):\n{log.read_text()}"
            )
        yield NEW_URL
    finally:
        # The namespace's first process is unshare's only child: killing it ends them all.
        children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
        for pid in children.read_text().split() if children.exists() else ():
            os.kill(int(pid), signal.SIGKILL)
        unshare.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------- topologies


def remove(url: str, plan: Plan) -> None:
    """Everything of ``plan`` and of its transfer on the broker at ``url``."""
    staging = staging_plan(plan)
    with admin_channel(url) as admin:
        admin.delete_everything(plan)
        channel = admin.channel._impl
        channel.queue_delete(staging.queue.name)
        channel.exchange_delete(staging.exchange)
        channel.exchange_delete(staging.out)
        admin.channel.basic_qos(prefetch_count=0)


@pytest.fixture
def moving(broker_url: str, new_broker: str) -> Iterator[Plan]:
    """A PREFIX of the test's own, in force and declared on the old broker; removed from
    both brokers after the test."""
    prefix = f"{settings.DEFERRED['PREFIX']}-{uuid.uuid4().hex[:6]}"
    with override_settings(DEFERRED={**settings.DEFERRED, "PREFIX": prefix}):
        call_command("declare_delay_topology", verbosity=0)
        plan = plan_topology(get_settings())
        try:
            yield plan
        finally:
            remove(broker_url, plan)
            remove(new_broker, plan)


@contextmanager
def on_new_broker(**changes: Any) -> Iterator[None]:
    """The settings in force, with the new broker as BROKER_URL."""
    with override_settings(DEFERRED={**settings.DEFERRED, "BROKER_URL": NEW_URL, **changes}):
        yield


@contextmanager
def worker_on_new_broker(**kwargs: Any) -> Iterator[Worker]:
    with on_new_broker():
        worker = Worker(install_signal_handlers=False, **kwargs)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        assert worker.consuming.wait(20), "the worker on the new broker did not start"
        try:
            yield worker
        finally:
            worker.stop()
            thread.join(30)


def transfer(*args: str) -> str:
    out = StringIO()
    call_command("deferred_transfer", "--to", NEW_URL, *args, stdout=out)
    return out.getvalue()


def pending_ids(url: str, plan: Plan) -> list[str]:
    """The job ids of every message waiting in ``plan``'s delay and ready queues at ``url``.

    Read by taking them all at once and handing them back: a message held cannot move on,
    so none is read twice (the jobs of these tests wait long enough not to move meanwhile).
    """
    queues = [q.name for q in plan.delay_queues] + [q.name for q in plan.ready_queues.values()]
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        ids = []
        for queue in queues:
            while True:
                method, props, _body = channel.basic_get(queue)
                if method is None:
                    break
                ids.append(props.message_id)
        return ids
    finally:
        connection.close()


def count(url: str, *queues: str) -> int:
    with admin_channel(url) as admin:
        return sum(admin.message_count(q) or 0 for q in queues)


def publish_raw(exchange: str, routing_key: str, job: Job, **headers: Any) -> None:
    body = job.encode()
    connection = pika.BlockingConnection(pika.URLParameters(get_settings().broker_url))
    channel = connection.channel()
    channel.confirm_delivery()
    channel.basic_publish(
        exchange,
        routing_key,
        body,
        pika.BasicProperties(
            delivery_mode=2, message_id=job.id, headers={**headers, **signed(body)}
        ),
        mandatory=True,
    )
    connection.close()


def a_job(label: str, queue: str = "default", path: str = "/dev/null") -> Job:
    now = utcnow()
    return Job(new_job_id(now), "tests.timed", (path, label), {}, now, queue)


# --------------------------------------------------------------------------- the tests


def test_pending_failed_and_cancelled_jobs_move_and_each_runs_once_on_time(
    moving: Plan, records: str
) -> None:
    plan = moving
    # Given the topology declared on the new broker beforehand (the transfer checks it then),
    with on_new_broker():
        call_command("declare_delay_topology", verbosity=0)
    # and, on the old broker with no worker: jobs due in 4 to 12 s, one due now
    # (waiting in a ready queue), one cancelled, a failure record, a job the broker
    # put in the failed queue past its delivery limit, and a job for a queue these
    # settings do not have.
    pending = defer_many([(timed, 4 + n * 0.4, (records, f"later-{n}")) for n in range(20)])
    due_now = defer(timed, 0, records, "now")
    gone = defer(timed, 5, records, "cancelled")
    cancel(gone)
    broken = a_job("failed-record")
    failures.store_failure(
        get_settings(),
        failures.failure_record(
            reason=failures.TASK_ERROR, job=broken, body=broken.encode(), error=RuntimeError("x")
        ),
    )
    bare = a_job("delivery-limit")
    death = {"reason": "delivery_limit", "queue": plan.ready_queues["default"].name, "count": 1}
    publish_raw("", plan.failed_queue.name, bare, **{"x-death": [death]})
    lost = a_job("no-such-queue", queue="gone")
    publish_raw(plan.ingest_exchange, plan.routing_key(60_000, "gone"), lost)

    # When the transfer runs,
    output = transfer()
    finished = time.time()

    # then everything left the old broker,
    assert "Moved 22 pending jobs and 2 failed jobs" in output, output
    assert "1 job for a queue not in DEFERRED['QUEUES']" in output
    assert "Cancels: 1 record copied" in output
    everything = [q.name for q in (*plan.delay_queues, *plan.ready_queues.values())]
    assert count(get_settings().broker_url, *everything, plan.failed_queue.name) == 0
    # the failed entries are on the new broker, with their reason,
    with on_new_broker():
        entries = {e.id: e for e in failures.list_failed(get_settings())}
    assert set(entries) == {broken.id, bare.id, lost.id}
    assert entries[broken.id].reason == failures.TASK_ERROR
    with admin_channel(NEW_URL) as admin, admin.take_all(plan.failed_queue.name) as (_, taken):
        reasons = {t.message_id: t.headers.get(failures.REASON_HEADER) for t in taken}
    assert reasons[bare.id] == failures.DELIVERY_LIMIT
    # the new broker's ledger lists exactly the jobs that wait there (not the cancelled one),
    with on_new_broker():
        listed = [job.id for job in deferred.pending(limit=None)]
    assert sorted(listed) == sorted([*pending, due_now])
    # and a worker on the new broker runs each job once, never before its due time,
    # and not the cancelled one.
    with worker_on_new_broker(concurrency=4) as worker:
        assert wait_for(lambda: len(read_records(records)) >= 21, 20)
        assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 5)
        time.sleep(0.3)
    ran = read_records(records)
    assert sorted(r["job"] for r in ran) == sorted([*pending, due_now])
    assert all(r["at"] >= r["due"] for r in ran), [r["at"] - r["due"] for r in ran]
    # Those due after the transfer waited their own time there, not more than a little.
    waited = [r["at"] - r["due"] for r in ran if r["due"] > finished + 0.5]
    assert waited, "the transfer took so long that every job was due when it ended"
    assert max(waited) < 3.0, waited
    # Run again, the transfer finds nothing to move, and doubles no failed job.
    again = transfer()
    assert "Moved 0 pending jobs and 0 failed jobs" in again, again
    assert count(NEW_URL, plan.failed_queue.name) == 3


def test_the_old_schedulers_record_goes_unless_the_new_broker_has_one(moving: Plan) -> None:
    # Given the record of a scheduler that stopped on the old broker (one schedule,
    # paused) and a command it never applied,
    planned = utcnow() + timedelta(seconds=5)
    record = Records(
        seq=7, entries={"tests.tick": Entry(planned=planned, paused=True)}, leader="old:1"
    ).encode()
    command = Command("run", "tests.tick", uuid.uuid4().hex, utcnow()).encode()
    queue = moving.schedules_queue.name
    for body in (record, command):
        send_record(get_settings().broker_urls, queue, body, headers=signed(body))
    # when the transfer runs,
    output = transfer()
    # then the new broker has the record (its first scheduler goes on from it), not the command,
    assert "record (1 schedule; paused: tests.tick) was copied" in output, output
    assert "1 schedule command sent to the old broker was never applied" in output
    assert [body for body, _ in peek(NEW_URL, queue)] == [record]
    # and a transfer run again leaves the record the new broker has as it is.
    assert "has a record of its own already" in transfer()
    assert [body for body, _ in peek(NEW_URL, queue)] == [record]


class Crash(BaseException):
    """Stands for the process dying: nothing after it runs but the closing of connections."""


def crash_on(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, call: int) -> None:
    """Make ``cls.name`` raise ``Crash`` on its ``call``-th call instead of running."""
    original = getattr(cls, name)
    calls = []

    def crashing(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == call:
            raise Crash(f"{cls.__name__}.{name} #{call}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, crashing)


def run_transfer(batch: int = 50) -> Transfer:
    mover = Transfer(get_settings(), source=get_settings().broker_urls, target=NEW_URL, batch=batch)
    mover.run()
    return mover


def lose_connection(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, call: int) -> None:
    """Cut the connection under ``cls.name`` on its ``call``-th call, as a network would."""
    original = getattr(cls, name)
    calls = []

    def cut(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == call:
            impl = self.side.connection._impl
            impl._terminate_stream(ConnectionResetError("the test cut the connection"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, cut)


@pytest.mark.parametrize(
    "where",
    [
        # The target confirmed the staged batch; the source never saw the ack.
        "crash before the source ack",
        # The source took the acks (proven); the staged copies never moved.
        "crash after the source ack",
        # The rerun dies while moving what the first run left staged.
        "crash while moving what a crash left",
        "lost connection to the new broker while moving",
        "lost connection to the old broker while acking",
    ],
)
def test_a_transfer_that_dies_anywhere_and_runs_again_moves_each_job_once(
    moving: Plan, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    plan = moving
    # Given 400 jobs due in minutes on the old broker,
    deferred = defer_many([(timed, 300 + n % 60, ("/dev/null", f"j{n}")) for n in range(400)])
    # when a transfer dies at that point of its third batch, and is run again,
    with monkeypatch.context() as patched:
        if where == "crash before the source ack":
            crash_on(patched, Drain, "settle", 3)
        elif where == "crash after the source ack":
            crash_on(patched, Staging, "move", 3)
        elif where.startswith("lost connection to the new"):
            lose_connection(patched, Staging, "move", 3)
        elif where.startswith("lost connection to the old"):
            lose_connection(patched, Drain, "settle", 3)
        else:
            crash_on(patched, Drain, "settle", 3)
        with pytest.raises((Crash, BrokerUnavailable)):
            run_transfer()
    if where == "crash while moving what a crash left":
        with monkeypatch.context() as patched:
            crash_on(patched, Staging, "drop", 1)
            with pytest.raises(Crash):
                run_transfer()
    # (the interrupted run left staged copies behind)
    assert count(NEW_URL, staging_plan(plan).queue.name) > 0
    mover = run_transfer()
    # then the new broker holds every job once, and the old one none.
    assert sorted(pending_ids(NEW_URL, plan)) == sorted(deferred)
    assert pending_ids(get_settings().broker_url, plan) == []
    assert mover.progress.resumed > 0


@pytest.mark.slow
def test_killed_and_stopped_transfers_run_again_move_every_job_once(
    moving: Plan, tmp_path: Path
) -> None:
    plan = moving
    # Given 3,000 jobs due in minutes on the old broker,
    deferred = defer_many([(timed, 300 + n % 100, ("/dev/null", f"j{n}")) for n in range(3000)])
    staging = staging_plan(plan).queue.name

    def moved() -> int:
        try:
            return count(NEW_URL, *(q.name for q in plan.delay_queues), staging)
        except BrokerUnavailable:
            return 0

    # when a transfer process is killed (SIGKILL) part way,
    first = transfer_process(tmp_path / "first.log", plan)
    assert wait_for(lambda: moved() >= 300 or first.poll() is not None, 60, 0.02)
    first.kill()
    assert first.wait(10) == -signal.SIGKILL
    after_kill = moved()
    # and the next one is stopped (SIGTERM) part way,
    second = transfer_process(tmp_path / "second.log", plan)
    assert wait_for(lambda: moved() >= after_kill + 600 or second.poll() is not None, 60, 0.02)
    second.send_signal(signal.SIGTERM)
    assert second.wait(30) == 1, (tmp_path / "second.log").read_text()
    assert "Interrupted" in (tmp_path / "second.log").read_text()
    assert moved() < len(deferred), "the transfers were not interrupted part way"
    # and a third one runs to the end,
    third = transfer_process(tmp_path / "third.log", plan)
    assert third.wait(120) == 0, (tmp_path / "third.log").read_text()
    # then every job is on the new broker once, and none is left on the old one.
    ids = pending_ids(NEW_URL, plan)
    assert len(ids) == len(set(ids)) == len(deferred)
    assert set(ids) == set(deferred)
    assert pending_ids(get_settings().broker_url, plan) == []


def transfer_process(log: Path, plan: Plan) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": str(ROOT),
        "DEFERRED_TEST_PREFIX": plan.prefix,
    }
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "manage.py", "deferred_transfer", "--to", NEW_URL, "--batch", "50"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


# --------------------------------------------------------------------------- refusals


def refused(*args: str) -> str:
    with pytest.raises(CommandError) as error:
        call_command("deferred_transfer", *args, stdout=StringIO(), stderr=StringIO())
    return str(error.value)


def test_a_url_that_is_not_amqp_is_refused() -> None:
    assert "not an amqp:// or amqps:// URL" in refused("--to", "http://127.0.0.1:5643/")


def test_an_unreachable_broker_is_refused(moving: Plan) -> None:
    message = refused("--to", "amqp://guest:guest@127.0.0.1:1/%2F")
    assert "Cannot connect to RabbitMQ at 127.0.0.1:1/" in message
    assert "guest:guest" not in message


def test_the_same_broker_under_another_name_is_refused(moving: Plan) -> None:
    same = get_settings().broker_url.replace("127.0.0.1", "localhost")
    assert "are the same" in refused("--to", same)


def test_a_source_without_the_topology_is_refused(broker_url: str, new_broker: str) -> None:
    prefix = f"{settings.DEFERRED['PREFIX']}-never-{uuid.uuid4().hex[:6]}"
    with override_settings(DEFERRED={**settings.DEFERRED, "PREFIX": prefix}):
        message = refused("--to", NEW_URL)
    assert "The old broker at 127.0.0.1:5672/ lacks" in message
    assert f"under PREFIX {prefix!r}" in message and "was it ever declared there?" in message


def test_a_new_broker_with_another_topology_under_the_prefix_is_refused(moving: Plan) -> None:
    with on_new_broker(QUEUE_TYPE="quorum"):
        call_command("declare_delay_topology", verbosity=0)
        quorum = plan_topology(get_settings())
    try:
        message = refused("--to", NEW_URL)
    finally:
        remove(NEW_URL, quorum)
    assert f"has topology {quorum.topology_id}" in message
    assert f"these settings make {moving.topology_id}" in message


def test_workers_still_consuming_the_old_broker_are_refused(moving: Plan, run_worker) -> None:
    run_worker(concurrency=4)
    message = refused("--to", NEW_URL)
    assert "have consumers" in message and "Stop the old broker's workers first" in message
    assert moving.ready_queues["default"].name in message
