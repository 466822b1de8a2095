"""Prometheus: the worker's --metrics-port and the metrics/ URL, scraped over HTTP
and parsed with prometheus_client's own parser, against the real broker."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from datetime import UTC, datetime

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from deferred import defer, defer_many
from deferred.conf import get_settings
from deferred.core.jobs import Job, new_job_id
from deferred.producer.publishing import publish
from deferred.records.failures import list_failed
from tests.conftest import wait_for
from tests.testapp.tasks import explode, read_records, record

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "s3cret-token-for-prometheus"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str, token: str | None = None) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of a metrics page."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def status_of(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_worker_counters_match_the_jobs_it_ran(clean, records, worker_process):
    port = free_port()
    worker = worker_process("--metrics-port", str(port), "--metrics-address", "127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    before = scrape(url)
    assert before[("deferred_worker_up", ())] == 1
    assert before[("deferred_jobs_running", ())] == 0

    defer_many([(record, 0, (records, f"ok-{n}")) for n in range(7)])
    defer_many([(explode, 0, (f"boom-{n}",)) for n in range(3)])
    forged = Job(
        id=new_job_id(),
        task="no.such.task",
        args=(),
        kwargs={},
        due=datetime.now(UTC),
        queue="default",
    )
    publish(forged, 0)
    assert wait_for(lambda: len(read_records(records)) == 7, 15), worker.output()
    assert wait_for(lambda: len(list_failed(get_settings())) == 4, 15), worker.output()

    ok = ("task", "tests.testapp.tasks.record")
    bad = ("task", "tests.explode")

    def counted():
        m = scrape(url)
        return (
            m.get(("deferred_jobs_total", (("outcome", "succeeded"), ("queue", "default"), ok))),
            m.get(("deferred_jobs_total", (("outcome", "failed"), ("queue", "default"), bad))),
        )

    # The forged task is counted under "unknown", never under its own name.
    unknown = (("outcome", "failed"), ("queue", "default"), ("task", "unknown"))
    assert wait_for(
        lambda: counted() == (7, 3) and scrape(url).get(("deferred_jobs_total", unknown)) == 1, 5
    ), counted()
    m = scrape(url)
    assert m[("deferred_jobs_total", unknown)] == 1
    assert not any("no.such.task" in str(labels) for _name, labels in m)
    # Every job that ran has a lateness and a duration; nothing is running now.
    assert m[("deferred_job_lateness_seconds_count", (("queue", "default"),))] == 10
    assert m[("deferred_job_duration_seconds_count", (ok,))] == 7
    assert m[("deferred_job_duration_seconds_count", (bad,))] == 3
    assert m[("deferred_jobs_running", ())] == 0
    assert m[("deferred_worker_up", ())] == 1
    # A job runs only once it is due: its lateness is not negative.
    le_inf = (("le", "+Inf"), ("queue", "default"))
    assert m[("deferred_job_lateness_seconds_bucket", le_inf)] == 10


def test_bad_metrics_ports_are_refused(clean, worker_process):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = worker_process(
            "--metrics-port", str(port), "--metrics-address", "127.0.0.1", expect_exit=True
        )
        assert worker.wait() != 0
        assert "Cannot serve metrics on 127.0.0.1" in worker.output()
    worker = worker_process("--metrics-port", "70000", expect_exit=True)
    assert worker.wait() != 0
    assert "at most 65535" in worker.output()


def deferred_settings(**changes):
    return override_settings(DEFERRED={**settings.DEFERRED, **changes})


def test_the_status_metrics_need_a_setting_and_the_token(own_topology, live_server):
    url = f"{live_server.url}/deferred/metrics/"
    assert status_of(url) == 404  # off unless a setting turns it on
    with deferred_settings(PREFIX=own_topology.prefix, METRICS_TOKEN=TOKEN):
        assert status_of(url) == 401
        assert status_of(url, "wrong-token-of-some-length") == 401
        assert status_of(url, TOKEN) == 200
    with deferred_settings(PREFIX=own_topology.prefix, METRICS_ALLOW=["127.0.0.0/8", "::1"]):
        assert status_of(url) == 200
    with deferred_settings(PREFIX=own_topology.prefix, METRICS_ALLOW=["10.0.0.0/8"]):
        assert status_of(url) == 403
    with deferred_settings(
        PREFIX=own_topology.prefix, METRICS_ALLOW=["127.0.0.1"], METRICS_TOKEN=TOKEN
    ):
        assert status_of(url) == 401  # both must pass
        assert status_of(url, TOKEN) == 200


def test_the_status_metrics_show_what_waits_where(own_topology, live_server, records):
    url = f"{live_server.url}/deferred/metrics/"
    with deferred_settings(PREFIX=own_topology.prefix, METRICS_TOKEN=TOKEN):
        for _ in range(4):
            defer(record, 3600, records, "later")  # the same level: digits of 3,600,000 ms
        defer(record, 0, records, "now")
        m = scrape(url, TOKEN)
    assert m[("deferred_broker_up", ())] == 1
    pending = {
        dict(labels)["level"]: value
        for (name, labels), value in m.items()
        if name == "deferred_jobs_pending" and dict(labels)["current"] == "true"
    }
    assert sum(pending.values()) == 4
    assert len([v for v in pending.values() if v]) >= 1
    assert m[("deferred_jobs_ready", (("queue", "default"),))] == 1
    assert m[("deferred_jobs_ready", (("queue", "other"),))] == 0
    assert m[("deferred_consumers", (("queue", "default"),))] == 0
    assert m[("deferred_jobs_failed", ())] == 0
    assert m[("deferred_cancels_in_force", ())] == 0


def test_the_status_metrics_say_when_the_broker_is_down(live_server):
    url = f"{live_server.url}/deferred/metrics/"
    with deferred_settings(
        BROKER_URL="amqp://guest:guest@127.0.0.1:1/%2F", METRICS_TOKEN=TOKEN, MANAGEMENT_URL=False
    ):
        m = scrape(url, TOKEN)
    assert m == {("deferred_broker_up", ()): 0}


@pytest.mark.parametrize(
    "changes",
    [
        {"METRICS_TOKEN": "short"},
        {"METRICS_TOKEN": 12345678901234567890},
        {"METRICS_TOKEN": " padded-token-with-space "},
        {"METRICS_ALLOW": "127.0.0.1"},
        {"METRICS_ALLOW": []},
        {"METRICS_ALLOW": ["not-an-address"]},
    ],
)
def test_bad_metrics_settings_are_configuration_errors(changes):
    with deferred_settings(**changes), pytest.raises(ImproperlyConfigured, match="METRICS_"):
        get_settings()


def test_the_metrics_url_is_absent_for_any_method_when_off_and_get_only_when_on(live_server):
    url = f"{live_server.url}/deferred/metrics/"
    request = urllib.request.Request(url, data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 404
    with deferred_settings(METRICS_ALLOW=["127.0.0.1"]):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 405


def test_the_allow_list_reads_ipv4_mapped_addresses_as_ipv4():
    import ipaddress

    from deferred.views import _allowed

    networks = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1"))
    assert _allowed("10.1.2.3", networks)
    assert _allowed("::ffff:10.1.2.3", networks)
    assert _allowed("::1", networks)
    assert not _allowed("11.1.2.3", networks)
    assert not _allowed("::ffff:11.1.2.3", networks)
    assert not _allowed("not an address", networks)
    assert not _allowed("", networks)
