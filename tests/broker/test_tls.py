"""TLS to the broker, against a node that speaks only TLS and wants a client certificate.

The node (scripts/tls-node.sh) is started for these tests and stopped after
them; if it cannot start, the tests fail: they never skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.parse
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from django.test import override_settings

from deferred import defer
from deferred.broker import BrokerUnavailable, server_version
from deferred.cluster.nodes import management_api
from deferred.conf import get_settings
from tests.conftest import wait_for
from tests.testapp.tasks import read_records, record

ROOT = Path(__file__).resolve().parents[2]
PORT = 5691
URL = f"amqps://guest:guest@localhost:{PORT}/%2F"
#: Where scripts/tls-node.sh keeps its certificates (in the folder of a
#: ``rabbitmq-release.sh VERSION run``, when the suite runs in one).
CERTS = (
    Path(
        os.environ.get("DEFERRED_TLS_DIR")
        or Path(os.environ.get("DEFERRED_RABBITMQ_RUN_DIR", "/tmp")) / "deferred-tls"
    )
    / "certs"
)
#: What the script needs from the suite's environment: the release to run, its folder.
PASSED_ON = ("HOME", "DEFERRED_RABBITMQ_RELEASE", "DEFERRED_RABBITMQ_RUN_DIR", "DEFERRED_TLS_DIR")


@pytest.fixture(scope="module")
def tls_node() -> Iterator[Path]:
    script = str(ROOT / "scripts" / "tls-node.sh")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
    env.update({name: os.environ[name] for name in PASSED_ON if name in os.environ})
    try:
        started = subprocess.run(
            [script, "start"], capture_output=True, text=True, timeout=120, env=env
        )
        assert started.returncode == 0, f"the TLS node did not start:\n{started.stderr}"
        yield CERTS
    finally:
        subprocess.run([script, "stop"], capture_output=True, timeout=120, env=env)


def tls_settings(certs: Path, **changes):
    values = {
        **django_settings.DEFERRED,
        "BROKER_URL": URL,
        "PREFIX": "deferred-tls-test",
        "TLS_CA_FILE": str(certs / "ca.pem"),
        "TLS_CERT_FILE": str(certs / "client.pem"),
        "TLS_KEY_FILE": str(certs / "client.key"),
        "MANAGEMENT_URL": f"https://localhost:{PORT + 10000}/",
    }
    values.update(changes)
    return override_settings(DEFERRED={k: v for k, v in values.items() if v is not None})


def test_with_the_right_ca_and_a_client_certificate_jobs_run(tls_node, run_worker, records):
    with tls_settings(tls_node):
        call_command("declare_delay_topology", verbosity=0)
        run_worker()
        defer(record, 0.2, records, "over tls")
        assert wait_for(lambda: [r["label"] for r in read_records(records)] == ["over tls"], 15)
        # The status page's management API call is verified with the same CA.
        api = management_api(get_settings())
        queues = api.queues("deferred-tls-test")
        assert queues is not None and "deferred-tls-test.failed" in queues
        # So deferred_status knows the unacked counts, which only that API tells.
        out = StringIO()
        call_command("deferred_status", "--json", stdout=out)
        assert json.loads(out.getvalue())["unacked"] is not None
        # And the node is the release the suite runs against, not the local one.
        release = os.environ.get("DEFERRED_RABBITMQ_RELEASE")
        if release:
            version = server_version(get_settings().broker_urls)
            assert ".".join(map(str, version)).startswith(release + "."), version


def test_the_url_ssl_options_of_pika_work_too(tls_node, run_worker, records):
    options = {
        "cafile": str(tls_node / "ca.pem"),
        "certfile": str(tls_node / "client.pem"),
        "keyfile": str(tls_node / "client.key"),
    }
    url = f"{URL}?ssl_options={urllib.parse.quote(repr(options))}"
    with tls_settings(
        tls_node, BROKER_URL=url, TLS_CA_FILE=None, TLS_CERT_FILE=None, TLS_KEY_FILE=None
    ):
        call_command("declare_delay_topology", verbosity=0)
        defer(record, 0, records, "pika's way")
        run_worker()
        assert wait_for(lambda: len(read_records(records)) == 1, 15)


def test_the_wrong_ca_fails_naming_the_certificate_problem(tls_node):
    with tls_settings(tls_node, TLS_CA_FILE=str(tls_node / "other-ca.pem")):
        with pytest.raises(BrokerUnavailable) as caught:
            defer(record, 10, "/tmp/never", "x")
    message = str(caught.value)
    assert "certificate verify failed" in message and "TLS_CA_FILE" in message
    assert "guest:guest" not in message


def test_a_missing_client_certificate_fails(tls_node):
    with tls_settings(tls_node, TLS_CERT_FILE=None, TLS_KEY_FILE=None):
        with pytest.raises(BrokerUnavailable) as caught:
            defer(record, 10, "/tmp/never", "x")
    assert "localhost:5691" in str(caught.value)
    assert "requires a client certificate" in str(caught.value)


def test_the_system_cas_do_not_trust_the_test_ca(tls_node):
    # Verification is on by default: an amqps:// URL with no CA of its own
    # checks the broker against the system's CAs, which do not know ours.
    with override_settings(
        DEFERRED={**django_settings.DEFERRED, "BROKER_URL": URL, "PREFIX": "deferred-tls-test"}
    ):
        with pytest.raises(BrokerUnavailable, match="certificate verify failed"):
            defer(record, 10, "/tmp/never", "x")


def test_a_reset_during_the_tls_handshake_is_explained_as_the_tls_13_race():
    """What pika said once on Python 3.13 against RabbitMQ 4.3 with no client certificate:
    TLS 1.3 let the client send the AMQP header before the broker's alert arrived."""
    from deferred.broker.connection import _tls_hint

    reset = (
        "IncompatibleProtocolError: The protocol returned by the server is not supported: "
        "('StreamLostError: (\"Stream connection lost: ConnectionResetError(104, "
        "'Connection reset by peer')\",)',)"
    )
    assert "requires a client certificate" in _tls_hint(reset, tls=True)
    assert _tls_hint(reset, tls=False) == ""  # a plain AMQP reset is no TLS matter
    alert = "SSLError(1, '[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] ...')"
    assert "requires a client certificate" in _tls_hint(alert)
    assert _tls_hint("ConnectionRefusedError(111)") == ""
