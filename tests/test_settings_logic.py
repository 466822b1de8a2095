"""The DEFERRED setting: defaults, validation, and manage.py check."""

from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from deferred import conf
from deferred.backends import InvalidTaskBackend, RabbitMQBackend
from deferred.conf import get_settings
from deferred.core import parsers


def settings_for(**values):
    with override_settings(DEFERRED=values):
        return get_settings()


def test_defaults():
    s = settings_for()
    assert s.broker_urls == ("amqp://guest:guest@127.0.0.1:5672/%2F",)
    assert s.broker_url == s.broker_urls[0]
    assert s.prefix == "deferred"
    assert s.radix == 16
    assert s.resolution_ms == 1
    assert s.queue_type == "classic"
    assert s.queues == ("default",)
    assert s.declare is True
    assert s.max_delay_ms >= 366 * 24 * 3600 * 1000  # at least a year


def test_durations_as_timedelta_or_seconds():
    s = settings_for(MAX_DELAY=timedelta(days=30), RESOLUTION=0.01)
    assert s.max_delay_ms == 30 * 86_400_000
    assert s.resolution_ms == 10
    assert settings_for(MAX_DELAY=3600).max_delay_ms == 3_600_000


@pytest.mark.parametrize(
    "values",
    [
        {"RADIX": 1},
        {"RADIX": "2"},
        {"RADIX": True},
        {"RESOLUTION": 0.0005},
        {"RESOLUTION": timedelta(microseconds=1500)},
        {"MAX_DELAY": -1},
        {"MAX_DELAY": timedelta(days=3651)},
        {"MAX_DELAY": float("inf")},
        {"QUEUE_TYPE": "stream"},
        {"DELAY_QUEUE_TYPE": "stream"},
        {"QUEUE_TYPE": "quorum", "DELAY_QUEUE_TYPE": "classic"},
        {"WORKER_HEARTBEAT": 0},
        {"WORKER_HEARTBEAT": 1.5},
        {"WORKER_HEARTBEAT": timedelta(hours=1)},
        {"WORKER_HEARTBEAT": "5"},
        {"QUEUES": []},
        {"QUEUES": "default"},
        {"QUEUES": ["a.b"]},
        {"QUEUES": ["a", "a"]},
        {"PREFIX": ""},
        {"PREFIX": "has space"},
        {"BROKER_URL": "http://localhost"},
        {"DECLARE": "no"},
        {"DECLARE": 0},
        {"UNKNOWN": 1},
    ],
)
def test_bad_values_are_improperly_configured(values):
    with pytest.raises(ImproperlyConfigured):
        settings_for(**values)


def test_bad_values_show_in_manage_py_check():
    with override_settings(DEFERRED={"RADIX": 1}):
        errors = [e for e in run_checks() if e.id == "deferred.E001"]
    assert len(errors) == 1
    assert "RADIX" in errors[0].msg


def test_settings_are_cached_until_they_change():
    with override_settings(DEFERRED={"RADIX": 4}):
        assert get_settings() is get_settings()
        assert get_settings().radix == 4
    assert get_settings().radix == 16


def test_declare_off_is_a_setting():
    assert settings_for(DECLARE=False).declare is False
    with override_settings(DEFERRED={"DECLARE": None}):
        errors = [e for e in run_checks() if e.id == "deferred.E001"]
    assert len(errors) == 1 and "DECLARE" in errors[0].msg


def test_consumer_timeout_is_for_quorum_queues_in_whole_milliseconds():
    assert settings_for().consumer_timeout_ms is None
    s = settings_for(QUEUE_TYPE="quorum", CONSUMER_TIMEOUT=timedelta(hours=2))
    assert s.consumer_timeout_ms == 7_200_000
    assert settings_for(QUEUE_TYPE="quorum", CONSUMER_TIMEOUT=1.5).consumer_timeout_ms == 1500


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"CONSUMER_TIMEOUT": 60}, "quorum queues only.*consumer_timeout in rabbitmq.conf"),
        ({"QUEUE_TYPE": "quorum", "CONSUMER_TIMEOUT": 0.5}, "from 1 second to 24 days"),
        ({"QUEUE_TYPE": "quorum", "CONSUMER_TIMEOUT": timedelta(days=25)}, "24 days"),
        ({"QUEUE_TYPE": "quorum", "CONSUMER_TIMEOUT": "1h"}, "timedelta or a number"),
    ],
)
def test_a_bad_consumer_timeout_says_what_is_wanted(values, says):
    with pytest.raises(ImproperlyConfigured, match=says):
        settings_for(**values)


def test_the_delay_queues_follow_queue_type_unless_told_and_the_heartbeat_is_whole_seconds():
    assert settings_for().delay_queue_type == "classic"
    assert settings_for(QUEUE_TYPE="quorum").delay_queue_type == "quorum"
    assert settings_for(DELAY_QUEUE_TYPE="quorum").delay_queue_type == "quorum"
    assert settings_for().worker_heartbeat_s == 5
    assert settings_for(WORKER_HEARTBEAT=timedelta(seconds=2)).worker_heartbeat_s == 2
    assert settings_for(WORKER_HEARTBEAT=1).worker_heartbeat_s == 1


def test_adding_a_setting_is_one_row():
    # A table with one more row (a field of DeferredSettings) and nothing else:
    @dataclass(frozen=True, kw_only=True)
    class WithGreeting(conf.DeferredSettings):
        greeting: str = conf.setting(
            "GREETING", "hello", parsers.prefix, conf.WORKER, "What the worker says first."
        )

    # its default, its parser and its unknown-key check all come from the row.
    assert conf._build({}, WithGreeting).greeting == "hello"  # type: ignore[attr-defined]
    built = conf._build({"GREETING": "hi", "RADIX": 4}, WithGreeting)
    assert (built.greeting, built.radix) == ("hi", 4)  # type: ignore[attr-defined]
    with pytest.raises(ImproperlyConfigured, match=r"DEFERRED\['GREETING'\] must be 1-100"):
        conf._build({"GREETING": "has space"}, WithGreeting)
    with pytest.raises(ImproperlyConfigured, match="Unknown key in DEFERRED: GREETING"):
        conf._build({"GREETING": "hi"})


def test_every_row_parses_its_own_default():
    # The defaults are written as a project writes them (timedeltas, lists), and each
    # row's parser takes its own: a row whose default it refuses would break every project.
    for row in conf.SETTINGS:
        row.parse(f"DEFERRED[{row.key!r}]", row.default)
    assert conf.DEFAULTS["PUBLISH_TIMEOUT"] == timedelta(seconds=10)
    assert settings_for().publish_timeout_s == 10


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("ON_COMMIT", "yes", "must be True or False, got 'yes'"),
        ("MAX_RETRIES", -1, "MAX_RETRIES"),
        ("RETRY_BACKOFF", {"base": -1}, "RETRY_BACKOFF"),
        ("TIME_LIMIT", "1h", "TIME_LIMIT"),
    ],
)
def test_the_backend_options_say_what_the_setting_says(key, value, says):
    # The django.tasks backend's OPTIONS parse with the settings' own rows: the same
    # value is refused with the same words, under the option's name.
    with pytest.raises(ImproperlyConfigured, match=says) as setting_error:
        settings_for(**{key: value})
    with pytest.raises(InvalidTaskBackend) as option_error:
        RabbitMQBackend("jobs", {"OPTIONS": {key: value}})
    option_words = str(option_error.value).replace("TASKS['jobs']['OPTIONS']", "DEFERRED")
    assert option_words == str(setting_error.value)


@pytest.mark.parametrize("empty", ["", False, 0, None])
def test_an_empty_delay_queue_type_follows_queue_type(empty):
    # An unset environment variable read as "" means "as QUEUE_TYPE", as None does.
    assert settings_for(DELAY_QUEUE_TYPE=empty).delay_queue_type == "classic"
    assert settings_for(QUEUE_TYPE="quorum", DELAY_QUEUE_TYPE=empty).delay_queue_type == "quorum"


@pytest.mark.parametrize(
    ("values", "says"),
    [
        # What does not apply is said first, whatever else is wrong with the value.
        ({"CONSUMER_TIMEOUT": 0.5}, "quorum queues only"),
        ({"CONSUMER_TIMEOUT": "1h"}, "quorum queues only"),
        ({"SIGNING_KEY_FALLBACKS": "old"}, r"needs DEFERRED\['SIGNING_KEY'\]"),
        ({"SIGNING_KEY_FALLBACKS": [""]}, r"needs DEFERRED\['SIGNING_KEY'\]"),
        ({"FOO": 1}, r"Unknown key in DEFERRED: FOO\."),
        ({"FOO": 1, "BAR": 2}, r"Unknown keys in DEFERRED: BAR, FOO\."),
    ],
)
def test_a_setting_that_does_not_apply_says_so_first(values, says):
    with pytest.raises(ImproperlyConfigured, match=says):
        settings_for(**values)
