"""Scenario 1, the ceiling: pika alone publishing and consuming the same payload."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pika

from bench.common import BROKER_URL

PAYLOAD = (
    b'{"version":1,"id":"0123456789abcdef0123456789abcdef","task":"bench.noop","args":[1],'
    b'"kwargs":{},"due":"2026-01-01T00:00:00+00:00","attempt":1,"queue":"default",'
    b'"created":"2026-01-01T00:00:00+00:00"}'
)


def run(n: int) -> dict[str, Any]:
    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    channel = connection.channel()
    queue = f"deferred-bench-raw-{uuid.uuid4().hex[:8]}"
    channel.queue_declare(queue, durable=True)
    props = pika.BasicProperties(delivery_mode=2, content_type="application/json")
    try:
        start = time.perf_counter()
        for _ in range(n):
            channel.basic_publish("", queue, PAYLOAD, props)
        connection.process_data_events(0)
        no_confirm = n / (time.perf_counter() - start)

        confirming = connection.channel()
        confirming.confirm_delivery()
        m = max(1, n // 4)
        start = time.perf_counter()
        for _ in range(m):
            confirming.basic_publish("", queue, PAYLOAD, props, mandatory=True)
        confirm_each = m / (time.perf_counter() - start)

        total = n + m
        channel.basic_qos(prefetch_count=100)
        received = 0
        start = time.perf_counter()
        for method, _props, _body in channel.consume(queue, inactivity_timeout=5):
            if method is None:
                break
            received += 1
            channel.basic_ack(method.delivery_tag)
            if received == total:
                break
        channel.cancel()
        consume_ack = received / (time.perf_counter() - start)
    finally:
        channel.queue_delete(queue)
        connection.close()
    return {
        "messages": n,
        "publish_no_confirm_per_s": no_confirm,
        "publish_confirm_each_per_s": confirm_each,
        "consume_ack_prefetch100_per_s": consume_ack,
    }
