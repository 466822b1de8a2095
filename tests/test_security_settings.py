"""Signing keys, size limit, TLS settings and the security checks: no broker needed."""

from __future__ import annotations

import pytest
from django.conf import settings as django_settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from deferred import broker, signing
from deferred.conf import get_settings
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
