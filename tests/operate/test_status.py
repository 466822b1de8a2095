"""deferred_status: the arithmetic without a broker, then the command against RabbitMQ."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import override_settings

from deferred import defer
from deferred.broker import QueueStats
from deferred.broker.http_api import ManagementAPI
from deferred.conf import _build, get_settings
from deferred.core.topology import Plan, build_plan
from deferred.operate import status, status_text
from tests.conftest import ROOT, depth, wait_for
from tests.testapp.tasks import explode, record


def small_plan(radix: int = 4, levels: int = 3, resolution_ms: int = 10) -> Plan:
    return build_plan(
        prefix="p",
        radix=radix,
        resolution_ms=resolution_ms,
        max_delay_ms=(radix**levels - 1) * resolution_ms,
        queue_type="classic",
        queues=["default", "other"],
    )


def first_queue(plan: Plan, delay_ms: int) -> str:
    """The delay queue a job of ``delay_ms`` enters first: its highest non-zero digit."""
    digits = plan.digits(plan.units(delay_ms))
    index = next(i for i, d in enumerate(digits) if d)
    level = plan.levels - 1 - index
    return f"{plan.ingest_exchange.removesuffix('.ingest')}.L{level:02d}.d{digits[index]:02d}"


# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize("radix", [2, 4, 16])
def test_longest_wait_is_the_tightest_bound_for_every_delay(radix: int) -> None:
    # Given every delay a small topology can hold, grouped by the queue it enters first
    plan = small_plan(radix=radix, levels=3)
    longest: dict[str, int] = {}
    for units in range(1, radix**3):
        queue = first_queue(plan, units * plan.resolution_ms)
        longest[queue] = max(longest.get(queue, 0), units * plan.resolution_ms)
    # Then the bound of each queue is exactly the longest delay that enters it
    for queue in plan.delay_queues:
        assert status.longest_wait_ms(plan, queue) == longest[queue.name], queue.name


def test_buckets_include_their_upper_limit() -> None:
    labels = [label for label, _ in status.BUCKETS]
    assert labels[status.bucket_of(0)] == "≤ 1 s"
    assert labels[status.bucket_of(1_000)] == "≤ 1 s"
    assert labels[status.bucket_of(1_001)] == "≤ 1 min"
    assert labels[status.bucket_of(3_600_000)] == "≤ 1 h"
    assert labels[status.bucket_of(86_400_001)] == "≤ 30 days"
    assert labels[status.bucket_of(30 * 86_400_000 + 1)] == "longer"


def test_snapshot_counts_levels_chart_failed_and_old_topologies() -> None:
    # Given a radix-4 topology with 10 ms units, an old radix-2 one, and known counts
    plan, old = small_plan(), small_plan(radix=2, levels=6)
    by_name = {q.name: q for q in plan.delay_queues}
    stats: dict[str, QueueStats | None] = {q.name: QueueStats(0, 0) for q in plan.delay_queues}
    top = by_name[first_queue(plan, 500)]  # 50 units = 302 in base 4: L02.d03
    stats[top.name] = QueueStats(3, 0)
    stats[first_queue(plan, 20)] = QueueStats(2, 0)
    stats[first_queue(plan, 30)] = QueueStats(1, 0)
    stats[plan.ready_queues["default"].name] = QueueStats(4, 2)
    stats[plan.ready_queues["other"].name] = None
    stats[plan.failed_queue.name] = QueueStats(5, 0)
    stats[old.delay_queues[-1].name] = QueueStats(7, 0)  # L00.d01, the rest missing
    # When the snapshot is built
    snap = status.build_snapshot(
        current=plan,
        others=[old],
        stats=stats,
        failed_by_queue=Counter({"default": 3, None: 1, "gone": 1}),
        unacked=None,
        taken_at=datetime(2025, 1, 1, tzinfo=UTC),
    )
    # Then the levels sum their digit queues and bound the wait by the fullest digit
    current = snap.topologies[0]
    assert [(lv.level, lv.jobs, lv.longest_wait_ms) for lv in current.levels] == [
        (2, 3, (4 * 16 - 1) * 10),  # digit 3 at level 2: at most 63 units
        (1, 0, None),
        (0, 3, 30),  # digits 2 and 3 at level 0: at most 3 units
    ]
    assert current.pending == 6
    assert snap.topologies[1].pending == 7 and not snap.topologies[1].current
    assert snap.pending == 13
    assert dict((b.label, b.jobs) for b in snap.chart)["≤ 1 s"] == 13
    # And the ready queues, with unacked unknown and a missing queue shown as such
    default, other = snap.queues
    assert (default.ready, default.consumers, default.unacked, default.failed) == (4, 2, None, 3)
    assert (other.ready, other.consumers, other.failed) == (None, None, 0)
    assert (snap.failed, snap.failed_elsewhere, snap.unacked) == (5, 2, None)
    as_json = json.loads(json.dumps(snap.to_dict()))
    assert as_json["unacked_source"] is None
    assert {q["queue"]: q["jobs"] for q in as_json["topologies"][0]["waiting_in"]} == {
        top.name: 3,
        first_queue(plan, 20): 2,
        first_queue(plan, 30): 1,
    }


def test_duration_text_rounds_up() -> None:
    assert status_text.format_duration(999) == "999 ms"
    assert status_text.format_duration(1_000) == "1 s"
    assert status_text.format_duration(61_001) == "1 min 2 s"
    assert status_text.format_duration(3_599_999) == "1 h"
    assert status_text.format_duration(655_359) == "10 min 56 s"
    assert status_text.format_duration(2 * 86_400_000 + 1) == "2 d 1 h"


def test_render_text_says_unacked_is_unknown() -> None:
    plan = small_plan()
    stats = {q.name: QueueStats(0, 1) for q in plan.shared_queues}
    snap = status.build_snapshot(
        current=plan,
        others=[],
        stats=stats,
        failed_by_queue=None,
        unacked=None,
        taken_at=datetime(2025, 1, 1, tzinfo=UTC),
    )
    text = status_text.render_text(snap)
    assert "n/a" in text and "management API" in text
    assert "not on the broker" in text  # no delay queue exists


class _ManagementStub(BaseHTTPRequestHandler):
    queues = {
        "/api/queues/%2F": [
            {"name": "q.ready", "messages_unacknowledged": 3},
            {"name": "other.ready", "messages_unacknowledged": 9},
        ],
        "/api/queues/moved": [],
    }

    def do_GET(self) -> None:
        body = self.queues.get(self.path.split("?")[0])
        if self.path.startswith("/api/queues/moved"):
            self.send_response(302)
            # To a URL that would answer: only refusing the redirect gives None.
            self.send_header("Location", self.path.replace("moved", "%2F"))
            self.end_headers()
        elif self.headers.get("Authorization") != "Basic Z3Vlc3Q6Z3Vlc3Q=":  # guest:guest
            self.send_response(401)
            self.end_headers()
        elif body is None:
            self.send_response(404)
            self.end_headers()
        else:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args: Any) -> None:
        pass


def test_unacked_counts_from_the_management_api() -> None:
    # Given a stand-in for the management plugin's HTTP API
    server = HTTPServer(("127.0.0.1", 0), _ManagementStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    api = f"http://127.0.0.1:{server.server_port}/"
    url = "amqp://guest:guest@127.0.0.1:5672/%2F"

    def unacked(broker: str, api_urls: list[str], queues: list[str]) -> dict[str, int] | None:
        return ManagementAPI(api_urls, broker).unacked("q", queues)

    try:
        # Then it answers per queue of the prefix; a missing queue has nothing unacked
        assert unacked(url, [api], ["q.ready", "q.gone"]) == {"q.ready": 3}
        # A dead node's API is passed over for the next one
        dead = "http://127.0.0.1:1/"
        assert unacked(url, [dead, api], ["q.ready"]) == {"q.ready": 3}
        # And refused credentials, no API, or no URL mean "unknown"
        bad = "amqp://guest:nope@127.0.0.1:5672/%2F"
        assert unacked(bad, [api], ["q.ready"]) is None
        with_own = f"http://guest:guest@127.0.0.1:{server.server_port}"
        assert unacked(bad, [with_own], ["q.ready"]) == {"q.ready": 3}
        # A redirect is not followed: it would carry the credentials elsewhere
        assert unacked("amqp://guest:guest@127.0.0.1:5672/moved", [api], ["q.ready"]) is None
    finally:
        server.shutdown()
    assert unacked(url, [api], ["q.ready"]) is None
    assert unacked(url, [], ["q.ready"]) is None


def test_management_url_setting() -> None:
    base = {"BROKER_URL": "amqp://u:p@rabbit.example:5673/v"}
    assert _build(base).management_urls == ("http://rabbit.example:15672/",)
    # An encrypted broker connection: the API is asked over HTTPS only
    tls = {"BROKER_URL": "amqps://u:p@rabbit.example:5671/v"}
    assert _build(tls).management_urls == ("https://rabbit.example:15671/",)
    assert _build({**base, "MANAGEMENT_URL": False}).management_urls == ()
    assert _build({**base, "MANAGEMENT_URL": "https://m:1/"}).management_urls == ("https://m:1/",)
    # A cluster: each node's host, in the order of BROKER_URL
    nodes = {"BROKER_URL": ["amqp://u:p@a:5672/v", "amqp://u:p@b:5672/v", "amqp://u:p@a:5673/v"]}
    assert _build(nodes).management_urls == ("http://a:15672/", "http://b:15672/")
    listed = {**nodes, "MANAGEMENT_URL": ["http://a:15681/", "http://b:15682/"]}
    assert _build(listed).management_urls == ("http://a:15681/", "http://b:15682/")
    for bad in ("rabbit:15672", [], ["http://ok/", 5]):
        with pytest.raises(ImproperlyConfigured, match="MANAGEMENT_URL"):
            _build({**base, "MANAGEMENT_URL": bad})


# --------------------------------------------------------------------------- broker


def status_json() -> dict[str, Any]:
    out = StringIO()
    call_command("deferred_status", "--json", stdout=out)
    return json.loads(out.getvalue())


#: Delays long enough that no job moves on while the test reads the queues.
KNOWN = {
    timedelta(minutes=10): 3,
    timedelta(minutes=2): 1,
    timedelta(days=2): 2,
    timedelta(days=365): 1,
}


def test_status_json_agrees_with_the_broker(own_topology: Plan, raw_channel, tmp_path) -> None:
    plan = own_topology
    # Given jobs with known delays, each sitting in a queue its digits name
    expected: Counter[str] = Counter()
    for delay, count in KNOWN.items():
        for _ in range(count):
            defer(record, delay, str(tmp_path / "never.jsonl"), "pending")
        expected[first_queue(plan, int(delay / timedelta(milliseconds=1)))] += count
    # When the status is read
    data = status_json()
    # Then it names the same queues and counts as the broker, read independently
    on_broker = {q.name: n for q in plan.delay_queues if (n := depth(raw_channel, q.name))}
    current = data["topologies"][0]
    assert {q["queue"]: q["jobs"] for q in current["waiting_in"]} == on_broker == expected
    assert data["pending"] == current["pending"] == sum(KNOWN.values())
    # And each level's jobs and bound follow from the queues its jobs are in
    by_queue = {q.name: q for q in plan.delay_queues}
    for level in current["levels"]:
        here = [by_queue[name] for name in expected if by_queue[name].level == level["level"]]
        assert level["jobs"] == sum(expected[q.name] for q in here)
        bounds = [status.longest_wait_ms(plan, q) for q in here]
        assert level["longest_wait_ms"] == (max(bounds) if bounds else None)
    ten_minutes = by_queue[first_queue(plan, 600_000)]
    assert ten_minutes.level == 4 and ten_minutes.digit == 9  # 600,000 = 0x927C0
    assert status.longest_wait_ms(plan, ten_minutes) == 10 * 16**4 - 1
    # And the chart puts every job in the bucket of its queue's bound
    chart = {b["label"]: b["jobs"] for b in data["chart"]}
    assert chart == {
        "≤ 1 s": 0,
        "≤ 1 min": 0,
        "≤ 1 h": 4,
        "≤ 1 day": 0,
        "≤ 30 days": 2,
        "longer": 1,
    }
    # And the ready queues are empty and unconsumed (unacked unknown without the plugin)
    for queue in data["queues"]:
        assert (queue["ready"], queue["consumers"], queue["failed"]) == (0, 0, 0)
        assert queue["unacked"] == (None if data["unacked_source"] is None else 0)
    assert data["failed"] == 0
    assert [t["topology"] for t in data["topologies"]] == [plan.topology_id]


def test_status_shows_consumers_failed_jobs_and_an_old_topology(
    own_topology: Plan, run_worker, tmp_path
) -> None:
    # Given an old radix-4 topology with one job still waiting in it
    base = settings.DEFERRED
    with override_settings(DEFERRED={**base, "RADIX": 4}):
        call_command("declare_delay_topology", verbosity=0)
        defer(record, timedelta(hours=1), str(tmp_path / "never.jsonl"), "old")
        old_id = status.collect(get_settings()).snapshot.current_topology
    # And a worker on the default queue only, and a job that fails in it
    run_worker(queues=["default"])
    defer(explode, 0, "boom")
    assert wait_for(lambda: status_json()["failed"] == 1, 15)
    # When the status is read
    data = status_json()
    # Then the worker's consumer, the failed job's queue and both topologies show
    queues = {q["name"]: q for q in data["queues"]}
    assert queues["default"]["consumers"] == 1 and queues["other"]["consumers"] == 0
    assert queues["default"]["failed"] == 1 and queues["other"]["failed"] == 0
    assert data["failed_elsewhere"] == 0
    topologies = {t["topology"]: t for t in data["topologies"]}
    assert topologies[old_id]["current"] is False and topologies[old_id]["pending"] == 1
    assert topologies[own_topology.topology_id]["current"] is True
    assert data["pending"] == 1
    # And the text form says the same
    out = StringIO()
    call_command("deferred_status", stdout=out)
    text = out.getvalue()
    assert f"topology {old_id} (old, draining): 1 job pending" in text
    assert "failed, all queues: 1" in text


def test_broker_down_is_a_clear_error() -> None:
    base = settings.DEFERRED
    with override_settings(DEFERRED={**base, "BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}):
        with pytest.raises(CommandError, match=r"Cannot connect to RabbitMQ at 127\.0\.0\.1:1"):
            call_command("deferred_status", stdout=StringIO())


@pytest.mark.usefixtures("topology")
def test_watch_prints_one_json_document_per_line_until_interrupted() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "deferred_status", "--json", "--watch", "0.2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        # Read what it writes meanwhile: a full pipe would block its last write,
        # and the process with it.
        _rest, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
    for line in (first, second):
        assert json.loads(line)["prefix"] == settings.DEFERRED["PREFIX"]


def test_watch_interval_is_validated() -> None:
    with pytest.raises(CommandError, match=r"at least 0\.1"):
        call_command("deferred_status", "--watch", "0", stdout=StringIO())


def test_an_unreadable_cancels_stream_leaves_the_rest_of_the_status(
    own_topology: Plan, monkeypatch
) -> None:
    # Given a cancels stream that cannot be read (a cluster's stream coordinator
    # unavailable for a while after nodes restarted)
    from deferred.broker import BrokerUnavailable

    def unreadable(*args: Any, **kwargs: Any) -> None:
        raise BrokerUnavailable("coordinator_unavailable")

    monkeypatch.setattr(status, "read_cancels", unreadable)
    # Then the status still shows everything else, and says why the cancels are unknown
    data = status_json()
    assert data["pending"] == 0 and data["cancels_in_force"] is None
    assert data["cancels_error"] == "coordinator_unavailable"
    out = StringIO()
    call_command("deferred_status", stdout=out)
    assert "cancels in force: unknown (coordinator_unavailable)" in out.getvalue()
