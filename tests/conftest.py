"""Fixtures for tests against the real RabbitMQ.

The test settings give every run its own PREFIX, so these tests declare,
fill and finally delete their own topology and never touch anything else. If
RabbitMQ does not answer, the broker tests fail (they are never skipped).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pika
import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from deferred.broker import BrokerError, BrokerUnavailable, admin_channel, connect
from deferred.conf import get_settings
from deferred.core.topology import Plan, plan_topology, recorded_plan
from deferred.worker import Worker
from tests.cluster.nodes import Cluster, cluster_session

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Side by side (pytest-xdist, ``--dist loadfile``), the longest files come first:
    files go to the processes in this order, and a long file handed out last would
    leave the others idle at the end. How long each took last is in
    ``tests/file_seconds.json`` (``scripts/file-seconds.py`` writes it); a file it
    does not name counts as the median one. The order within a file stays as
    collected."""
    if getattr(config.option, "dist", "no") != "loadfile":
        return
    seconds: dict[str, int] = json.loads((ROOT / "tests" / "file_seconds.json").read_text())
    median = statistics.median(seconds.values())

    def took(item: pytest.Item) -> float:
        return seconds.get(item.path.relative_to(ROOT).as_posix(), median)

    items.sort(key=lambda item: -took(item))


@pytest.fixture(scope="session")
def broker_url() -> str:
    url = get_settings().broker_urls[0]
    try:
        connect(url).close()
    except BrokerUnavailable as exc:
        pytest.fail(f"RabbitMQ is required by this test and does not answer: {exc}")
    return url


def _every_plan(admin, plan: Plan) -> list[Plan]:
    plans = [plan]
    for record in admin.topology_records(plan):
        plans.append(recorded_plan(record, prefix=plan.prefix, queues=tuple(plan.ready_queues)))
    return plans


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[Cluster]:
    """The three-node cluster of scripts/local-cluster.sh, once per session (fails, never
    skips, if it cannot start); stopped and removed at the end if this session started it."""
    try:
        with cluster_session() as cluster:
            yield cluster
    except RuntimeError as exc:
        pytest.fail(f"The local RabbitMQ cluster is required by this test: {exc}")


@pytest.fixture(scope="session")
def topology(broker_url: str) -> Iterator[Plan]:
    """The current settings' topology, declared once for the session, deleted after."""
    call_command("declare_delay_topology", verbosity=0)
    plan = plan_topology(get_settings())
    yield plan
    remove_topologies(broker_url, plan)


@contextmanager
def topology_of_its_own(broker_url: str) -> Iterator[Plan]:
    """A topology under a PREFIX no other test uses while this block runs, in force
    (settings) until the block ends: declared, or taken from this process's spares.

    Declaring a topology and deleting it costs the broker about 2 CPU-seconds (122
    queues, 682 bindings), and a hundred tests ask for one: on a 2-core host that
    was a good part of a suite run. So a topology that a test leaves as it was
    declared goes back to the spares emptied (:func:`_emptied`), and the next test
    with the same settings takes it; anything a test left that emptying cannot undo
    gets it deleted instead, as before.
    """
    shape = _shape()
    spares = _SPARES.setdefault(shape, [])
    spare = spares.pop()[1] if spares else None
    prefix = spare.prefix if spare else f"{settings.DEFERRED['PREFIX']}-{uuid.uuid4().hex[:6]}"
    with override_settings(DEFERRED={**settings.DEFERRED, "PREFIX": prefix}):
        if spare is None:
            call_command("declare_delay_topology", verbosity=0)
        plan = plan_topology(get_settings())
        try:
            yield plan
        finally:
            if _emptied(broker_url, plan):
                spares.append((broker_url, plan))
            else:
                remove_topologies(broker_url, plan)


#: This process's spare topologies, by the other settings they were declared with
#: (:func:`_shape`). Deleted when the session ends (``_spare_topologies``).
_SPARES: dict[str, list[tuple[str, Plan]]] = {}


def _shape() -> str:
    """What a topology depends on besides its PREFIX: the rest of the settings in force."""
    return repr(sorted((k, repr(v)) for k, v in settings.DEFERRED.items() if k != "PREFIX"))


def _emptied(broker_url: str, plan: Plan) -> bool:
    """Empty ``plan`` for the next test, if it is as declared; whether it now is.

    Not when something emptying cannot undo is there: a consumer still attached
    (a worker the test left running), another topology or the legacy queues under
    the prefix, a queue declared with other arguments. What the test deleted or
    unbound is declared again. Streams cannot be emptied: they are deleted and
    declared anew. Any broker error: no (the caller deletes it all).
    """
    names = {queue.name for queue in plan.all_queues}
    legacy = [name for queues in plan.legacy_queues for name in queues.values()]
    streams = [q for q in plan.all_queues if q.arguments.get("x-queue-type") == "stream"]
    kept = [
        queue.name
        for queue in plan.all_queues
        if queue not in streams and queue.name != plan.registry_queue.name
    ]
    try:
        with admin_channel(broker_url) as admin:
            recorded = [record["topology"] for record in admin.topology_records(plan)]
            if recorded != [plan.topology_id] or any(
                name not in names and admin.queue_exists(name) for name in legacy
            ):
                return False
            for name in names:
                stats = admin.queue_stats(name)
                if stats is not None and stats.consumers:
                    return False
            for name in kept:
                if admin.queue_exists(name):
                    admin.channel.queue_purge(name)
            for stream in streams:
                admin.channel.queue_delete(stream.name)
            admin.declare(plan)
            # Nothing on its way between two queues when they were purged.
            return not any(admin.message_count(name) for name in kept)
    except BrokerError:
        return False


@pytest.fixture(scope="session", autouse=True)
def _spare_topologies() -> Iterator[None]:
    """Delete this process's spare topologies at the end of the session (none when no
    test used the broker)."""
    yield
    for spares in _SPARES.values():
        for url, plan in spares:
            remove_topologies(url, plan)
    _SPARES.clear()


def remove_topologies(broker_url: str, plan: Plan, tries: int = 10) -> None:
    """Delete ``plan`` and every older version of its PREFIX, messages included.

    RabbitMQ's stream coordinator is sometimes briefly unavailable (seen on
    3.10 under load: a stream delete closes the connection with
    ``coordinator_unavailable``); the clean-up tries again on a new connection.
    """
    for attempt in range(tries):
        try:
            with admin_channel(broker_url) as admin:
                for each in _every_plan(admin, plan):
                    admin.delete_everything(each)
            return
        except BrokerError as exc:
            if "coordinator_unavailable" not in str(exc) or attempt == tries - 1:
                raise
            time.sleep(1)


@pytest.fixture
def own_topology(broker_url: str) -> Iterator[Plan]:
    """A topology under a PREFIX of the test's own, deleted after the test.

    The session topology may still hold delayed jobs of earlier tests; a test
    that counts what waits where needs queues nobody else publishes to.
    """
    with topology_of_its_own(broker_url) as plan:
        yield plan


@pytest.fixture
def raw_channel(broker_url: str) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    """A plain pika channel, for inspecting and poking the broker directly."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    yield connection.channel()
    try:
        connection.close()
    except pika.exceptions.AMQPError:
        pass  # a test closed it on purpose


def depth(channel, queue: str) -> int:
    return channel.queue_declare(queue, passive=True).method.message_count


def total_waiting(channel, plan: Plan) -> int:
    """Messages anywhere in ``plan``: delay queues and ready queues."""
    queues = [q.name for q in plan.delay_queues] + [q.name for q in plan.ready_queues.values()]
    return sum(depth(channel, q) for q in queues)


@pytest.fixture
def clean(topology: Plan, raw_channel) -> Plan:
    """The session topology with its ready and failed queues emptied."""
    for queue in (*topology.ready_queues.values(), topology.failed_queue):
        raw_channel.queue_purge(queue.name)
    return topology


@pytest.fixture
def records(tmp_path: Path) -> str:
    """A file the test tasks append JSON lines to."""
    return str(tmp_path / "records.jsonl")


@pytest.fixture
def run_worker() -> Iterator[Callable[..., Worker]]:
    """Start in-process workers in threads; they are stopped at the end of the test."""
    started: list[tuple[Worker, threading.Thread]] = []

    def start(**kwargs) -> Worker:
        kwargs.setdefault("install_signal_handlers", False)
        worker = Worker(**kwargs)
        thread = threading.Thread(target=worker.run, name="test-worker", daemon=True)
        thread.start()
        assert worker.consuming.wait(10), "the worker did not start consuming"
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive(), "the worker did not stop"


def run_python(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``script`` in a new Python process of this project (the test settings, the
    current PREFIX), and return what it printed; its failure fails the test."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": str(ROOT),
            "DEFERRED_TEST_PREFIX": settings.DEFERRED["PREFIX"],
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


class WorkerProcess:
    """``manage.py run_deferred_worker`` as a real subprocess, for signals and kills."""

    def __init__(
        self,
        log: Path,
        *args: str,
        expect_exit: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log = log
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        with log.open("w") as stderr:  # the child keeps its own copy of the file
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "manage.py"), "run_deferred_worker", *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        try:
            started = wait_for(
                lambda: "Worker consuming" in self.output() or self.proc.poll() is not None, 20
            )
            assert started, self.output()
            if not expect_exit:
                assert self.proc.poll() is None, self.output()
        except BaseException:
            self.kill()  # a worker that did not start is not left running
            raise

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def worker_process(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    made: list[WorkerProcess] = []

    def start(
        *args: str, expect_exit: bool = False, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        process = WorkerProcess(
            tmp_path / f"worker-{len(made)}.log", *args, expect_exit=expect_exit, env=env
        )
        made.append(process)
        return process

    yield start
    for process in made:
        process.kill()


def rabbitmqctl(*args: str) -> str:
    return subprocess.run(
        ["rabbitmqctl", *args], check=True, capture_output=True, text=True, timeout=60
    ).stdout


def signed(body: bytes) -> dict:
    """The headers deferred would sign ``body`` with (for messages a test makes by hand)."""
    from deferred.conf import get_settings
    from deferred.core import signing

    return signing.sign(body, get_settings().signing_keys)


def record_job(path: str, label: str, **changes):
    """A job of ``tests.testapp.tasks.record``, due now, built by hand (not deferred)."""
    from deferred.core.jobs import Job, new_job_id, utcnow

    now = utcnow()
    fields = {
        "id": new_job_id(now),
        "task": "tests.testapp.tasks.record",
        "args": (path, label),
        "kwargs": {},
        "due": now,
        "queue": "default",
        "created": now,
        **changes,
    }
    return Job(**fields)


CHROMIUM = os.environ.get("DEFERRED_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DEFERRED_CHROMEDRIVER", "/usr/bin/chromedriver")


@pytest.fixture
def browser() -> Iterator:
    """Headless Chromium driven by Selenium, 1280 px wide; quit at the end of the test.

    Needs Debian's ``chromium`` and ``chromium-driver`` (``scripts/ensure-chromium.sh``
    installs them when run as root). Without them the test fails: it never skips.
    """
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            pytest.fail(
                f"{path} is missing: install Debian's chromium and chromium-driver "
                "(scripts/ensure-chromium.sh does it as root)."
            )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1280,1900")
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    except WebDriverException as exc:
        pytest.fail(f"Chromium does not start: {exc.msg}")
    driver.implicitly_wait(5)
    yield driver
    driver.quit()
