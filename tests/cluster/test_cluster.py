"""A RabbitMQ cluster whose nodes die: the local three-node cluster, real kills.

Every test declares a quorum topology of its own on the cluster of
``scripts/local-cluster.sh`` (started once per session) and kills or restarts
nodes under load. The figures are printed; the bounds asserted are the
contract: nothing lost, nothing early, few duplicates, a prompt failover.

RabbitMQ strands some at-least-once dead-letters after a leader change (see
``deferred.cluster.stuck``): where jobs are missing once they are due, the tests wait
for the stuck rule (STUCK_AFTER, 10 s here) and run ``deferred_repair``, as an
operator would, and report how many it released.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from deferred import broker, defer, defer_many
from deferred.broker import BrokerUnavailable
from deferred.cluster.repair import cli_dead_lettered
from deferred.conf import get_settings
from deferred.core.topology import plan_topology
from deferred.worker import Worker
from tests.cluster.nodes import (
    NODES,
    URLS,
    cluster_settings,
    node_number,
    quorum_topology,
    worker_env,
)
from tests.conftest import wait_for
from tests.testapp.tasks import read_records, timed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_cluster")]


def runs_by_label(path: str) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = defaultdict(list)
    for row in read_records(path):
        runs[row["label"]].append(row)
    return runs


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(len(ordered) * q) - 1)] if ordered else 0.0


def start_thread_worker(**kwargs) -> tuple[Worker, threading.Thread]:
    worker = Worker(install_signal_handlers=False, concurrency=8, **kwargs)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.consuming.wait(20), "the worker did not start consuming"
    return worker, thread


def stop_thread_worker(worker: Worker, thread: threading.Thread) -> None:
    worker.stop()
    thread.join(60)


def report(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\n{text}")


def status() -> dict:
    out = StringIO()
    call_command("deferred_status", "--json", stdout=out)
    return json.loads(out.getvalue())


def stuck_jobs(plan) -> int:
    """Dead-lettered messages in ``plan``'s delay queues, read by rabbitmqctl (no lag)."""
    counts = cli_dead_lettered("/", NODES[1]) or {}
    return sum(counts.get(q.name, 0) for q in plan.delay_queues)


def stranded_queues(plan) -> set[str]:
    """``plan``'s delay queues holding dead-lettered messages, read by rabbitmqctl."""
    counts = cli_dead_lettered("/", NODES[1]) or {}
    return {q.name for q in plan.delay_queues if counts.get(q.name, 0)}


def holding(plan) -> str:
    """Every queue of ``plan`` that holds messages, as rabbitmqctl sees it (no lag)."""
    listed = subprocess.run(
        [
            "rabbitmqctl",
            "-q",
            "-n",
            NODES[1],
            "list_queues",
            "name",
            "messages",
            "messages_ready",
            "messages_unacknowledged",
            "--no-table-headers",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return "; ".join(
        line
        for line in listed.splitlines()
        if line.startswith(plan.prefix + ".") and line.split()[1:2] != ["0"]
    )


def run_all(plan, path: str, expected: set[str], due_by: float) -> tuple[dict, set[str], str]:
    """Wait for every expected label to run; repair stuck dead-letters if some do not.

    Returns the runs, the labels that ran only after the repair, and what
    ``deferred_repair`` said (empty if it was not needed).
    """
    wait_for(lambda: expected <= set(runs_by_label(path)), due_by + 15 - time.time(), 0.5)
    missing = expected - set(runs_by_label(path))
    if not missing:
        return runs_by_label(path), set(), ""
    # The stuck rule needs STUCK_AFTER of samples in the management API, whose
    # figures lag a leader change by up to a minute: repair what it reports,
    # as an operator would, until every job ran (or three minutes passed).
    said = []
    give_up = time.monotonic() + 180
    while time.monotonic() < give_up and not expected <= set(runs_by_label(path)):
        if not wait_for(lambda: status()["cluster"]["stuck"], 60, interval=2):
            break
        out = StringIO()
        call_command("deferred_repair", "--wait", "60", stdout=out)
        said.append(out.getvalue().strip())
        wait_for(lambda: expected <= set(runs_by_label(path)), 20, 0.5)
    left = expected - set(runs_by_label(path))
    if left:
        said.append(
            f"{len(left)} still missing (e.g. {sorted(left)[:10]}); {stuck_jobs(plan)} "
            f"dead-lettered in delay queues; queues holding messages: {holding(plan)}"
        )
    return runs_by_label(path), missing, " / ".join(said)


def check_runs(runs: dict, due: dict[str, float], ids: dict[str, str] | None = None) -> int:
    """Nothing early, duplicates carry their job's id; the number of duplicated jobs."""
    for label, rows in runs.items():
        if label not in due:
            continue
        assert min(r["at"] for r in rows) >= due[label], f"job {label} ran early"
        assert len({r["job"] for r in rows}) == 1, f"a duplicate of {label} has another id"
        if ids is not None:
            assert rows[0]["job"] == ids[label]
    return sum(1 for label, rows in runs.items() if label in due and len(rows) > 1)


class Publisher:
    """Threads calling defer() at a steady rate (jobs a second), counting ids returned
    and errors raised; with ``batch`` > 1, defer_many() of that many jobs at a time."""

    def __init__(
        self,
        path: str,
        threads: int,
        rate: float,
        max_delay: float,
        *,
        batch: int = 1,
        label: str = "",
    ) -> None:
        self.path, self.rate, self.max_delay = path, rate, max_delay
        self.batch, self.label = batch, label
        self.returned: dict[str, str] = {}
        self.due: dict[str, float] = {}
        self.raised: list[BrokerUnavailable] = []
        self.other: list[BaseException] = []
        self._labels = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        pause = len(self._threads) * self.batch / self.rate
        while not self._stop.is_set():
            with self._lock:
                labels = [f"{self.label}{next(self._labels)}" for _ in range(self.batch)]
            delays = [random.uniform(0, self.max_delay) for _ in labels]
            started = time.time()
            try:
                if self.batch == 1:
                    ids = [defer(timed, delays[0], self.path, labels[0])]
                else:
                    calls = zip(delays, labels, strict=True)
                    ids = defer_many([(timed, d, (self.path, label)) for d, label in calls])
            except BrokerUnavailable as exc:
                with self._lock:
                    self.raised.append(exc)
            except BaseException as exc:  # noqa: BLE001 - counted, then asserted
                with self._lock:
                    self.other.append(exc)
            else:
                with self._lock:
                    for label, job_id, delay in zip(labels, ids, delays, strict=True):
                        self.returned[label] = job_id
                        self.due[label] = started + delay
            self._stop.wait(max(0.0, pause - (time.time() - started)))

    def __enter__(self) -> Publisher:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def test_a_node_killed_under_3000_pending_jobs_loses_none(
    local_cluster, tmp_path: Path, worker_process, capsys
):
    records = str(tmp_path / "runs.jsonl")
    with quorum_topology() as plan:
        delay_queues = [q.name for q in plan.delay_queues]
        leaders = local_cluster.leader_counts(plan.prefix, delay_queues)
        victim_name = max(NODES, key=lambda n: (leaders.get(n, 0), n))
        victim = node_number(victim_name)
        survivor = next(n for n in (1, 2, 3) if n != victim)
        # Given two workers on different nodes: one in this process, first on
        # the node to be killed (to time its failover), one subprocess on another
        order = [URLS[victim - 1], *(u for u in URLS if u != URLS[victim - 1])]
        other = [URLS[survivor - 1], *(u for u in URLS if u != URLS[survivor - 1])]
        worker_process("--concurrency", "8", env=worker_env(plan.prefix, other))
        with override_settings(DEFERRED={**settings.DEFERRED, "BROKER_URL": order}):
            worker, thread = start_thread_worker()
        try:
            assert worker.consumer.node is not None
            assert worker.consumer.node.url == URLS[victim - 1]
            # And 3,000 jobs due uniformly over the next 20 s
            rng = random.Random(9)
            delays = [rng.uniform(0, 20) for _ in range(3000)]
            started = time.time()
            for chunk in range(0, 3000, 500):
                batch = delays[chunk : chunk + 500]
                defer_many([(timed, d, (records, str(chunk + i))) for i, d in enumerate(batch)])
            due = {str(i): started + d for i, d in enumerate(delays)}
            pending = 3000 - len(runs_by_label(records))
            assert pending >= 2000, "fewer than 2,000 jobs pending at the kill"
            # When the node leading the most delay queues is killed, for 10 s
            killed_at = time.time()
            local_cluster.kill(victim)
            gap = None
            while time.time() < killed_at + 10:
                node = worker.consumer.node
                if gap is None and worker.consuming.is_set() and node and node.url != order[0]:
                    gap = time.time() - killed_at
                time.sleep(0.05)
            local_cluster.start(victim)
            back_after = time.time() - killed_at
            # Then every job runs (after deferred_repair, if some got stuck)
            runs, repaired, said = run_all(plan, records, set(due), max(due.values()))
        finally:
            stop_thread_worker(worker, thread)
    missing = set(due) - set(runs)
    assert not missing, f"{len(missing)} job(s) never ran; deferred_repair said: {said}"
    duplicates = check_runs(runs, due)
    first = {label: min(r["at"] for r in rows) for label, rows in runs.items()}
    late = [first[k] - due[k] for k in due if due[k] >= killed_at + 5 and k not in repaired]
    # (none when deferring the 3,000 jobs took most of their 20 s: a loaded host)
    p99 = percentile(late, 0.99) if late else 0.0
    lateness = (
        f"lateness p50 {statistics.median(late):.3f} s, p99 {p99:.3f} s" if late else "none due"
    )
    released = [first[k] - due[k] for k in repaired]
    report(
        capsys,
        f"cluster (a): 3000 jobs 0-20 s, {pending} pending at the SIGKILL of {victim_name} "
        f"(leader of {leaders.get(victim_name, 0)} of {len(delay_queues)} delay queues), back "
        f"after {back_after:.1f} s: 0 lost, 0 early, {duplicates} duplicate(s); worker failover "
        f"{'-' if gap is None else f'{gap:.2f} s'}; jobs due >= 5 s after the kill "
        f"({len(late)} not stuck): {lateness}; {len(repaired)} job(s) stuck until "
        "deferred_repair"
        + (f" (ran {min(released):.0f}-{max(released):.0f} s late)" if released else ""),
    )
    assert duplicates <= 30, f"{duplicates} duplicates (more than 1%)"
    assert gap is not None and gap <= 5, f"the worker took {gap} s to consume from another node"
    # Not grossly late: the figure belongs to the benchmark (bench/cluster.py). On
    # two cores shared by three nodes and the test it was 0.8-1.2 s on one machine and
    # 3.1-4.4 s on a slower one, where the killed node's restart alone held the cores
    # for 30-40 s; jobs held back for the whole 10-s outage would be later than this.
    assert p99 <= 8.0, f"p99 lateness {p99:.3f} s for jobs due 5 s or more after the kill"


def test_restarting_every_node_in_turn_under_50_jobs_a_second(
    local_cluster, tmp_path, worker_process, capsys
):
    records = str(tmp_path / "runs.jsonl")
    with quorum_topology() as plan:
        queues = [q.name for q in plan.all_queues]
        worker_process("--concurrency", "8", env=worker_env(plan.prefix, URLS[::-1]))
        # Given a steady 50 jobs a second, due within 3 s
        with Publisher(records, threads=2, rate=50, max_delay=3) as publisher:
            time.sleep(2)
            # When each node in turn is stopped and started again
            for node in (1, 2, 3):
                local_cluster.stop(node)
                local_cluster.start(node)
                local_cluster.wait_all_online(plan.prefix, queues)
        # Then every job whose defer() returned runs, none early
        runs, repaired, said = run_all(plan, records, set(publisher.due), time.time() + 3)
    assert not publisher.other, publisher.other[:3]
    missing = set(publisher.due) - set(runs)
    assert not missing, f"{len(missing)} job(s) never ran; deferred_repair said: {said}"
    duplicates = check_runs(runs, publisher.due, publisher.returned)
    report(
        capsys,
        f"cluster (b): 3 nodes restarted in turn under 50 jobs/s: {len(publisher.returned)} "
        f"jobs deferred, all ran, 0 early, {duplicates} duplicate(s); "
        f"{len(publisher.raised)} defer() raised BrokerUnavailable; {len(repaired)} job(s) "
        "stuck until deferred_repair",
    )
    for exc in publisher.raised:
        assert exc.job_id


def test_defer_from_4_threads_while_a_node_is_killed(
    local_cluster, tmp_path, worker_process, capsys
):
    records = str(tmp_path / "runs.jsonl")
    with quorum_topology() as plan:
        worker_process("--concurrency", "8", env=worker_env(plan.prefix, URLS[1:] + URLS[:1]))
        # (and defer_many() of 20 jobs from a fifth thread, 100 jobs a second)
        with (
            Publisher(records, threads=4, rate=100, max_delay=2) as publisher,
            Publisher(records, threads=1, rate=100, max_delay=2, batch=20, label="m") as many,
        ):
            try:
                time.sleep(2)
                # Node 1 is every publisher's first node.
                local_cluster.kill(1)
                time.sleep(6)
            finally:
                local_cluster.start(1)
        due = {**publisher.due, **many.due}
        runs, repaired, said = run_all(plan, records, set(due), time.time() + 2)
    # Every call returned ids or raised BrokerUnavailable (PublishRefused among them)
    assert not publisher.other, publisher.other[:3]
    assert not many.other, many.other[:3]
    missing = set(due) - set(runs)
    assert not missing, f"{len(missing)} job(s) never ran; deferred_repair said: {said}"
    check_runs(runs, due, {**publisher.returned, **many.returned})
    for exc in publisher.raised:
        assert exc.job_id, "BrokerUnavailable without the job's id"
    for exc in many.raised:
        assert len(exc.job_ids) == 20, "defer_many()'s error without the batch's ids"
    assert len(many.returned) >= 200, "defer_many() hardly ever returned across the kill"
    report(
        capsys,
        f"cluster (c): defer() from 4 threads across a SIGKILL of {NODES[0]}: "
        f"{len(publisher.returned)} returned an id (all ran, "
        f"{len(repaired & set(publisher.due))} after deferred_repair), "
        f"{len(publisher.raised)} raised BrokerUnavailable; defer_many() of 20: "
        f"{len(many.returned) // 20} batches returned (all ran, "
        f"{len(repaired & set(many.due))} jobs after deferred_repair), "
        f"{len(many.raised)} raised; errors: "
        f"{sorted({str(e)[:90] for e in publisher.raised + many.raised})}",
    )


def test_first_node_down_from_the_start(local_cluster, tmp_path, capsys):
    records = str(tmp_path / "runs.jsonl")
    with quorum_topology():
        local_cluster.kill(1)
        try:
            # As in a fresh process: no connection yet, node 1 (first in the list) down.
            broker.failover._first.clear()
            broker._publisher.cache_clear()
            started = time.monotonic()
            job_id = defer(timed, 0, records, "first")
            defer_took = time.monotonic() - started
            started = time.monotonic()
            worker, thread = start_thread_worker()
            consume_took = time.monotonic() - started
            try:
                assert wait_for(lambda: "first" in runs_by_label(records), 15)
                assert worker.consumer.node is not None and worker.consumer.node.url != URLS[0]
            finally:
                stop_thread_worker(worker, thread)
        finally:
            local_cluster.start(1)
    assert runs_by_label(records)["first"][0]["job"] == job_id
    report(
        capsys,
        f"cluster (d): first URL down: defer() returned in {defer_took:.2f} s, the worker "
        f"consumed after {consume_took:.2f} s",
    )
    assert defer_took < 5 and consume_took < 10


def test_stuck_dead_letters_are_reported_and_deferred_repair_releases_them(
    local_cluster, tmp_path, worker_process, capsys
):
    records = str(tmp_path / "runs.jsonl")
    with quorum_topology() as plan:
        worker_process("--concurrency", "8", env=worker_env(plan.prefix, URLS[1:] + URLS[:1]))
        # Given dead-letters stranded by a leader change: kill a node under load
        # until some are (most kills strand some, here)
        # (counted once, when seen: RabbitMQ may forward them itself a moment
        # later, which the released_by_rabbitmq() branch below covers; 4.3 does so
        # within seconds, so they are looked for from the restart on, not once at
        # its end: a single look 3 s after it saw none in 4 kills once)
        kills = 0
        stuck_before = 0
        with Publisher(records, threads=4, rate=100, max_delay=2) as publisher:
            while kills < 6 and not stuck_before:
                kills += 1
                time.sleep(2)
                local_cluster.kill(1)
                time.sleep(4)
                local_cluster.start(1)
                looking_until = time.monotonic() + 5
                while not stuck_before and time.monotonic() < looking_until:
                    stuck_before = stuck_jobs(plan)
        assert stuck_before, f"no dead-letter got stuck in {kills} kills"

        stranded_at = time.monotonic()

        # When the stuck rule has had its STUCK_AFTER for every queue with some
        # (a queue whose dead-letters were stranded later is not stuck yet:
        # deferred_repair leaves it, and the test would wait for it in vain),
        # unless RabbitMQ forwards them itself first: on 4.3 it does (that
        # release's closing note has the figures), on 3.10 rarely.
        def all_reported() -> bool:
            reported = {s["queue"] for s in status()["cluster"]["stuck"]}
            return bool(reported) and stranded_queues(plan) <= reported

        def released_by_rabbitmq() -> bool:
            return not stranded_queues(plan) and not status()["cluster"]["stuck"]

        assert wait_for(lambda: all_reported() or released_by_rabbitmq(), 90, interval=2), (
            stranded_queues(plan),
            status()["cluster"]["stuck"],
        )
        if released_by_rabbitmq():
            # Then every job still runs, none early, none lost, without a repair
            released_after = time.monotonic() - stranded_at
            assert wait_for(lambda: set(publisher.due) <= set(runs_by_label(records)), 60, 0.5)
            runs = runs_by_label(records)
            check_runs(runs, publisher.due, publisher.returned)
            report(
                capsys,
                f"cluster (e): {kills} kill(s) stranded {stuck_before} dead-letter(s); RabbitMQ "
                f"forwarded them itself within {released_after:.0f} s, before they counted as "
                "stuck: 0 lost, no repair needed",
            )
            return
        reported = status()["cluster"]["stuck"]
        text = StringIO()
        call_command("deferred_status", stdout=text)
        assert "STUCK:" in text.getvalue() and "deferred_repair" in text.getvalue()
        missing_before = set(publisher.due) - set(runs_by_label(records))
        # Then deferred_repair releases every one of them
        out = StringIO()
        call_command("deferred_repair", "--wait", "60", stdout=out)
        assert "new leader elected" in out.getvalue(), out.getvalue()
        assert wait_for(lambda: stuck_jobs(plan) == 0, 30), (
            f"{stuck_jobs(plan)} still stuck: {holding(plan)}\n{out.getvalue()}\n"
            f"reported before the repair: {reported}\nnow: {status()['cluster']['stuck']}"
        )
        assert wait_for(lambda: set(publisher.due) <= set(runs_by_label(records)), 60, 0.5)
    runs = runs_by_label(records)
    check_runs(runs, publisher.due, publisher.returned)
    report(
        capsys,
        f"cluster (e): {kills} kill(s) stranded {stuck_before} dead-letter(s) in "
        f"{len(reported)} queue(s) ({len(missing_before)} job(s) not run); deferred_status "
        "reported them; deferred_repair released all: 0 lost\n" + out.getvalue().strip(),
    )


def test_a_worker_waits_out_the_node_of_its_classic_queues_with_declare_off(local_cluster):
    # Given classic queues (not replicated), declared through node 3, so they
    # live there, and a worker that may not declare anything
    prefix = f"deferred-classic-{uuid.uuid4().hex[:6]}"
    order = [URLS[2], URLS[0], URLS[1]]
    classic = cluster_settings(prefix, QUEUE_TYPE="classic", BROKER_URL=order)
    with override_settings(DEFERRED=classic):
        call_command("declare_delay_topology", verbosity=0, stderr=StringIO())
        plan = plan_topology(get_settings())
    try:
        local_cluster.kill(3)
        try:
            # When their node is down, the queues exist but cannot be reached:
            # not "topology missing" (which would stop a DECLARE=False worker)
            survivors = cluster_settings(prefix, QUEUE_TYPE="classic", DECLARE=False)
            with override_settings(DEFERRED=survivors):
                with pytest.raises(BrokerUnavailable, match="node holding it is down"):
                    broker.verify_topology(URLS, plan)
                worker = Worker(install_signal_handlers=False)
                thread = threading.Thread(target=worker.run, daemon=True)
                thread.start()
                time.sleep(3)
                assert thread.is_alive() and not worker.consuming.is_set()
        finally:
            local_cluster.start(3)
        # Then the worker consumes once the node is back
        try:
            assert worker.consuming.wait(60), "the worker did not consume after the node came back"
        finally:
            stop_thread_worker(worker, thread)
    finally:
        with broker.admin_channel(URLS) as admin:
            admin.delete_everything(plan)


def test_the_ledger_lists_and_moves_every_pending_job_with_a_node_killed(local_cluster):
    import deferred
    from deferred.records import checkpoints

    with quorum_topology() as plan:
        assert plan.ledger_queue is not None
        # Within the cluster settings' MAX_DELAY (60 s); no worker runs them.
        first = defer_many([(timed, 30 + i * 0.05, ("/dev/null", str(i))) for i in range(200)])
        checkpoints.write(get_settings(), timeout=60)
        later = defer_many([(timed, 45 + i * 0.05, ("/dev/null", f"l{i}")) for i in range(50)])
        expected = [*first, *later]
        leaders = local_cluster.leader_counts(plan.prefix, [plan.ledger_queue.name])
        victim = node_number(max(leaders, key=leaders.__getitem__)) if leaders else 1

        def listed() -> list[str] | None:
            try:
                return [job.id for job in deferred.pending(limit=None, timeout=10)]
            except deferred.BrokerError:
                return None  # the streams' new leaders not elected yet

        assert listed() == expected
        # When the node leading the ledger is killed, every pending job is still listed
        # (a reader fails over to another node, a stream elects a new leader),
        local_cluster.kill(victim)
        try:
            assert wait_for(lambda: listed() == expected, 60), listed()
            # and a job can be moved: it is listed at its new time, once.
            assert wait_for(lambda: _moved(deferred, first[0]), 60)
            again = listed()
            assert again is not None and again[-1] == first[0] and len(again) == len(expected)
        finally:
            local_cluster.start(victim)


def _moved(deferred_module, job_id: str) -> bool:
    try:
        deferred_module.reschedule(job_id, 59)
    except deferred_module.BrokerError:
        return False
    return True
