"""The soak's producer: ``defer()`` from threads at a steady rate, every call written down.

python -m bench.soak_producer --calls FILE --rate 150 --producers 4 --seconds 180
                              [--delays 0-10] [--long-share 0.05] [--long 30-90] [--seed S]

``bench.soak`` starts it as a process of its own (the bench settings and the
soak's PREFIX in its environment), so that a call blocked by a broker fault
stalls no one but its thread. Each thread keeps its pace without catching up:
calls a fault held back are not made later in a burst.

One JSON line a call, appended with one ``os.write`` (nothing is lost if the
process is killed): ``id``, ``due`` (the time before the call plus the delay:
``defer()`` reads the clock a moment later and rounds up, so the job's due time
is never before it), ``called``, ``returned``, ``delay`` and ``outcome``: ``"ok"``,
or ``"raised"`` with ``error`` (the exception's class) and the exception's
``job_id`` as ``id`` (the broker may have taken that job all the same).
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

from bench.soak import append, span


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak_producer")
    parser.add_argument("--calls", type=Path, required=True)
    parser.add_argument("--rate", type=float, default=150.0)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--delays", type=span, default=(0.0, 10.0))
    parser.add_argument("--long-share", type=float, default=0.05)
    parser.add_argument("--long", type=span, default=(30.0, 90.0))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    from bench.tasks import soak_record
    from deferred import defer

    until = time.time() + args.seconds
    period = args.producers / args.rate

    def loop(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        pace, n = time.monotonic(), 0
        while time.time() < until:
            long = rng.random() < args.long_share
            delay = rng.uniform(*(args.long if long else args.delays))
            called = time.time()
            record: dict[str, Any] = {"due": called + delay, "delay": delay, "called": called}
            try:
                record["id"] = defer(soak_record, delay, index * 1_000_000 + n)
                record["outcome"] = "ok"
            except Exception as exc:  # noqa: BLE001 - every outcome is history
                record["id"] = getattr(exc, "job_id", None)
                record.update(outcome="raised", error=type(exc).__name__, message=str(exc)[:300])
            record.update(returned=time.time(), thread=index)
            append(args.calls, record)
            n += 1
            pace = max(pace + period, time.monotonic())
            time.sleep(max(0.0, pace - time.monotonic()))

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(args.producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
