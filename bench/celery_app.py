"""The Celery application the peer benchmark runs (bench only, not part of deferred).

One topic exchange and one queue, classic or quorum (``BENCH_CELERY_QUEUE_TYPE``).
With a quorum queue Celery 5.5+ switches countdowns to its native delayed
delivery (kombu's 28 binary levels of whole seconds); with a classic queue it
hands the message to a worker at once and the worker holds it until its ETA.
"""

import atexit
import os
import time

from celery import Celery
from kombu import Exchange, Queue

BROKER_URL = os.environ.get("DEFERRED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
QUEUE_TYPE = os.environ.get("BENCH_CELERY_QUEUE_TYPE", "classic")
QUEUE_NAME = f"bench_celery_{QUEUE_TYPE}"

app = Celery("bench_celery", broker=BROKER_URL)
exchange = Exchange("bench_celery_x", type="topic")
app.conf.update(
    task_queues=[
        Queue(
            QUEUE_NAME,
            exchange,
            routing_key=QUEUE_NAME,
            queue_arguments={"x-queue-type": QUEUE_TYPE} if QUEUE_TYPE == "quorum" else {},
        )
    ],
    task_default_queue=QUEUE_NAME,
    task_default_exchange=exchange.name,
    task_default_exchange_type="topic",
    task_default_routing_key=f"#.{QUEUE_NAME}",
    task_acks_late=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_seen: list[tuple[float, float]] = []


@app.task(name="bench.celery.ran")
def ran(due: float) -> None:
    now = time.time()
    _seen.append((now, (now - due) * 1000))


def _write() -> None:
    path = os.environ.get("BENCH_SEEN")
    if path and _seen:
        with open(path, "w") as f:
            f.writelines(f"{at:.6f} {late:.3f}\n" for at, late in _seen)


atexit.register(_write)
