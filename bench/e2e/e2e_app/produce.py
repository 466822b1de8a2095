"""The producer: ``defer()`` at a fixed offered rate, delays uniform in [low, high] s.

python -m e2e_app.produce RATE SECONDS --threads N --low 0 --high 3 --ids FILE [--live]

Prints one JSON line: the achieved rate, the ``defer()`` call times and the
process's CPU use; writes the ids it got to ``--ids``: at the end, or with
``--live`` as it goes (every half second), for a process that reads them meanwhile.
"""

import argparse
import json
import os
import random
import resource
import threading
import time

import django


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rate", type=float)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--low", type=float, default=0.0)
    parser.add_argument("--high", type=float, default=3.0)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--live", action="store_true", help="write the ids as they come")
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "e2e_app.settings")
    django.setup()
    from deferred import defer
    from e2e_app.tasks import note

    per_thread = args.rate / args.threads
    count = int(per_thread * args.seconds)
    ids: list[str] = []
    calls: list[float] = []
    errors: list[str] = []

    def loop(seed: int, start: float) -> None:
        rng = random.Random(seed)
        for n in range(count):
            pause = start + n / per_thread - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            t0 = time.perf_counter()
            try:
                ids.append(defer(note, rng.uniform(args.low, args.high), n))
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(repr(exc))
            calls.append((time.perf_counter() - t0) * 1000)

    written = 0
    flushing = threading.Lock()

    def flush() -> None:
        nonlocal written
        with flushing:
            upto = len(ids)
            with open(args.ids, "a") as f:
                f.writelines(f"{job_id}\n" for job_id in ids[written:upto])
            written = upto

    done = threading.Event()

    def flusher() -> None:
        while not done.wait(0.5):
            flush()

    if args.live:
        open(args.ids, "w").close()
        threading.Thread(target=flusher, daemon=True).start()

    # Warm each thread's connection first, outside the measured window.
    warm = [threading.Thread(target=lambda: defer(note, 0.0)) for _ in range(args.threads)]
    for t in warm:
        t.start()
    for t in warm:
        t.join()
    print("go", flush=True)  # the measuring process starts its CPU meters here
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    threads = [
        threading.Thread(target=loop, args=(args.seed * 1000 + t, start))
        for t in range(args.threads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    used = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    done.set()
    if args.live:
        flush()
    else:
        with open(args.ids, "w") as f:
            f.writelines(f"{job_id}\n" for job_id in ids)
    calls.sort()
    print(
        json.dumps(
            {
                "offered": args.rate,
                "achieved": len(calls) / elapsed,
                "jobs": len(ids),
                "errors": len(errors),
                "first_error": errors[0] if errors else None,
                "call_ms_p50": calls[len(calls) // 2] if calls else None,
                "call_ms_p99": calls[int(len(calls) * 0.99)] if calls else None,
                "cpu_pct": 100 * used / elapsed,
                "seconds": elapsed,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
