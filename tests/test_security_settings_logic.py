"""Signing keys, size limit, TLS settings and the security checks: no broker needed."""

from __future__ import annotations

import json

import pytest
from django.conf import settings as django_settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from deferred import broker
from deferred.conf import get_settings
from deferred.core import signing
from deferred.testing import capture
from tests.testapp.tasks import record


def deferred_settings(**changes):
    return override_settings(DEFERRED={**django_settings.DEFERRED, **changes})


def test_the_key_is_derived_from_secret_key_with_our_salt_and_fallbacks_verify():
    body = b'{"a": 1}'
    with override_settings(SECRET_KEY="new-key", SECRET_KEY_FALLBACKS=["old-key"]):
        keys = get_settings().signing_keys
        assert keys == ("new-key", "old-key")
        # Signed with the current key; a job signed with the old one still verifies,
        signing.verify(body, signing.sign(body, keys), keys)
        signing.verify(body, signing.sign(body, ("old-key",)), keys)
        # one signed with a key that is neither does not,
        with pytest.raises(signing.BadSignature):
            signing.verify(body, signing.sign(body, ("other",)), keys)
    # and our salt differs from Django's other uses of the same secret.
    from django.utils.crypto import salted_hmac

    plain = salted_hmac("django.core.signing", body, secret="new-key", algorithm="sha256")
    assert signing.sign(body, ("new-key",))[signing.HEADER] != f"hmac-sha256:{plain.hexdigest()}"


def test_signing_key_overrides_secret_key():
    with override_settings(SECRET_KEY="web-secret"):
        with deferred_settings(SIGNING_KEY="jobs-key", SIGNING_KEY_FALLBACKS=["jobs-old"]):
            assert get_settings().signing_keys == ("jobs-key", "jobs-old")
            assert "jobs-key" not in repr(get_settings())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"SIGNING": "yes"}, "SIGNING"),
        ({"SIGNING_KEY": ""}, "SIGNING_KEY"),
        ({"SIGNING_KEY": 12}, "SIGNING_KEY"),
        ({"SIGNING_KEY_FALLBACKS": ["x"]}, "FALLBACKS.. needs DEFERRED"),
        ({"SIGNING_KEY": "k", "SIGNING_KEY_FALLBACKS": "old"}, "list of keys"),
        ({"MAX_MESSAGE_BYTES": 10}, "MAX_MESSAGE_BYTES"),
        ({"MAX_MESSAGE_BYTES": 1024.5}, "MAX_MESSAGE_BYTES"),
        ({"MAX_MESSAGE_BYTES": 10**10}, "MAX_MESSAGE_BYTES"),
        ({"TLS_CA_FILE": "/nonexistent/ca.pem"}, "no such file"),
        ({"TLS_CA_FILE": 3}, "TLS_CA_FILE"),
    ],
)
def test_bad_security_settings_are_refused(changes, message):
    with deferred_settings(**changes), pytest.raises(ImproperlyConfigured, match=message):
        get_settings()


def test_tls_settings_need_amqps_and_a_key_with_the_certificate(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not read here")
    with deferred_settings(TLS_CA_FILE=str(ca)), pytest.raises(ImproperlyConfigured, match="amqps"):
        get_settings()
    with (
        deferred_settings(BROKER_URL="amqps://u:p@rabbit.example:5671/%2F", TLS_CERT_FILE=str(ca)),
        pytest.raises(ImproperlyConfigured, match="go together"),
    ):
        get_settings()
    with deferred_settings(
        BROKER_URL="amqps://u:p@rabbit.example:5671/%2F",
        TLS_CA_FILE=str(ca),
        TLS_SERVER_NAME="rabbit.internal",
    ):
        url = get_settings().broker_urls[0]
        assert "ssl_options" in url
        # Never shown: not in the settings' repr, nor in the address used in messages.
        assert broker.safe_url(url) == "rabbit.example:5671/"
        assert "u:p" not in repr(get_settings())


def test_the_url_ssl_options_keep_verification_on(tmp_path):
    import ssl

    params = broker.parameters("amqps://u:p@rabbit.example/%2F")
    assert params.ssl_options.context.verify_mode == ssl.CERT_REQUIRED
    url = "amqps://u:p@rabbit.example/%2F?ssl_options=" + repr({"server_hostname": "other"})
    params = broker.parameters(url)
    assert params.ssl_options.context.verify_mode == ssl.CERT_REQUIRED
    assert params.ssl_options.context.check_hostname
    assert params.ssl_options.server_hostname == "other"
    assert broker.parameters("amqp://u:p@rabbit.example/%2F").ssl_options is None


def test_defer_refuses_a_body_over_the_limit_and_publishes_nothing():
    with deferred_settings(MAX_MESSAGE_BYTES=2048), capture() as jobs:
        with pytest.raises(ValueError, match="MAX_MESSAGE_BYTES"):
            record.defer(10, "/tmp/x", "y" * 4000)
        assert jobs == []
        record.defer(10, "/tmp/x", "y" * 1000)
        assert len(jobs) == 1


def _ids(**kwargs):
    return {m.id for m in run_checks(**kwargs) if m.id and m.id.startswith("deferred.")}


def test_checks_warn_when_signing_is_off_in_production():
    with deferred_settings(SIGNING=False), override_settings(DEBUG=False):
        assert "deferred.W001" in _ids()
    with deferred_settings(SIGNING=False), override_settings(DEBUG=True):
        assert "deferred.W001" not in _ids()
    assert "deferred.W001" not in _ids()


def test_deploy_checks_warn_about_guest_and_clear_text_off_this_host():
    with deferred_settings(BROKER_URL="amqp://guest:guest@rabbit.example:5672/%2F"):
        found = [m for m in run_checks(include_deployment_checks=True) if m.id]
        ids = {m.id for m in found}
        assert {"deferred.W002", "deferred.W003"} <= ids
    with deferred_settings(BROKER_URL="amqps://app:s3cr3t-pw@rabbit.example:5671/%2F"):
        found = [m for m in run_checks(include_deployment_checks=True) if m.id]
        assert not {"deferred.W002", "deferred.W003"} & {m.id for m in found}
        assert all("s3cr3t-pw" not in str(m.msg) for m in found)
    # Loopback is fine either way (the default URL), and plain `check` says nothing of it.
    assert not {"deferred.W002", "deferred.W003"} & _ids(include_deployment_checks=True)
    with deferred_settings(BROKER_URL="amqp://guest:guest@rabbit.example:5672/%2F"):
        assert not {"deferred.W002", "deferred.W003"} & _ids()


@pytest.mark.parametrize("prefix", ["deferred", "app.v2"])
def test_the_role_regexes_match_exactly_the_names_they_should(prefix):
    import re

    from deferred.core.topology import build_plan
    from deferred.operate import permissions

    plans = [
        build_plan(
            prefix=prefix,
            radix=radix,
            resolution_ms=resolution,
            max_delay_ms=86_400_000 * 400,
            queue_type=kind,
            queues=("default", "mail_out-2"),
            hold_window_ms=window,
        )
        for radix, resolution, kind, window in (
            (16, 1, "classic", 256),
            (16, 1, "classic", 0),
            (2, 1000, "quorum", 0),
        )
    ]
    assert plans[0].topology_id.endswith(".H2.classic")  # the held levels are in the names
    ours = {e.name for p in plans for e in p.all_exchanges} | {
        q.name for p in plans for q in p.all_queues
    }
    nested = {name.replace(f"{prefix}.", f"{prefix}.staging.", 1) for name in ours}
    ingest = {p.ingest_exchange for p in plans}
    publisher, worker, admin = (permissions.for_role(r, prefix) for r in permissions.ROLES)

    def matching(regex: str, names: set[str]) -> set[str]:
        return {n for n in names if re.match(regex, n)}

    assert matching(publisher.write, ours | nested) == ingest
    # A web process reads results (deferred.result()), for a task not started yet the
    # ledger (get_result()), and to list pending jobs the cancels and the ledger's
    # checkpoints (deferred.pending()): those streams, nothing else.
    assert matching(publisher.read, ours | nested) == {
        f"{prefix}.{name}"
        for name in ("results", "ledger", "cancels", "ledger-pages", "ledger-heads")
    }
    assert matching(publisher.configure, ours) == set()
    assert matching(worker.write, ours | {"amq.default"}) == ingest | {"amq.default"}
    assert matching(worker.read, ours | nested) == ours
    assert matching(worker.configure, ours) == set()
    assert matching(admin.configure, ours | nested) == ours
    assert matching(admin.write, ours | nested | {"amq.default"}) == ours | {"amq.default"}


def test_a_record_signed_by_a_worker_is_trusted_and_one_written_by_hand_is_not():
    from deferred.records import failures
    from tests.conftest import record_job

    job = record_job("/tmp/x", "y")
    body = json.dumps(failures.failure_record(reason="task_error", job=job, body=job.encode()))
    keys = get_settings().signing_keys
    headers = signing.sign(body.encode(), keys)
    assert failures.parse_failed(body.encode(), headers, job.id, keys).trusted
    assert not failures.parse_failed(body.encode(), {}, job.id, keys).trusted
    assert not failures.parse_failed(body.encode() + b" ", headers, job.id, keys).trusted
    # Not checked (signing off): trusted as before.
    assert failures.parse_failed(body.encode(), {}, job.id, None).trusted


@pytest.mark.parametrize(
    "value",
    [
        ["amqp://u:Pw-in-error-1@h1:5672/%2F", "amqp://u:Pw-in-error-1@h1:5672/%2F"],
        ["amqp://u:Pw-in-error-1@h1:5672/a", "amqp://u:Pw-in-error-1@h2:5672/b"],
        "http://u:Pw-in-error-1@h1:5672/%2F",
    ],
)
def test_setting_errors_never_show_a_password(value):
    with deferred_settings(BROKER_URL=value), pytest.raises(ImproperlyConfigured) as caught:
        get_settings()
    assert "Pw-in-error-1" not in str(caught.value) and "u:***@h1" in str(caught.value)
    with deferred_settings(MANAGEMENT_URL=["ftp://u:Pw-in-error-1@h1/"]):
        messages = [str(m) for m in run_checks()]
    assert messages and not any("Pw-in-error-1" in m for m in messages)
