"""Results: what ``deferred.result()`` costs, and what writing results costs a worker.

python -m bench.results [--only lookup,day,throughput] [--out FILE]
    lookup:     [--seconds 240] [--lookup-rate 3] [--lookups-from 40] [--fill-at 120]
                [--hour-records 360000] [--cache redis://127.0.0.1:6379/5]
    day:        [--day-records 8640000] [--max-write-s 420] [--lookups 15]
    throughput: [--rates 500,1000] [--rate-seconds 20] [--rounds 2] [--backlog 20000]
                [--concurrency 4] [--cache redis://127.0.0.1:6379/5]

Why: results have no table. Workers append each job's records to the stream
``PREFIX.results``; ``result(job_id)`` seeks that stream by timestamp to the
job's due time (carried by its id) and reads forward to its final record. So a
look-up costs what a table would not: the broker's seek by timestamp (more
stream behind the job, more segments to pass over) and the read of what other
jobs wrote between the job's due time and its end. And every job's outcome is
a confirmed write before its ack, which a worker without results does not make.
Each part runs on its own in under ten minutes; each starts with the broker's
raw limits, measured in the same run.

- ``lookup``: a real worker (``run_deferred_worker``, the ``bench/e2e``
  harness) runs 100 jobs/s steadily with results on; from the 40th second a
  process of its own, as a web view, looks up a random finished job (due at
  least 5 s before) 3 times a second with ``deferred.result()``, and every
  third time reads the same job with pika alone (connect, subscribe from the
  same timestamp, read to the job's record, close: the broker's floor), with
  the library's credit and with a larger one. At the 120th second an hour of
  other jobs' records (360,000, batched as a worker batches them) goes into
  the stream at once, look-ups paused: the jobs that finished before it then
  lie an hour of stream back, as a job that finished an hour ago does; after
  it the look-ups alternate between those and the jobs finished since. CPU of
  the broker, the worker and the looker, without look-ups and with them. With
  ``--cache URL``, the worker and the looker share a Redis cache as
  ``RESULT_CACHE``.
- ``day``: a job that finished a day ago, emulated. What such a look-up pays
  is the seek through a day of stream and the read from the job's due time to
  its end. The job's segment is filled as a worker fills it (one message a
  chunk, each confirmed before the next) to near its end, the far end of the
  broker's index scan within a segment; the seconds around the job carry 100
  jobs/s of other records through the workers' own writer, and more than a
  look-up's credit of messages follow it one a chunk; then 8.64 million other
  records (a day at 100 jobs/s) follow as fast as the broker takes them, in
  messages of the sizes a worker writes at 100 jobs/s (packed by the broker
  into fewer, larger chunks than a worker's: fewer segments, which
  :func:`extrapolate` corrects for). The job is looked up before and at points
  along the day, and a job that finished just now is looked up at the end.
  The stream is deleted afterwards.
- ``throughput``: the same worker with results on and with ``RESULTS=False``,
  taking turns at each offered rate (``bench.capacity``'s points: delays 0-3 s,
  concurrency 4, a fresh topology each), then each draining a backlog of due
  jobs as fast as it can; worker and broker CPU beside each.

The figures, with their commands: ``docs/bench/capacity.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pika
import pika.exceptions

from bench.common import BROKER_URL, broker_data_dir, broker_pids, cpu_seconds, percentile
from deferred.broker.results import READ_CREDIT

ROOT = Path(__file__).resolve().parent.parent
#: The steady load of the look-up parts: jobs/s through one worker.
LOAD_RATE = 100.0
#: How many look-ups a second the "web view" makes (a third as many raw reads beside).
LOOKUP_RATE = 3.0
#: A job is looked up once its due time is this far behind: it has finished.
MIN_AGE_S = 5.0
#: An hour, and a day, of records at 100 jobs/s (one final record a job).
HOUR_RECORDS = 360_000
DAY_RECORDS = 8_640_000
#: How a worker at 100 jobs/s batches its records into stream messages: the share
#: of messages carrying 1, 2, ... records (25: 16 or more, 25 on average), as
#: ``--only lookup`` measured it with ``LINGER_S`` 50 ms (6.8 records a message),
#: which reports it again for its own run.
BATCHES = {
    1: 0.013, 2: 0.035, 3: 0.075, 4: 0.118, 5: 0.156, 6: 0.16, 7: 0.136, 8: 0.103,
    9: 0.068, 10: 0.05, 11: 0.022, 12: 0.016, 13: 0.009, 14: 0.006, 15: 0.005, 25: 0.028,
}  # fmt: skip
#: Distinct pre-signed messages per batch size, which the bulk writes take turns with.
POOL = 2048
#: Bulk writes: one confirmed message every so many, so the writer does not run
#: far ahead of the broker.
SYNC_EVERY = 5000
#: The results stream's segments (``x-stream-max-segment-size-bytes``).
SEGMENT_BYTES = 16_000_000
#: The look-up parts' worker: concurrency 4, delays uniform in 0-3 s (as bench.capacity).
LOW_S, HIGH_S = 0.0, 3.0
#: The emulated job: lateness and run time, as measured at 100 jobs/s.
LATE_S, RUN_S = 0.010, 0.0005


def record(job_id: str, at: float, worker: str, started: float | None = None) -> dict[str, Any]:
    """The one record a worker writes for a short job that succeeded and returned
    ``None``: its "started" folded in (``st``, ``w``)."""
    return {
        "id": job_id,
        "ev": "succeeded",
        "at": at,
        "a": 1,
        "task": "e2e.note",
        "st": at - RUN_S if started is None else started,
        "w": worker,
        "value": None,
    }


Sign = Callable[[bytes], dict[str, Any]]


def signer() -> Sign:
    """Sign as the workers do, with the jobs' key of the configured project."""
    from deferred.conf import get_settings
    from deferred.core import signing

    keys = get_settings().signing_keys
    return lambda body: signing.sign(body, keys)


def _properties(headers: dict[str, Any]) -> pika.BasicProperties:
    return pika.BasicProperties(
        content_type="application/json",
        delivery_mode=2,
        message_id=uuid.uuid4().hex,
        headers=headers or None,
    )


def _pool(sign: Sign, rng: random.Random) -> dict[int, list[tuple[bytes, Any]]]:
    """Signed stream messages of each batch size, other jobs' records in each."""
    from deferred.core.jobs import new_job_id
    from deferred.records.result_format import encode

    now = time.time()
    pool: dict[int, list[tuple[bytes, Any]]] = {}
    for size in BATCHES:
        messages = []
        for _ in range(POOL):
            records = []
            for _ in range(size):
                due = datetime.fromtimestamp(now - rng.uniform(0.005, 0.05), UTC)
                records.append(record(new_job_id(due), now, "bench:bulk"))
            body = encode(records)
            messages.append((body, _properties(sign(body))))
        pool[size] = messages
    return pool


@dataclass
class Written:
    """What a bulk write put in the stream."""

    records: int = 0
    messages: int = 0
    #: Time spent writing, checkpoints left out.
    seconds: float = 0.0
    capped: bool = False
    #: Times the connection was lost and opened again.
    reconnects: int = 0

    @property
    def per_s(self) -> float:
        return self.messages / self.seconds if self.seconds else float("nan")


class _Channels:
    """A connection with a plain channel and a confirming one, opened again should the
    broker close it (a ``rabbitmqctl close_all_connections`` of another client on a
    shared broker): a message lost with it is one record fewer, no more."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.reconnects = 0
        self._open()

    def _open(self) -> None:
        self.connection = pika.BlockingConnection(pika.URLParameters(self.url))
        self.plain = self.connection.channel()
        self.confirming = self.connection.channel()
        self.confirming.confirm_delivery()

    def publish(self, stream: str, body: bytes, props: Any, confirmed: bool) -> None:
        for attempt in range(10):
            try:
                (self.confirming if confirmed else self.plain).basic_publish(
                    "", stream, body, props
                )
                return
            except pika.exceptions.AMQPError:
                if attempt == 9:
                    raise
                self.reconnects += 1
                _close(self.connection)
                time.sleep(0.5)
                try:
                    self._open()
                except pika.exceptions.AMQPError:
                    continue

    def close(self) -> None:
        _close(self.connection)


def write_bulk(
    url: str,
    stream: str,
    sign: Sign,
    records: int,
    *,
    checkpoints: Sequence[int] = (),
    on_checkpoint: Callable[[Written], None] | None = None,
    max_seconds: float | None = None,
    seed: int = 0,
) -> Written:
    """Write ``records`` other jobs' records to ``stream`` as fast as the broker takes
    them, in messages of :data:`BATCHES`' sizes; call ``on_checkpoint`` (once all
    before it is confirmed) as the count passes each of ``checkpoints``. Stops at
    ``max_seconds`` of writing, if given (``capped``)."""
    rng = random.Random(seed)
    pool = _pool(sign, rng)
    sizes = rng.choices(list(BATCHES), weights=list(BATCHES.values()), k=65_536)
    channels = _Channels(url)
    out = Written()
    pending = sorted(checkpoints)
    try:
        start = time.monotonic()
        while out.records < records:
            if max_seconds is not None and out.seconds + time.monotonic() - start > max_seconds:
                out.capped = True
                break
            size = sizes[out.messages % len(sizes)]
            body, props = pool[size][out.messages % POOL]
            # A confirmed one now and then: the writer waits for the broker.
            channels.publish(stream, body, props, (out.messages + 1) % SYNC_EVERY == 0)
            out.records += size
            out.messages += 1
            if pending and out.records >= pending[0] and on_checkpoint is not None:
                while pending and out.records >= pending[0]:
                    pending.pop(0)
                body, props = pool[1][0]
                channels.publish(stream, body, props, True)
                out.records += 1
                out.messages += 1
                out.seconds += time.monotonic() - start
                out.reconnects = channels.reconnects
                on_checkpoint(out)
                start = time.monotonic()
        out.seconds += time.monotonic() - start
    finally:
        channels.close()
    out.reconnects = channels.reconnects
    return out


def write_confirmed(
    url: str, stream: str, sign: Sign, until: Callable[[int], bool], seed: int = 1
) -> Written:
    """Messages of :data:`BATCHES`' sizes, each confirmed before the next: one
    message a chunk, as a worker at 100 jobs/s writes them; until ``until(messages)``."""
    rng = random.Random(seed)
    pool = _pool(sign, rng)
    sizes = rng.choices(list(BATCHES), weights=list(BATCHES.values()), k=65_536)
    channels = _Channels(url)
    out = Written()
    try:
        start = time.monotonic()
        while not until(out.messages):
            size = sizes[out.messages % len(sizes)]
            body, props = pool[size][out.messages % POOL]
            channels.publish(stream, body, props, True)
            out.records += size
            out.messages += 1
        out.seconds = time.monotonic() - start
    finally:
        channels.close()
    out.reconnects = channels.reconnects
    return out


class Trickle:
    """What a worker running ``rate`` jobs/s writes: a record at each job's end, the
    ends at random (Poisson), through the workers' own writer, which batches them
    as it batches a worker's."""

    def __init__(self, urls: Sequence[str], exchange: str, sign: Sign, rate: float = LOAD_RATE):
        from deferred.broker import ResultWriter
        from deferred.core.topology import RESULT_ROUTING_KEY
        from deferred.records.result_format import encode

        def encoded(records: list[Any]) -> tuple[bytes, dict[str, Any]]:
            body = encode(records)
            return body, sign(body)

        self.writer = ResultWriter(tuple(urls), exchange, RESULT_ROUTING_KEY, encoded, timeout=10.0)
        self.rate = rate
        self.records = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-trickle", daemon=True)

    def start(self) -> None:
        self.writer.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.writer.stop()

    def _run(self) -> None:
        from deferred.core.jobs import new_job_id

        rng = random.Random(2)
        at = time.monotonic()
        while True:
            at += rng.expovariate(self.rate)
            if self._stop.wait(max(0.0, at - time.monotonic())):
                return
            now = time.time()
            due = datetime.fromtimestamp(now - LATE_S - RUN_S, UTC)
            self.writer.write(record(new_job_id(due), now, "bench:trickle"))
            self.records += 1

    def job(self) -> str:
        """A job due now that runs ``LATE_S`` late for ``RUN_S``: its record goes out
        with the others' (confirmed on return). Its id."""
        from deferred.core.jobs import new_job_id, utcnow

        job_id = new_job_id(utcnow())
        time.sleep(LATE_S)
        started = time.time()
        time.sleep(RUN_S)
        written = self.writer.write(record(job_id, time.time(), "bench:target", started))
        if not written.wait(10):
            raise RuntimeError("the emulated job's record was not confirmed")
        return job_id


#: The credit a look-up gives the broker, as ``deferred.broker.results.ResultReader`` sets it.
LIBRARY_PREFETCH = READ_CREDIT
#: A larger credit (the library's before), read beside it to show what the credit costs.
OTHER_PREFETCH = 100


@dataclass
class Read:
    """One raw read of the stream."""

    #: From connecting to closed, ms.
    ms: float
    #: From subscribing to the first delivery, ms.
    first_ms: float | None = None
    first_offset: int | None = None
    #: The offset of the message holding the job's record, if one was looked for.
    found_offset: int | None = None
    #: Messages delivered until then.
    messages: int = 0


def raw_read(
    url: str,
    stream: str,
    since: datetime | int | str,
    job_id: str | None = None,
    prefetch: int = LIBRARY_PREFETCH,
    count: int = 1,
) -> Read:
    """A raw look-up with pika alone: connect, subscribe to ``stream`` from ``since``
    with ``prefetch`` credit (acked as it comes, as the library's reader does), read
    up to the message holding ``job_id``'s record (else ``count`` messages), close.
    The broker's floor for what ``result()`` does."""
    start = time.perf_counter()
    connection = pika.BlockingConnection(pika.URLParameters(url))
    marker = None if job_id is None else json.dumps(job_id).encode()
    out = Read(ms=0.0)
    tag = 0

    def done() -> bool:
        return out.found_offset is not None if marker else out.messages >= count

    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=prefetch)

        def deliver(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            nonlocal tag
            tag = method.delivery_tag
            if done():
                return
            offset = (props.headers or {}).get("x-stream-offset")
            if out.first_ms is None:
                out.first_ms = (time.perf_counter() - subscribed) * 1000
                out.first_offset = offset
            out.messages += 1
            if marker is not None and marker in body:
                out.found_offset = offset

        subscribed = time.perf_counter()
        channel.basic_consume(stream, deliver, arguments={"x-stream-offset": since})
        deadline = start + 30
        while not done() and time.perf_counter() < deadline:
            connection.process_data_events(time_limit=0.05)
            if tag:
                channel.basic_ack(tag, multiple=True)
                tag = 0
    finally:
        _close(connection)
    out.ms = (time.perf_counter() - start) * 1000
    return out


def _close(connection: Any) -> None:
    """Close a connection with a stream consumer: pika rejects what is still on its way,
    which a stream refuses by closing the connection (the library's reader closes the
    same way)."""
    try:
        connection.close()
    except pika.exceptions.AMQPError:
        pass


class PikaErrors(logging.Handler):
    """Counts pika's ERROR log lines by what the process was doing (``doing``): a read
    whose connection the broker closes (pika rejected a delivery still on its way,
    which a stream refuses) logs one in the calling process."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.doing = ""
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[self.doing] += 1

    @classmethod
    def install(cls) -> PikaErrors:
        handler = cls()
        logging.getLogger("pika").addHandler(handler)
        return handler


def stats(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else float("nan"),
    }


# ---------------------------------------------------------------------- the broker


def stream_disk(stream: str, base: Path | None) -> dict[str, Any] | None:
    """The stream's files on disk: bytes, segments, and each segment's first offset
    (``None`` where the broker's data directory cannot be read)."""
    if base is None:
        return None
    # RabbitMQ 3.x names a stream's directory __<vhost>_<name>_<n>, with every
    # character but letters, digits, "_" and "-" made "_" (vhost "/": "_").
    name = re.sub(r"[^a-zA-Z0-9_-]", "_", stream)
    folders = list((base / "stream").glob(f"__{name}_*"))
    if len(folders) != 1:
        return None
    files = list(folders[0].iterdir())
    segments = sorted(int(f.stem) for f in files if f.suffix == ".segment")
    indexes = [f.stat().st_size for f in files if f.suffix == ".index"]
    return {
        "bytes": sum(f.stat().st_size for f in files if f.is_file()),
        # An index file: an 8-byte header, then 29 bytes a chunk (osiris).
        "chunks": sum(max(0, size - 8) // 29 for size in indexes),
        "segments": len(segments),
        "segment_offsets": segments,
        "folder": folders[0].name,
    }


def raw_stream(messages: int) -> dict[str, Any]:
    """The broker's raw limits on a stream like the results one, with messages of one
    signed result record: publishes a second without confirms (the broker packs many
    into each chunk) and each confirmed before the next (one message a chunk, as a
    worker at 100 jobs/s writes); then reads of 1,000 messages from each part, with
    a credit of 1,000: the time to the first delivery (the broker prepares the whole
    credit before it sends any) and to the last."""
    sign: Sign = lambda body: {"x-deferred-signature": "hmac-sha256:" + "0" * 64}  # noqa: E731
    name = f"deferred-bench-raw-stream-{uuid.uuid4().hex[:8]}"
    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    out: dict[str, Any] = {"messages": messages}
    try:
        channel = connection.channel()
        channel.queue_declare(
            name,
            durable=True,
            arguments={
                "x-queue-type": "stream",
                "x-max-age": "86400s",
                "x-stream-max-segment-size-bytes": SEGMENT_BYTES,
            },
        )
        body, props = _pool(sign, random.Random(3))[1][0]
        start = time.perf_counter()
        for _ in range(messages):
            channel.basic_publish("", name, body, props)
        channel.queue_declare(name, passive=True)  # a round trip: all of them taken
        out["publish_no_confirm_per_s"] = messages / (time.perf_counter() - start)
        confirming = connection.channel()
        confirming.confirm_delivery()
        count = max(2000, messages // 10)
        start = time.perf_counter()
        for _ in range(count):
            confirming.basic_publish("", name, body, props)
        out["publish_confirm_each_per_s"] = count / (time.perf_counter() - start)
        for part, offset in (("packed", 0), ("one_a_chunk", messages)):
            reads = [
                raw_read(BROKER_URL, name, offset, count=1000, prefetch=1000) for _ in range(5)
            ]
            out[f"read_1000_{part}_first_ms"] = stats([r.first_ms or 0.0 for r in reads])
            out[f"read_1000_{part}_ms"] = stats([r.ms for r in reads])
    finally:
        try:
            connection.channel().queue_delete(name)
        finally:
            connection.close()
    return out


def raw_limits(messages: int) -> dict[str, Any]:
    from bench import raw

    print("raw limits...", flush=True)
    out = {"queue": raw.run(messages), "stream": raw_stream(messages)}
    q, s = out["queue"], out["stream"]
    print(
        f"  classic queue: publish {q['publish_no_confirm_per_s']:,.0f}/s, confirmed each "
        f"{q['publish_confirm_each_per_s']:,.0f}/s, consume+ack "
        f"{q['consume_ack_prefetch100_per_s']:,.0f}/s"
        f"\n  stream: publish {s['publish_no_confirm_per_s']:,.0f}/s, confirmed each "
        f"{s['publish_confirm_each_per_s']:,.0f}/s; 1,000 messages read, first delivery / "
        f"all (p50): packed {s['read_1000_packed_first_ms']['p50']:.1f} / "
        f"{s['read_1000_packed_ms']['p50']:.1f} ms, one a chunk "
        f"{s['read_1000_one_a_chunk_first_ms']['p50']:.1f} / "
        f"{s['read_1000_one_a_chunk_ms']['p50']:.1f} ms",
        flush=True,
    )
    return out


class Meter:
    """CPU of the broker and of given processes, and how busy the machine was, sampled
    every second; :meth:`over` gives the shares over a window (percent of one core;
    the machine's in percent of all its cores)."""

    def __init__(self, pids: dict[str, int]):
        self.pids = {"broker": 0, **pids}
        self._brokers = broker_pids([BROKER_URL])
        self.samples: list[tuple[float, dict[str, float], tuple[int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        cpu = {
            name: (
                sum(cpu_seconds(p) for p in self._brokers) if name == "broker" else cpu_seconds(pid)
            )
            for name, pid in self.pids.items()
        }
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        self.samples.append((time.time(), cpu, (sum(fields) - idle, sum(fields))))

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._sample()

    def start(self) -> None:
        self._sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()

    def over(self, since: float, until: float) -> dict[str, float]:
        inside = [s for s in self.samples if since <= s[0] <= until]
        if len(inside) < 2:
            return {}
        (t0, c0, m0), (t1, c1, m1) = inside[0], inside[-1]
        out = {f"{name}_cpu_pct": 100 * (c1[name] - c0[name]) / (t1 - t0) for name in c0}
        out["machine_busy_pct"] = 100 * (m1[0] - m0[0]) / max(1, m1[1] - m0[1])
        out["seconds"] = t1 - t0
        return out


# ---------------------------------------------------------------------- lookup


def _produce(
    point: Any,
    rate: float,
    seconds: float,
    ids: Path,
    *,
    low: float = LOW_S,
    high: float = HIGH_S,
    threads: int = 4,
    live: bool = False,
) -> dict[str, Any]:
    """The harness's producer (``e2e_app.produce``), without waiting for a worker."""
    from bench.capacity import producer_command

    command = producer_command(rate, seconds, ids, low=low, high=high, threads=threads, live=live)
    done = subprocess.run(
        command, env=point.env, cwd=point.work, text=True, capture_output=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the producer failed: {done.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _due(job_id: str) -> float:
    return int(job_id[:12], 16) / 1000


def lookups_main(argv: list[str]) -> int:
    """The "web view" (run in the harness's environment): look up random finished jobs."""
    parser = argparse.ArgumentParser(prog="python -m bench.results _lookups")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--rate", type=float, default=LOOKUP_RATE)
    parser.add_argument("--ids", type=Path, required=True)
    parser.add_argument("--min-age", type=float, default=MIN_AGE_S)
    parser.add_argument("--pause", type=Path, required=True, help="no look-ups while it exists")
    parser.add_argument("--fill", type=Path, required=True, help="the hour's burst, once written")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="look nothing up before")
    args = parser.parse_args(argv)

    import django

    django.setup()
    from deferred import result
    from deferred.conf import get_settings
    from deferred.core.topology import plan_topology
    from deferred.records.result_format import CLOCK_SLACK_S

    settings = get_settings()
    stream = plan_topology(settings).results_queue.name
    url = settings.broker_urls[0]
    rng = random.Random(5)
    known: list[tuple[float, str]] = []
    position = 0
    samples: list[dict[str, Any]] = []
    errors = PikaErrors.install()
    time.sleep(args.delay)
    start = time.monotonic()
    tick = 0
    while (now_m := time.monotonic()) - start < args.seconds - args.delay:
        pause = start + tick / args.rate - now_m
        if pause > 0:
            time.sleep(pause)
        tick += 1
        if args.pause.exists():
            continue
        if args.ids.exists():
            with args.ids.open() as f:
                f.seek(position)
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            position += len(complete)
            known += [(_due(i), i) for i in complete.split()]
        now = time.time()
        finished = [(d, i) for d, i in known if d <= now - args.min_age]
        group = "recent"
        if args.fill.exists():
            fill = json.loads(args.fill.read_text())
            # Read windows (due - slack, truncated to the second, to the job's end)
            # wholly before the burst, or wholly after it.
            old = [(d, i) for d, i in finished if d < fill["start"] - 1.0]
            recent = [(d, i) for d, i in finished if d > fill["end"] + CLOCK_SLACK_S + 1.0]
            if (tick % 2 and old) or not recent:
                finished, group = old, "hour"
            else:
                finished = recent
        if not finished:
            continue
        due, job_id = rng.choice(finished)
        since = datetime.fromtimestamp(due, UTC) - timedelta(seconds=CLOCK_SLACK_S)
        sample: dict[str, Any] = {"at": now, "age_s": now - due, "group": group}
        errors.doing = "lib"
        t0 = time.perf_counter()
        try:
            found = result(job_id)
        except Exception as exc:  # noqa: BLE001 - a shared broker's closed connection
            sample["error"] = repr(exc)
            samples.append(sample)
            continue
        sample["ms"] = (time.perf_counter() - t0) * 1000
        sample["state"] = found.state
        sample["complete"] = found.complete
        if tick % 3 == 0:
            # A third as many raw reads of the same job, half with another credit.
            prefetch = LIBRARY_PREFETCH if (tick // 6) % 2 == 0 else OTHER_PREFETCH
            errors.doing = f"raw{prefetch}"
            try:
                raw = raw_read(url, stream, since, job_id, prefetch)
            except pika.exceptions.AMQPError as exc:
                sample["raw_error"] = repr(exc)
            else:
                sample.update(
                    raw_ms=raw.ms,
                    raw_first_ms=raw.first_ms,
                    raw_prefetch=prefetch,
                    raw_messages=raw.messages,
                    raw_found=raw.found_offset is not None,
                )
        samples.append(sample)
    args.out.write_text(json.dumps({"samples": samples, "pika_errors": errors.counts}))
    return 0


def fill_main(argv: list[str]) -> int:
    """Write other jobs' records into the configured results stream (in the harness's
    environment: its prefix and key); one JSON line of what was written."""
    parser = argparse.ArgumentParser(prog="python -m bench.results _fill")
    parser.add_argument("--records", type=int, required=True)
    args = parser.parse_args(argv)
    import django

    django.setup()
    from deferred.conf import get_settings
    from deferred.core.topology import plan_topology

    settings = get_settings()
    stream = plan_topology(settings).results_queue.name
    written = write_bulk(settings.broker_urls[0], stream, signer(), args.records, seed=11)
    print(json.dumps(vars(written) | {"per_s": written.per_s}), flush=True)
    return 0


def worker_batches(stream: str) -> dict[str, Any]:
    """How the worker batched its records (messages by records carried), and the
    readers' markers (a look-up that read to the end of the stream writes one)."""
    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    sizes: Counter[int] = Counter()
    markers = 0
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=2000)
        for method, _props, body in channel.consume(
            stream, arguments={"x-stream-offset": "first"}, inactivity_timeout=2
        ):
            if method is None:
                break
            channel.basic_ack(method.delivery_tag, multiple=True)
            if b'"marker"' in body:
                markers += 1
            elif b'"bench:' not in body:
                sizes[len(json.loads(body)["r"])] += 1
    finally:
        _close(connection)
    messages = sum(sizes.values())
    records = sum(k * v for k, v in sizes.items())
    return {
        "messages": messages,
        "records": records,
        "records_per_message": records / messages if messages else float("nan"),
        "shares": {k: v / messages for k, v in sorted(sizes.items())} if messages else {},
        "markers": markers,
    }


def caches_json(url: str) -> str:
    """The harness's ``CACHES`` (``E2E_CACHES``): ``results``, a Redis cache at ``url``."""
    return json.dumps(
        {
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "results": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": url},
        }
    )


def part_lookup(args: argparse.Namespace) -> dict[str, Any]:
    from bench.capacity import WARM_UP_RATE, WARM_UP_S, Checkout, Point

    out: dict[str, Any] = {"raw": raw_limits(args.raw)}
    base = broker_data_dir()
    work = Path(tempfile.mkdtemp(prefix="deferred-results-"))
    extra: dict[str, Any] = {}
    if args.cache:
        # RESULT_CACHE: a Redis cache the worker and the looker share.
        extra = {"RESULT_CACHE": "results"}
    point = Point(Checkout("main", ROOT), "classic", extra, work)
    if args.cache:
        point.env["E2E_CACHES"] = caches_json(args.cache)
    ids, pause, fill_file = work / "load.ids", work / "pause", work / "fill.json"
    try:
        point.start()
        assert point.worker is not None
        point.produce(WARM_UP_RATE, WARM_UP_S, work / "warm.ids")
        time.sleep(HIGH_S + 0.5)
        print(f"lookup: {LOAD_RATE:.0f} jobs/s for {args.seconds:.0f} s...", flush=True)
        looker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.results",
                "_lookups",
                "--seconds",
                str(args.seconds - 2),
                "--rate",
                str(args.lookup_rate),
                "--ids",
                str(ids),
                "--pause",
                str(pause),
                "--fill",
                str(fill_file),
                "--out",
                str(work / "lookups.json"),
                "--delay",
                str(args.lookups_from),
            ],
            env=point.env,
            cwd=work,
        )
        meter = Meter({"worker": point.worker.pid, "looker": looker.pid})
        meter.start()
        fill: dict[str, Any] = {}

        def burst() -> None:
            time.sleep(args.fill_at)
            pause.touch()
            fill["start"] = time.time()
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.results",
                    "_fill",
                    "--records",
                    str(args.hour_records),
                ],
                env=point.env,
                cwd=work,
                text=True,
                capture_output=True,
                check=False,
            )
            fill["end"] = time.time()
            fill_file.write_text(json.dumps(fill))
            pause.unlink()
            if done.returncode != 0:
                fill["error"] = done.stderr[-2000:]
            else:
                fill.update(json.loads(done.stdout.strip().splitlines()[-1]))

        filler = threading.Thread(target=burst, daemon=True)
        started = time.time()
        if args.hour_records:
            filler.start()
        produced = _produce(point, LOAD_RATE, args.seconds, ids, live=True)
        ended = time.time()
        looker.wait(120)
        if filler.is_alive():
            filler.join(600)
        meter.stop()
        time.sleep(HIGH_S + 1.0)
        rows = point.stop()
        stream = f"{point.prefix}.results"
        out["stream"] = stream_disk(stream, base)
        out["batches"] = worker_batches(stream)
    finally:
        point.stop()
        point.delete_topology()
        looked = work / "lookups.json"
        lookups = json.loads(looked.read_text()) if looked.exists() else {}
        wanted = set(ids.read_text().split()) if ids.exists() else set()
        shutil.rmtree(work, ignore_errors=True)

    ran = {job_id: (at, (at - due) * 1000) for job_id, at, due in rows}
    late = [ran[i][1] for i in wanted if i in ran]
    # The jobs that ran during the burst (and 10 s after) are left out of "steady".
    window = (fill.get("start", ended), fill.get("end", ended) + 10)
    steady = [ran[i][1] for i in wanted if i in ran and not window[0] <= ran[i][0] <= window[1]]
    looking = started + args.lookups_from
    out.update(
        {
            "seconds": args.seconds,
            "cache": args.cache,
            "lookups_from": args.lookups_from,
            "produced": produced,
            "jobs": len(wanted),
            "ran": len(late),
            "lateness_ms": stats(late),
            "lateness_steady_ms": stats(steady),
            "fill": fill,
            "cpu": {
                "load only": meter.over(started + 5, looking),
                "load and look-ups": meter.over(looking + 5, window[0]),
                "after the burst": meter.over(window[1], ended) if fill else {},
            },
            "samples": lookups.get("samples", []),
            "pika_errors": lookups.get("pika_errors", {}),
        }
    )
    return out


def print_lookup(out: dict[str, Any]) -> None:
    samples = out["samples"]
    print(
        f"\nlookup{' with RESULT_CACHE ' + out['cache'] if out.get('cache') else ''}: "
        f"{len(samples)} look-ups; jobs {out['jobs']:,}, ran {out['ran']:,}; "
        f"lateness {_row(out['lateness_ms'])}; steady {_row(out['lateness_steady_ms'])}"
    )
    errors = [s for s in samples if "error" in s]
    if errors:
        print(f"  look-ups that raised: {len(errors)}: {errors[0]['error']}")
    samples = [s for s in samples if "error" not in s]
    for group in ("recent", "hour", None):
        chosen = [s for s in samples if group is None or s["group"] == group]
        if not chosen:
            continue
        states = Counter(s["state"] for s in chosen)
        incomplete = sum(1 for s in chosen if not s["complete"])
        ages = [s["age_s"] for s in chosen]
        print(
            f"  {group or 'all'}: result() {_row(stats([s['ms'] for s in chosen]))}; ages "
            f"{min(ages):.0f}-{max(ages):.0f} s; states {dict(states)}; incomplete {incomplete}"
        )
        for prefetch in (LIBRARY_PREFETCH, OTHER_PREFETCH):
            raws = [s for s in chosen if s.get("raw_prefetch") == prefetch]
            if raws:
                print(
                    f"    raw read, credit {prefetch}: {_row(stats([s['raw_ms'] for s in raws]))}"
                    f"; first delivery p50 "
                    f"{percentile([s['raw_first_ms'] or 0.0 for s in raws], 50):.1f} ms; "
                    f"messages p50 {percentile([s['raw_messages'] for s in raws], 50):.0f}; "
                    f"found {sum(1 for s in raws if s['raw_found'])}/{len(raws)}"
                )
    for name, cpu in out["cpu"].items():
        print(f"  cpu, {name}: {_cpu(cpu)}")
    print(f"  pika ERROR lines in the look-up process: {out['pika_errors']}")
    print(f"  burst: {out['fill']}")
    print(f"  stream: {out['stream']}")
    print(f"  worker batches: {out['batches']}")


def _row(s: dict[str, float]) -> str:
    return (
        f"n {s['n']}, p50 {s['p50']:.1f}, p95 {s['p95']:.1f}, p99 {s['p99']:.1f}, "
        f"max {s['max']:.1f} ms"
    )


def _cpu(c: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in c.items())


# ---------------------------------------------------------------------- day


def part_day(args: argparse.Namespace) -> dict[str, Any]:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    django.setup()
    from bench.common import Config, topology
    from deferred import result
    from deferred.conf import get_settings
    from deferred.core.jobs import due_of
    from deferred.records.result_format import CLOCK_SLACK_S

    out: dict[str, Any] = {"raw": raw_limits(args.raw)}
    base = broker_data_dir()
    checkpoints: list[dict[str, Any]] = []
    with topology(Config()) as (_prefix, plan):
        settings = get_settings()
        stream = plan.results_queue.name
        sign = signer()
        trickle = Trickle(settings.broker_urls, plan.ingest_exchange, sign)
        trickle.start()
        started = time.monotonic()
        errors = PikaErrors.install()

        def look(job_id: str, n: int) -> dict[str, Any]:
            due = due_of(job_id)
            assert due is not None
            since = due - timedelta(seconds=CLOCK_SLACK_S)
            lib: list[float] = []
            raws: dict[int, list[Read]] = {LIBRARY_PREFETCH: [], OTHER_PREFETCH: []}
            states: Counter[str] = Counter()
            steps = ["lib", LIBRARY_PREFETCH, OTHER_PREFETCH]
            for k in range(n):
                for step in steps[k % 3 :] + steps[: k % 3]:
                    errors.doing = str(step)
                    try:
                        if step == "lib":
                            t0 = time.perf_counter()
                            found = result(job_id)
                            lib.append((time.perf_counter() - t0) * 1000)
                            state = found.state + ("" if found.complete else " (incomplete)")
                            states[state] += 1
                        else:
                            assert isinstance(step, int)
                            raws[step].append(raw_read(BROKER_URL, stream, since, job_id, step))
                    except Exception as exc:  # noqa: BLE001 - a shared broker's closed connection
                        states[f"error: {type(exc).__name__}"] += 1
            out: dict[str, Any] = {
                "lib_ms": stats(lib),
                "first_ms": lib[0],
                "states": states,
                "pika_errors": dict(errors.counts),
            }
            errors.counts.clear()
            for prefetch, reads in raws.items():
                out[f"raw{prefetch}_ms"] = stats([r.ms for r in reads])
                out[f"raw{prefetch}_first_ms"] = stats([r.first_ms or 0.0 for r in reads])
                out[f"raw{prefetch}_messages"] = percentile([r.messages for r in reads], 50)
                out[f"raw{prefetch}_found"] = sum(1 for r in reads if r.found_offset is not None)
            return out

        # 1. The job's segment, as 100 jobs/s fill it: one message a chunk, to near
        # its end (the far end of the broker's scan within one segment).
        print("day: the job's segment, one message a chunk...", flush=True)

        def nearly_full(messages: int) -> bool:
            if messages % 1000:
                return False
            disk = stream_disk(stream, base)
            if disk is None:
                return bool(messages >= args.segment_messages)
            return bool(disk["segments"] > 1 or disk["bytes"] > 0.9 * SEGMENT_BYTES)

        segment = write_confirmed(BROKER_URL, stream, sign, nearly_full)
        # 2. The seconds around the job: only the trickle (100 jobs/s, as a worker writes).
        time.sleep(CLOCK_SLACK_S + 2.0)
        target = trickle.job()
        at_target = stream_disk(stream, base)
        # 3. What follows it as 100 jobs/s writes it, one message a chunk: more than a
        # look-up's credit, so that what the broker reads for one is as a day has it.
        after = write_confirmed(
            BROKER_URL, stream, sign, lambda n: n >= args.after_messages, seed=4
        )
        due = due_of(target)
        assert due is not None
        read = raw_read(BROKER_URL, stream, due - timedelta(seconds=CLOCK_SLACK_S), target)
        out["target"] = {
            "id": target,
            "offset": read.found_offset,
            "first_read_offset": read.first_offset,
            "segment_written": vars(segment) | {"per_s": segment.per_s},
            "after_written": vars(after) | {"per_s": after.per_s},
            "disk": at_target,
        }
        print(f"  the job: {out['target']}", flush=True)

        def checkpoint(written: Written | None) -> None:
            point: dict[str, Any] = {
                "bulk_records": written.records if written else 0,
                "bulk_messages": written.messages if written else 0,
                "bulk_seconds": written.seconds if written else 0.0,
                "trickle_records": trickle.records,
                "disk": stream_disk(stream, base),
                **look(target, args.lookups),
            }
            checkpoints.append(point)
            print(f"  {_checkpoint(point)}", flush=True)

        # 4. A day of other jobs' records after it.
        checkpoint(None)
        marks = [args.day_records * f for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2)]
        bulk = write_bulk(
            BROKER_URL,
            stream,
            sign,
            args.day_records,
            checkpoints=[int(m) for m in marks],
            on_checkpoint=checkpoint,
            max_seconds=args.max_write_s,
        )
        checkpoint(bulk)
        # 5. A job that finished just now, on the same stream.
        time.sleep(CLOCK_SLACK_S + 2.0)
        fresh = trickle.job()
        time.sleep(1.0)
        out["fresh"] = look(fresh, args.lookups)
        print(f"  a job just finished: {_checkpoint(out['fresh'])}", flush=True)
        trickle.stop()
        out["bulk"] = vars(bulk) | {"per_s": bulk.per_s}
        out["disk"] = stream_disk(stream, base)
        out["seconds"] = time.monotonic() - started
    # The stream is deleted with the topology; its files a moment later.
    time.sleep(5.0)
    out["deleted"] = base is None or stream_disk(stream, base) is None
    out["checkpoints"] = checkpoints
    out["extrapolated"] = extrapolate(out, args.day_records)
    print(f"  extrapolated: {out['extrapolated']}\n  stream deleted: {out['deleted']}")
    return out


def _checkpoint(point: dict[str, Any]) -> str:
    disk = point.get("disk") or {}
    head = (
        f"{point['bulk_records']:,} records after it ({point['bulk_messages']:,} messages in "
        f"{point['bulk_seconds']:.0f} s), {disk.get('segments')} segments, "
        f"{(disk.get('bytes') or 0) / 1e6:,.0f} MB: "
        if "bulk_records" in point
        else ""
    )
    raws = "; ".join(
        f"raw read, credit {p}: {_row(point[f'raw{p}_ms'])}, first delivery p50 "
        f"{point[f'raw{p}_first_ms']['p50']:.1f} ms, {point[f'raw{p}_messages']:.0f} messages"
        for p in (LIBRARY_PREFETCH, OTHER_PREFETCH)
    )
    return (
        f"{head}result() {_row(point['lib_ms'])} (first {point['first_ms']:.1f}); {raws}; "
        f"{dict(point['states'])}; pika ERROR lines {point['pika_errors']}"
    )


def extrapolate(out: dict[str, Any], day_records: int) -> dict[str, Any]:
    """The day as a worker would have written it, from what this run wrote.

    The bulk went in faster than 100 jobs/s, so the broker packed many messages
    into each chunk; a worker at 100 jobs/s writes one message a chunk (the
    job's segment, written that way, says how many bytes a message then takes).
    Segments roll at a size, so the real day has more of them; a look-up's seek
    passes over every segment newer than the job's. Fitted: look-up time against
    segments over the checkpoints (least squares), read at the real day's count.
    """
    disk = out["target"]["disk"] or {}
    offset = out["target"]["offset"]
    points = [
        (c["disk"]["segments"], c["lib_ms"]["p50"], c[f"raw{LIBRARY_PREFETCH}_ms"]["p50"])
        for c in out["checkpoints"]
        if c["disk"]
    ]
    if not disk or not offset or len(points) < 3:
        return {}
    # Up to the job, the stream was written one message a chunk (the segment's
    # fill, each confirmed, and the trickle): bytes on disk per message, then.
    per_message_chunked = disk["bytes"] / offset
    total_messages = out["bulk"]["messages"] + offset
    records_per_message = sum(k * v for k, v in BATCHES.items()) / sum(BATCHES.values())
    day_messages = day_records / records_per_message
    real_segments = day_messages * per_message_chunked / SEGMENT_BYTES

    def fit(ys: list[float]) -> tuple[float, float]:
        xs = [p[0] for p in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / max(
            1e-9, sum((x - mx) ** 2 for x in xs)
        )
        return slope, my - slope * mx

    lib_slope, lib_zero = fit([p[1] for p in points])
    raw_slope, raw_zero = fit([p[2] for p in points])
    return {
        "bytes_per_message_one_a_chunk": per_message_chunked,
        "messages_written": total_messages,
        "day_messages": day_messages,
        "day_segments_one_message_a_chunk": real_segments,
        "day_bytes_one_message_a_chunk": day_messages * per_message_chunked,
        "lib_ms_per_segment": lib_slope,
        "lib_p50_ms_at_day": lib_zero + lib_slope * real_segments,
        "raw_ms_per_segment": raw_slope,
        "raw_p50_ms_at_day": raw_zero + raw_slope * real_segments,
    }


# ---------------------------------------------------------------------- throughput


def drain(checkout: Any, jobs: int) -> dict[str, Any]:
    """A backlog of ``jobs`` due jobs, deferred with no worker running; then one worker
    (``--concurrency``, 4 by default) drains it. Jobs/s from the first job's start to the
    last's."""
    from bench.capacity import Point

    work = Path(tempfile.mkdtemp(prefix="deferred-results-"))
    point = Point(checkout, "classic", dict(checkout.settings), work)
    ids = work / "backlog.ids"
    try:
        point._django("declare_delay_topology", "-v", "0")
        rate = 4000.0
        _produce(point, rate, jobs / rate, ids, low=0.0, high=0.0, threads=8)
        wanted = set(ids.read_text().split())
        brokers = broker_pids([BROKER_URL])
        point.start()
        assert point.worker is not None
        t0, w0 = time.monotonic(), cpu_seconds(point.worker.pid)
        b0 = sum(cpu_seconds(p) for p in brokers)
        deadline = t0 + 300
        while point.succeeded() < len(wanted) and time.monotonic() < deadline:
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        worker_cpu = 100 * (cpu_seconds(point.worker.pid) - w0) / elapsed
        broker_cpu = 100 * (sum(cpu_seconds(p) for p in brokers) - b0) / elapsed
        rows = point.stop()
    finally:
        point.stop()
        point.delete_topology()
        shutil.rmtree(work, ignore_errors=True)
    times = sorted(at for job_id, at, _due in rows if job_id in wanted)
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    return {
        "checkout": checkout.name,
        "jobs": len(wanted),
        "ran": len(times),
        "per_s": (len(times) - 1) / span,
        "worker_cpu_pct": worker_cpu,
        "broker_cpu_pct": broker_cpu,
    }


def part_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from bench import capacity
    from bench.capacity import Checkout, measure, raw_limit, table

    capacity.CONCURRENCY = args.concurrency  # the worker's, at every point
    out: dict[str, Any] = {
        "concurrency": args.concurrency,
        "raw": raw_limits(args.raw),
        "raw_confirm_per_s": [raw_limit()],
    }
    on = Checkout("results on", ROOT)
    off = Checkout("results off", ROOT, (("RESULTS", False),))
    checkouts = [on, off]
    if args.cache:
        # Every point's harness gets the cache (Point copies the environment); only
        # this checkout names it as RESULT_CACHE.
        os.environ["E2E_CACHES"] = caches_json(args.cache)
        checkouts.append(Checkout("results + cache", ROOT, (("RESULT_CACHE", "results"),)))
    points = []
    for rate in (float(r) for r in args.rates.split(",") if r):
        for round_ in range(args.rounds):
            for checkout in checkouts if round_ % 2 == 0 else checkouts[::-1]:
                point = measure(
                    checkout, rate, args.rate_seconds, "classic", dict(checkout.settings), None
                )
                point["round"] = round_ + 1
                points.append(point)
                print(table([point]).splitlines()[-1], flush=True)
    drains = []
    for round_ in range(args.rounds if args.backlog else 0):
        for checkout in checkouts if round_ % 2 == 0 else checkouts[::-1]:
            result = drain(checkout, args.backlog)
            result["round"] = round_ + 1
            drains.append(result)
            print(
                f"| {result['checkout']} | backlog {result['jobs']:,} | "
                f"{result['per_s']:,.0f} jobs/s | ran {result['ran']:,} | worker "
                f"{result['worker_cpu_pct']:.0f}% | broker {result['broker_cpu_pct']:.0f}% |",
                flush=True,
            )
    out["raw_confirm_per_s"].append(raw_limit())
    out["points"] = points
    out["drains"] = drains
    print("\n" + table(points))
    return out


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_lookups"]:
        return lookups_main(argv[1:])
    if argv[:1] == ["_fill"]:
        return fill_main(argv[1:])
    parts: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "lookup": part_lookup,
        "day": part_day,
        "throughput": part_throughput,
    }
    parser = argparse.ArgumentParser(
        prog="python -m bench.results", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--only", default=",".join(parts))
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--raw", type=int, default=10_000, help="messages for the raw limits")
    parser.add_argument("--seconds", type=float, default=240, help="lookup: the steady run")
    parser.add_argument("--lookup-rate", type=float, default=LOOKUP_RATE, help="look-ups/s")
    parser.add_argument("--lookups-from", type=float, default=40, help="lookup: look-ups from")
    parser.add_argument("--fill-at", type=float, default=120, help="lookup: the hour's burst at")
    parser.add_argument("--hour-records", type=int, default=HOUR_RECORDS)
    parser.add_argument(
        "--cache",
        default="",
        help="lookup: RESULT_CACHE on, a Redis cache at this URL; throughput: a third worker so,",
    )
    parser.add_argument("--day-records", type=int, default=DAY_RECORDS)
    parser.add_argument("--max-write-s", type=float, default=420)
    parser.add_argument("--segment-messages", type=int, default=25_000)
    parser.add_argument("--after-messages", type=int, default=2_000)
    parser.add_argument("--lookups", type=int, default=15, help="day: look-ups per checkpoint")
    parser.add_argument("--rates", default="500,1000")
    parser.add_argument("--rate-seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=4, help="throughput: the worker's")
    args = parser.parse_args(argv)
    chosen = [p for p in args.only.split(",") if p]
    unknown = set(chosen) - set(parts)
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    results: dict[str, Any] = {
        "command": "python -m bench.results " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for name in chosen:
        started = time.monotonic()
        results[name] = parts[name](args)
        results[name + "_seconds"] = round(time.monotonic() - started, 1)
        if name == "lookup":
            print_lookup(results[name])
        print(f"({name}: {results[name + '_seconds']:.0f} s)", flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
