"""The job ledger at scale: list and look up pending jobs, and what they cost the broker.

python -m bench.ledger [--pending 100000,1000000] [--looks 200] [--out FILE]

For each count: a fresh topology, that many jobs deferred with delays of one to
thirty days (nothing comes due), the keeper's checkpoint written
(``deferred.records.checkpoints.write``, what the keeper runs), then:

- ``pending()``'s first page (100 rows), five times;
- ``deferred_jobs show``'s look-up (``changes.look``) of ``--looks`` random jobs;
- the broker's RSS and its disk (``du`` of its data folder) before and after,
  and the streams of the topology alone (the ledger and its checkpoints), per job;
- a second checkpoint, from the first.

Beside them, in the same run: the broker's raw confirmed publish rate (``bench.raw``),
the limit the defers ran against.

Another release: ``scripts/rabbitmq-release.sh 4.3 run -- python -m bench.ledger``
(the broker's own ``rabbitmqctl`` says which VM and data folder to measure).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import Config, broker_data_dir, broker_pid, percentile, rss_mb, topology
from bench.tasks import noop
from deferred import defer_many, pending
from deferred.conf import get_settings
from deferred.records import changes, checkpoints

#: The system broker's data folder, where its rabbitmqctl cannot say.
DATA = Path("/var/lib/rabbitmq/mnesia")


def _du_mb(*paths: Path) -> float:
    found = subprocess.run(["du", "-sbc", *map(str, paths)], capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout:
        return float("nan")
    return int(found.stdout.splitlines()[-1].split()[0]) / 1e6


def _streams_of(data: Path, prefix: str) -> list[Path]:
    """The data folders of this topology's streams (named after their queue)."""
    return [p for p in [*data.glob("stream/*"), *data.glob("*/stream/*")] if prefix in p.name]


def run(count: int, looks: int) -> dict[str, Any]:
    rng = random.Random(7)
    pid = broker_pid()
    out: dict[str, Any] = {"pending": count, "broker_pid": pid}
    with topology(Config()) as (prefix, _plan):
        # After the declare: a node's data folder has no streams before its first one.
        data = broker_data_dir() or DATA
        out["data"] = str(data)
        settings = get_settings()
        out["broker_rss_mb_before"] = rss_mb(pid) if pid else float("nan")
        out["broker_disk_mb_before"] = _du_mb(data)
        ids: list[str] = []
        start = time.perf_counter()
        for first in range(0, count, 2000):
            batch = min(2000, count - first)
            ids += defer_many([(noop, rng.uniform(86400, 30 * 86400), (k,)) for k in range(batch)])
        out["defer_per_s"] = count / (time.perf_counter() - start)
        start = time.perf_counter()
        head = checkpoints.write(settings, timeout=1800)
        out["checkpoint_s"] = time.perf_counter() - start
        out["checkpoint_rows"] = head.rows
        firsts = []
        for _ in range(5):
            start = time.perf_counter()
            rows = pending(limit=100)
            firsts.append(time.perf_counter() - start)
            assert len(rows) == 100
        out["list_first_page_s"] = {"median": sorted(firsts)[2], "max": max(firsts)}
        shows = []
        for job_id in rng.sample(ids, looks):
            start = time.perf_counter()
            found = changes.look(settings, job_id, with_job=False)
            shows.append((time.perf_counter() - start) * 1000)
            assert found.state == "pending", (job_id, found.state)
        shows.sort()
        out["show_ms"] = {
            "p50": percentile(shows, 50),
            "p99": percentile(shows, 99),
            "max": shows[-1],
        }
        start = time.perf_counter()
        checkpoints.write(settings, timeout=1800)
        out["checkpoint_again_s"] = time.perf_counter() - start
        out["broker_rss_mb_after"] = rss_mb(pid) if pid else float("nan")
        out["broker_disk_mb_after"] = _du_mb(data)
        streams = _streams_of(data, prefix)
        by_name = {p.name: _du_mb(p) for p in streams}
        out["streams_mb"] = by_name
        out["disk_bytes_per_job"] = (
            (out["broker_disk_mb_after"] - out["broker_disk_mb_before"]) * 1e6 / count
        )
        ledger = sum(mb for name, mb in by_name.items() if "_ledger" in name)
        out["ledger_streams_bytes_per_job"] = ledger * 1e6 / count
        out["broker_rss_mb_per_1k_jobs"] = (
            (out["broker_rss_mb_after"] - out["broker_rss_mb_before"]) * 1000 / count
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", default="100000")
    parser.add_argument("--looks", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from bench.capacity import raw_limit

    raw = raw_limit()
    print(f"raw confirmed publish, one connection: {raw:,.0f} msg/s", flush=True)
    results = []
    for count in (int(c) for c in args.pending.split(",")):
        point = run(count, args.looks)
        results.append(point)
        print(json.dumps(point, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"raw_publish_per_s": raw, "points": results}, indent=2))


if __name__ == "__main__":
    import django

    django.setup()
    main()
