"""The notices a process says once in a while (deferred.core.notices), without a broker."""

from __future__ import annotations

import logging

import pytest

from deferred.broker import TopologyNotDeclared
from deferred.core import notices


@pytest.fixture(autouse=True)
def fresh():
    notices.forget()
    yield
    notices.forget()


def missing(name: str) -> TopologyNotDeclared:
    return TopologyNotDeclared(
        f"Queue {name!r} does not exist (NOT_FOUND - no queue {name!r} in vhost '/'). Run "
        "`python manage.py declare_delay_topology` (once per deploy) to create it; ..."
    )


def test_said_once_per_interval_whichever_thread_meets_it(caplog):
    caplog.set_level(logging.DEBUG, logger="deferred")
    assert notices.topology_missing(missing("p.ready.default"), now=100.0)
    assert not notices.topology_missing(missing("p.keeper"), now=101.0)
    assert not notices.topology_missing(missing("p.cancels"), now=100.0 + notices.REPEAT_S - 1)
    assert notices.topology_missing(missing("p.keeper"), now=100.0 + notices.REPEAT_S)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2
    assert "queue 'p.ready.default' is missing" in errors[0]
    assert all(len(e) < 200 and "declare_delay_topology" in e for e in errors)


def test_forget_says_it_again_at_once():
    assert notices.topology_missing(missing("a"), now=0.0)
    notices.forget()
    assert notices.topology_missing(missing("a"), now=1.0)


@pytest.mark.parametrize(
    "text, name",
    [
        ("NOT_FOUND - no exchange 'x.delay.ingest' in vhost '/'", "exchange 'x.delay.ingest'"),
        ("Queue 'x.ready' does not exist. Run it.", "queue 'x.ready'"),
        ("Something else. Entirely.", "Something else"),
    ],
)
def test_the_missing_name_is_read_from_the_brokers_words(text, name):
    assert notices.missing_name(text) == name
