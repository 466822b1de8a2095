"""Scenario 6: the designs deferred replaces, on the same machine and broker.

- one queue with per-message ``expiration``: head-of-line lateness;
- one queue per delay value with ``x-expires`` (the source article's fix):
  the queue count and the declare churn;
- a cron-style table scan: lateness and queries per job.
"""

from __future__ import annotations

import random
import sqlite3
import tempfile
import threading
import time
import uuid
from typing import Any

import pika

from bench.common import BROKER_URL, summary


def per_message_ttl(jobs: int, max_delay_s: float) -> dict[str, Any]:
    """Delays uniform in [0, max]: each waits behind every longer one sent before it."""
    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    channel = connection.channel()
    sink = channel.queue_declare("", exclusive=True).method.queue
    waiting = channel.queue_declare(
        "",
        exclusive=True,
        arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": sink},
    ).method.queue
    rng = random.Random(1)
    due: dict[str, float] = {}
    start = time.time()
    for n in range(jobs):
        delay = rng.uniform(0, max_delay_s)
        due[str(n)] = time.time() + delay
        channel.basic_publish(
            "", waiting, str(n).encode(), pika.BasicProperties(expiration=str(int(delay * 1000)))
        )
    lateness: list[float] = []
    order = []
    deadline = time.time() + max_delay_s * 3 + 10
    while len(lateness) < jobs and time.time() < deadline:
        method, _props, body = channel.basic_get(sink, auto_ack=True)
        if method is None:
            time.sleep(0.002)
            continue
        order.append(body.decode())
        lateness.append((time.time() - due[body.decode()]) * 1000)
    connection.close()
    in_due_order = sorted(order, key=lambda k: due[k])
    out_of_order = sum(1 for a, b in zip(order, in_due_order, strict=False) if a != b)
    return {
        "jobs": jobs,
        "max_delay_s": max_delay_s,
        "lateness_ms": summary(lateness),
        "out_of_order": out_of_order,
        "seconds": time.time() - start,
    }


def queue_per_delay(jobs: int, max_delay_s: float) -> dict[str, Any]:
    """One queue per due time (named by it), expiring itself once empty."""
    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    channel = connection.channel()
    sink = channel.queue_declare("", exclusive=True).method.queue
    rng = random.Random(2)
    tag = uuid.uuid4().hex[:6]
    due: dict[str, float] = {}
    queues = set()
    start = time.perf_counter()
    for n in range(jobs):
        delay_ms = int(rng.uniform(0, max_delay_s) * 1000)
        name = f"bench-delay-{tag}-{delay_ms}"
        if name not in queues:
            # Durable: RabbitMQ 4.3 can deny transient non-exclusive queues
            # (deprecated feature transient_nonexcl_queues); x-expires removes it.
            channel.queue_declare(
                name,
                durable=True,
                arguments={
                    "x-message-ttl": delay_ms,
                    "x-expires": delay_ms + 2000,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": sink,
                },
            )
            queues.add(name)
        due[str(n)] = time.time() + delay_ms / 1000
        channel.basic_publish("", name, str(n).encode())
    publish_s = time.perf_counter() - start
    lateness: list[float] = []
    deadline = time.time() + max_delay_s + 10
    while len(lateness) < jobs and time.time() < deadline:
        method, _props, body = channel.basic_get(sink, auto_ack=True)
        if method is None:
            time.sleep(0.002)
            continue
        lateness.append((time.time() - due[body.decode()]) * 1000)
    connection.close()
    return {
        "jobs": jobs,
        "queues_declared": len(queues),
        "queue_declares_per_job": len(queues) / jobs,
        "publish_per_s": jobs / publish_s,
        "lateness_ms": summary(lateness),
    }


def table_scan(jobs: int, max_delay_s: float, poll_s: float) -> dict[str, Any]:
    """A cron-style poller: every ``poll_s``, select the due rows, run, delete them."""
    path = tempfile.mkstemp(suffix=".sqlite3")[1]
    db = sqlite3.connect(path, check_same_thread=False)
    db.execute("CREATE TABLE job (id INTEGER PRIMARY KEY, due REAL NOT NULL)")
    db.execute("CREATE INDEX job_due ON job (due)")
    rng = random.Random(3)
    now = time.time()
    rows = [(n, now + rng.uniform(0, max_delay_s)) for n in range(jobs)]
    db.executemany("INSERT INTO job VALUES (?, ?)", rows)
    db.commit()
    lateness: list[float] = []
    queries = 0
    stop = threading.Event()
    end = now + max_delay_s + poll_s + 1

    def poll() -> None:
        nonlocal queries
        while not stop.is_set() and time.time() < end:
            moment = time.time()
            due = db.execute("SELECT id, due FROM job WHERE due <= ?", (moment,)).fetchall()
            queries += 1
            for _id, when in due:
                lateness.append((time.time() - when) * 1000)
            if due:
                db.executemany("DELETE FROM job WHERE id = ?", [(i,) for i, _ in due])
                db.commit()
                queries += 1
            stop.wait(poll_s)

    poller = threading.Thread(target=poll)
    poller.start()
    poller.join()
    db.close()
    return {
        "jobs": jobs,
        "poll_s": poll_s,
        "lateness_ms": summary(lateness),
        "queries": queries,
        "queries_per_job": queries / jobs,
        "ran": len(lateness),
    }
