"""Failover and stuck-queue handling that one broker can show; the cluster itself is in
test_cluster.py.

A URL list whose first node does not answer is the single broker behind a
dead address. The management API of RabbitMQ 3.13+ (quorum replica endpoints)
is not on this machine's 3.10 broker, so the repair through it is checked
against a stand-in HTTP server that records what it was asked.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from io import StringIO
from typing import Any

import pika
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from deferred import defer
from deferred.broker import publisher
from deferred.broker.connection import failover, open_connection, setting_up
from deferred.broker.errors import BrokerUnavailable, TopologyNotDeclared
from deferred.broker.http_api import ManagementAPI
from deferred.cluster.repair import repair
from deferred.cluster.stuck import StuckQueue
from deferred.cluster.watch import StuckWatch
from deferred.conf import get_settings
from tests.conftest import wait_for
from tests.silent import SilentRelay
from tests.testapp.tasks import read_records, record

DEAD = "amqp://guest:guest@127.0.0.1:1/%2F"


def test_a_dead_first_url_is_passed_over_by_publishers_workers_and_status(
    clean, broker_url, run_worker, records
):
    # The nodes as AMQP sees them: the management API, when it runs, would
    # name the cluster's members instead (test_cluster covers that).
    only_amqp = {"BROKER_URL": [DEAD, broker_url], "MANAGEMENT_URL": False}
    with override_settings(DEFERRED={**settings.DEFERRED, **only_amqp}):
        started = time.monotonic()
        job_id = defer(record, 0, records, "via the second node")
        assert time.monotonic() - started < 2
        worker = run_worker()
        assert worker.consumer.node is not None and worker.consumer.node.index == 1
        assert wait_for(lambda: len(read_records(records)) == 1, 10)
        out = StringIO()
        call_command("deferred_status", "--json", stdout=out)
        cluster = json.loads(out.getvalue())["cluster"]
    assert job_id
    assert cluster["read_from"] == "127.0.0.1:5672/"
    assert cluster["nodes_source"] == "amqp"
    assert [n["state"] for n in cluster["nodes"]] == ["does not answer", "answers"]


def labels(path: str) -> list[str]:
    return sorted(r["label"] for r in read_records(path))


def test_a_node_that_goes_silent_is_left_for_the_next_within_the_deadline(
    clean, broker_url, run_worker, records
):
    # A node whose host is lost sends no RST: the publish's confirm never
    # comes. With another node listed, defer() waits for half of
    # PUBLISH_TIMEOUT, then publishes through the next node.
    run_worker()
    port = pika.URLParameters(broker_url).port
    with SilentRelay(port) as relay:
        urls = [relay.url(), broker_url]
        with override_settings(
            DEFERRED={**settings.DEFERRED, "BROKER_URL": urls, "PUBLISH_TIMEOUT": 4}
        ):
            defer(record, 0, records, "through the relay")
            assert publisher(urls, 4.0).node.index == 0
            relay.silence()
            started = time.monotonic()
            defer(record, 0, records, "after the silence")
            took = time.monotonic() - started
            assert publisher(urls, 4.0).node.index == 1
    assert 1.8 <= took < 4, took
    assert wait_for(lambda: len(read_records(records)) == 2, 10)
    assert labels(records) == ["after the silence", "through the relay"]


def test_a_silent_node_gets_only_its_share_of_the_connect_deadline(
    clean, broker_url, run_worker, records
):
    run_worker()
    port = pika.URLParameters(broker_url).port
    with SilentRelay(port) as relay:
        relay.silence()
        urls = [relay.url(), broker_url]
        with override_settings(
            DEFERRED={**settings.DEFERRED, "BROKER_URL": urls, "PUBLISH_TIMEOUT": 4}
        ):
            started = time.monotonic()
            defer(record, 0, records, "past a silent first node")
            took = time.monotonic() - started
    # Two nodes: the silent one gets half of the 4 s, the next one the rest.
    assert 1.8 <= took < 3.5, took
    assert wait_for(lambda: len(read_records(records)) == 1, 10)


def test_with_declare_off_the_topology_check_keeps_to_the_deadline(clean, broker_url):
    from deferred.broker import BrokerUnavailable

    port = pika.URLParameters(broker_url).port
    with SilentRelay(port) as relay:
        relay.silence()
        with override_settings(
            DEFERRED={
                **settings.DEFERRED,
                "BROKER_URL": relay.url(),
                "DECLARE": False,
                "PUBLISH_TIMEOUT": 1.5,
            }
        ):
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable, match="Cannot connect") as raised:
                defer(record, 0, "/dev/null", "never")
            took = time.monotonic() - started
    assert took < 3, took
    assert raised.value.job_id


def test_no_node_answers_names_every_node_tried():
    from deferred.broker import BrokerUnavailable

    other = "amqp://guest:guest@127.0.0.1:2/%2F"
    with override_settings(DEFERRED={**settings.DEFERRED, "BROKER_URL": [DEAD, other]}):
        with pytest.raises(BrokerUnavailable, match="any of its 2 nodes") as raised:
            defer(record, 0, "/dev/null", "nowhere")
    assert "127.0.0.1:1/" in str(raised.value) and "127.0.0.1:2/" in str(raised.value)
    assert raised.value.job_id


def test_classic_queues_on_several_nodes_are_declared_with_a_warning(topology, broker_url):
    # Without the management API the URLs are the nodes (with it, the
    # cluster's real members are counted: one here).
    err = StringIO()
    two_urls = {"BROKER_URL": [broker_url, DEAD], "MANAGEMENT_URL": False}
    with override_settings(DEFERRED={**settings.DEFERRED, **two_urls}):
        call_command("declare_delay_topology", stdout=StringIO(), stderr=err)
    assert "classic queues on a cluster of 2 nodes" in err.getvalue()
    assert "not lost if its disk survives" in err.getvalue()
    # One node: nothing to warn about.
    err = StringIO()
    call_command("declare_delay_topology", stdout=StringIO(), stderr=err)
    assert err.getvalue() == ""


def test_deferred_repair_without_the_management_api_says_how_to_do_it_by_hand(topology):
    with (
        override_settings(DEFERRED={**settings.DEFERRED, "MANAGEMENT_URL": "http://127.0.0.1:1/"}),
        pytest.raises(CommandError, match="management API does not answer") as raised,
    ):
        call_command("deferred_repair", stdout=StringIO())
    assert "rabbitmq-queues delete_member" in str(raised.value)


# --------------------------------------------------------------------------- a stand-in API


class _API(BaseHTTPRequestHandler):
    """Answers like the management API; ``replicas`` says whether it has the 3.13+ endpoints."""

    replicas = True
    queues: list[dict[str, Any]] = []
    asked: list[tuple[str, str, Any]] = []
    #: RabbitMQ 4.3 with management_metrics_collection denied: no message counts.
    stats_disabled = False

    def _reply(self, code: int, body: Any = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        if body is not None:
            self.wfile.write(json.dumps(body).encode())

    def do_GET(self) -> None:
        if self.path.startswith("/api/queues/%2F"):
            self._reply(200, self.queues)
        elif self.path == "/api/nodes":
            self._reply(200, [{"name": "rabbit-a@localhost", "running": True}])
        elif self.path == "/api/overview":
            self._reply(200, {"disable_stats": self.stats_disabled})
        else:
            self._reply(404)

    def _change(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null")
        type(self).asked.append((self.command, self.path, body))
        self._reply(204 if self.replicas else 405)

    do_DELETE = do_POST = _change

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[str]:
    _API.asked, _API.replicas, _API.queues, _API.stats_disabled = [], True, [], False
    server = HTTPServer(("127.0.0.1", 0), _API)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


STUCK = StuckQueue(
    "p.delay.q", 5, 40, "rabbit-a@h", ("rabbit-a@h", "rabbit-b@h"), ("rabbit-a@h", "rabbit-b@h")
)


def test_repair_through_the_api_moves_the_leader_and_adds_its_replica_back(stand_in):
    api = ManagementAPI([stand_in], "amqp://guest:guest@127.0.0.1:5672/%2F")
    done = repair(STUCK, api, use_cli=False)
    assert done.done and done.method == "api" and done.problem is None
    assert _API.asked == [
        ("DELETE", "/api/queues/quorum/%2F/p.delay.q/replicas/delete", {"node": "rabbit-a@h"}),
        ("POST", "/api/queues/quorum/%2F/p.delay.q/replicas/add", {"node": "rabbit-a@h"}),
    ]


def test_a_replica_removal_that_timed_out_is_not_sent_to_another_node(stand_in):
    # A node that takes the request and never answers: the removal may be
    # under way there, so sending it to the next URL could remove a second replica.
    with socket.create_server(("127.0.0.1", 0)) as mute:
        slow = f"http://127.0.0.1:{mute.getsockname()[1]}/"
        api = ManagementAPI(
            [slow, stand_in], "amqp://guest:guest@127.0.0.1:5672/%2F", change_timeout=1
        )
        done = repair(STUCK, api, use_cli=False)
    assert not done.done and done.method == "api"
    assert "not sent to another node" in (done.problem or "")
    assert _API.asked == []


def test_without_replica_endpoints_or_cli_the_repair_gives_the_commands(stand_in):
    _API.replicas = False  # RabbitMQ before 3.13: 405
    api = ManagementAPI([stand_in], "amqp://guest:guest@127.0.0.1:5672/%2F")
    manual = repair(STUCK, api, use_cli=False)
    assert not manual.done and manual.method == "manual"
    assert "RabbitMQ < 3.13" in (manual.problem or "")
    assert manual.commands[0].endswith("delete_member -p / p.delay.q rabbit-a@h")


def stuck_row(count: int) -> dict[str, Any]:
    now = int(time.time() * 1000)
    points = [{"timestamp": now - i * 5000, "sample": count} for i in range(8)]
    return {
        "name": "deferred-x.delay.r16.1ms.L04.quorum.L00.d01",
        "type": "quorum",
        "leader": "rabbit-a@localhost",
        "members": ["rabbit-a@localhost", "rabbit-b@localhost", "rabbit-c@localhost"],
        "online": ["rabbit-a@localhost", "rabbit-b@localhost", "rabbit-c@localhost"],
        "messages": count,
        "messages_ready": 0,
        "messages_unacknowledged": 0,
        "messages_dlx": count,
        "messages_details": {"samples": points},
        "messages_ready_details": {"samples": [{**p, "sample": 0} for p in points]},
        "messages_unacknowledged_details": {"samples": [{**p, "sample": 0} for p in points]},
    }


def test_the_worker_watch_logs_each_stuck_queue_once_and_repairs_it(stand_in, caplog):
    _API.queues = [stuck_row(7)]
    base = {**settings.DEFERRED, "QUEUE_TYPE": "quorum", "MANAGEMENT_URL": stand_in}
    with override_settings(DEFERRED={**base, "REPAIR_STUCK": False}):
        watch = StuckWatch(get_settings(), "deferred-x", ManagementAPI([stand_in], DEAD))
    with caplog.at_level(logging.ERROR, logger="deferred.watch"):
        assert watch.check() == [] and watch.check() == []
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "7 jobs stuck" in errors[0]
    assert "delete_member" in errors[0] and _API.asked == []
    # With REPAIR_STUCK, it forces the election itself, once per queue for a while.
    with override_settings(DEFERRED=base):
        watch = StuckWatch(get_settings(), "deferred-x", ManagementAPI([stand_in], DEAD))
    # Only once a second reading finds it stuck too.
    assert watch.check() == [] and _API.asked == []
    (done,) = watch.check()
    assert done.done and done.method == "api" and len(_API.asked) == 2
    assert watch.check() == []


def _two_names_for(broker_url: str) -> tuple[str, ...]:
    # Two URLs that both reach the one broker: the failover order is kept per
    # URL list, and the second entry is where a lost first node sends it.
    return (broker_url, broker_url.replace("127.0.0.1", "localhost"))


def test_a_set_up_that_the_broker_refuses_closes_the_connection_and_moves_off_the_node(
    broker_url,
):
    urls = _two_names_for(broker_url)
    connection, node = open_connection(urls)
    try:
        assert node.index == 0
        expected = re.escape(f"Could not read the missing queue at {node.address}: ")
        with pytest.raises(BrokerUnavailable, match=expected):
            with setting_up(connection, node, "read the missing queue"):
                connection.channel().queue_declare("deferred-test-no-such-queue", passive=True)
        assert connection.is_closed
        assert failover.order(urls)[0] == 1
    finally:
        failover.connected(urls, 0)


@pytest.mark.parametrize("error", [ValueError("a bug of ours"), KeyboardInterrupt()])
def test_any_other_failure_of_a_set_up_closes_the_connection_and_passes_through(broker_url, error):
    urls = _two_names_for(broker_url)
    for raised in (error, TopologyNotDeclared("not declared")):
        connection, node = open_connection(urls)
        with pytest.raises(type(raised)) as caught:
            with setting_up(connection, node, "start"):
                connection.channel()
                raise raised
        assert caught.value is raised
        assert connection.is_closed
        assert failover.order(urls)[0] == 0, "not a broker failure: the node is not marked lost"


def test_without_message_counts_stuck_jobs_are_unknown_and_the_worker_says_why(
    stand_in, caplog, topology
):
    # RabbitMQ 4.3 with management_metrics_collection denied lists queues
    # without counts: no figures to judge by, and that is said, not "none".
    _API.stats_disabled = True
    _API.queues = [{k: v for k, v in stuck_row(7).items() if not k.startswith("messages")}]
    base = {**settings.DEFERRED, "QUEUE_TYPE": "quorum", "MANAGEMENT_URL": stand_in}
    with override_settings(DEFERRED=base):
        watch = StuckWatch(get_settings(), "deferred-x", ManagementAPI([stand_in], DEAD))
        with caplog.at_level(logging.WARNING, logger="deferred.watch"):
            assert watch.check() == [] and watch.check() == []
    told = [
        r.getMessage() for r in caplog.records if "management_metrics_collection" in r.getMessage()
    ]
    assert len(told) == 1 and "cannot watch" in told[0]
    assert _API.asked == []
    with override_settings(DEFERRED={**settings.DEFERRED, "MANAGEMENT_URL": stand_in}):
        out = StringIO()
        call_command("deferred_status", "--json", stdout=out)
        cluster = json.loads(out.getvalue())["cluster"]
    assert cluster["stuck"] is None
    assert "management_metrics_collection" in cluster["stuck_unknown"]
