"""The soak's checker: a verdict over a complete history, with no broker and no Django.

python -m bench.soak_check DIR      (the output folder of a ``python -m bench.soak`` run)

The history is three lists of records, as ``bench.soak`` writes them (one JSON
object a line):

- calls, one per ``defer()``: ``id``, ``due`` (epoch s: the time before the call
  plus the delay, a lower bound of the job's real due time, which ``defer()``
  takes a moment later and rounds up), ``called``, ``returned``, ``outcome``
  (``"ok"`` or ``"raised"``, with ``error``, the exception's class). A raised
  call's ``id`` is the exception's ``job_id``: the broker may have taken the
  job before the error, so a run of it is allowed, and its absence is no loss.
- runs, one per start of the task: ``id``, ``attempt``, ``start``, ``due`` (the
  job's own, from ``current_job()``), ``pid``, ``thread``, ``worker``.
- faults, one per fault of the nemesis: ``kind``, ``target``, ``start``, ``end``
  and what each kind adds (a SIGTERM's ``exit_s`` and ``code``). Two more kinds
  are events, not faults: ``exit`` (a worker that ended without being told to)
  and ``stop`` (the final SIGTERM of each worker, after the drain).

The contract checked: every job whose ``defer()`` returned runs (none lost), and
no run starts before its due time (none early, with no tolerance). Duplicates
are allowed (at least once) but each is listed with the fault that most
plausibly caused it, so that a fix can be aimed.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Fault kinds of the nemesis; the other kinds of the fault log are events.
NEMESIS = ("kill", "term", "close", "restart", "pause", "nodekill")
#: Events that can cause a duplicate or a loss as a fault does: a worker that died unasked.
DISRUPTIONS = (*NEMESIS, "exit")
#: A duplicate's cause may have begun this long before its first run (a worker
#: that took a job, was paused, and ran it before the broker gave up on it).
CAUSE_WINDOW_S = 10.0
#: Lateness is shown apart for jobs due this long after the last fault ended.
SETTLE_S = 10.0
#: A run this late is listed (a paused worker held it, or the broker was down).
LATE_S = 10.0

Record = dict[str, Any]


def load_jsonl(path: Path) -> list[Record]:
    """The records of one file; a last line cut short by a kill is left out."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), nearest rank; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def _lateness(values_ms: list[float]) -> dict[str, Any]:
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {
        "n": len(values_ms),
        "p50_ms": ms(percentile(values_ms, 50)),
        "p99_ms": ms(percentile(values_ms, 99)),
        "max_ms": ms(max(values_ms, default=None)),
    }


def _end(fault: Record) -> float:
    """When a fault ended (an event of one instant has no end of its own)."""
    return float(fault.get("end") or fault["start"])


def _brief(fault: Record | None, origin: float) -> dict[str, Any] | None:
    """A fault as a report names it: kind, target, and when, relative to the run's start."""
    if fault is None:
        return None
    return {
        "kind": fault["kind"],
        "target": fault.get("target"),
        "start_s": round(fault["start"] - origin, 3),
        "end_s": round(_end(fault) - origin, 3),
    }


def nearest_fault(at: float, faults: Iterable[Record]) -> Record | None:
    """The fault closest to the instant ``at``: one under way then, else the one that
    began or ended nearest to it (a loss is looked for near the job's due time)."""

    def distance(fault: Record) -> float:
        start, end = fault["start"], _end(fault)
        return 0.0 if start <= at <= end else min(abs(at - start), abs(at - end))

    return min(faults, key=distance, default=None)


def cause_of(first: Record, second: Record, faults: list[Record], window_s: float) -> Record | None:
    """The fault that most plausibly made ``second`` run a job ``first`` had run.

    The candidates began before the second run and no earlier than ``window_s``
    before the first. Among them, the faults that touched the first run's worker
    (the same incarnation) or the whole broker come first: a kill of another
    worker seconds later explains nothing. Then the latest of them.
    """
    candidates = [f for f in faults if first["start"] - window_s <= f["start"] <= second["start"]]
    touching = [
        f
        for f in candidates
        if f.get("target") == first.get("worker") or f["kind"] in ("close", "restart", "nodekill")
    ]
    return max(touching or candidates, key=lambda f: f["start"], default=None)


def _lost(
    ok: dict[str, Record],
    by_id: dict[str, list[Record]],
    faults: list[Record],
    end: float,
    origin: float,
) -> tuple[list[dict[str, Any]], int]:
    """The jobs whose call returned ok and that never ran, each with the fault nearest to
    its due time; and how many more were not due yet at ``end`` (not lost: not checked)."""
    lost, not_due = [], 0
    for job_id, call in sorted(ok.items(), key=lambda item: item[1]["due"]):
        if job_id in by_id:
            continue
        if call["due"] > end:
            not_due += 1
            continue
        near = nearest_fault(call["due"], faults)
        lost.append(
            {
                "id": job_id,
                "due_s": round(call["due"] - origin, 3),
                "nearest_fault": _brief(near, origin),
                "due_after_fault_start_s": None
                if near is None
                else round(call["due"] - near["start"], 3),
            }
        )
    return lost, not_due


def _early(calls: list[Record], runs: list[Record], origin: float) -> list[dict[str, Any]]:
    """The runs that started before their due time, by any amount. Two due times are
    checked: the job's own, and the call's (a lower bound of it, taken independently)."""
    call_due = {c["id"]: c["due"] for c in calls if c.get("id")}
    early = []
    for run in runs:
        due = max(run["due"], call_due.get(run["id"], run["due"]))
        if run["start"] < due:
            early.append(
                {
                    "id": run["id"],
                    "worker": run.get("worker"),
                    "early_ms": round((due - run["start"]) * 1000, 3),
                    "due_s": round(due - origin, 3),
                }
            )
    return early


def _duplicates(
    by_id: dict[str, list[Record]],
    calls: dict[str, Record],
    faults: list[Record],
    window_s: float,
    origin: float,
) -> list[dict[str, Any]]:
    """The attempts that started more than once, each with its most likely cause. The
    call's time is shown too: a publish sent again after a lost confirm makes two copies
    from the start, and then the fault to look for is near the call, not the runs."""
    duplicates = []
    for job_id, job_runs in by_id.items():
        per_attempt: dict[int, list[Record]] = defaultdict(list)
        for run in job_runs:
            per_attempt[run.get("attempt", 1)].append(run)
        for attempt, same in sorted(per_attempt.items()):
            if len(same) < 2:
                continue
            cause = cause_of(same[0], same[1], faults, window_s)
            call = calls.get(job_id)
            duplicates.append(
                {
                    "id": job_id,
                    "attempt": attempt,
                    "extra": len(same) - 1,
                    "starts_s": [round(r["start"] - origin, 3) for r in same],
                    "workers": [r.get("worker") for r in same],
                    "pids": [r.get("pid") for r in same],
                    "threads": [r.get("thread") for r in same],
                    "cause": _brief(cause, origin) or "none",
                    "called_s": None if call is None else round(call["called"] - origin, 3),
                }
            )
    return duplicates


def _late(
    by_id: dict[str, list[Record]], quiet_from: float, late_s: float, origin: float
) -> dict[str, Any]:
    """Lateness of each job's first run: over all, once the faults were over, and the
    jobs held up for more than ``late_s``."""
    first = {job_id: runs[0] for job_id, runs in by_id.items()}
    lateness = {job_id: (run["start"] - run["due"]) * 1000 for job_id, run in first.items()}
    quiet = [ms for job_id, ms in lateness.items() if first[job_id]["due"] >= quiet_from]
    very_late = sorted(
        (
            {
                "id": job_id,
                "late_s": round(ms / 1000, 3),
                "due_s": round(first[job_id]["due"] - origin, 3),
                "worker": first[job_id].get("worker"),
            }
            for job_id, ms in lateness.items()
            if ms > late_s * 1000
        ),
        key=lambda item: -item["late_s"],
    )
    return {
        "lateness": _lateness(list(lateness.values())),
        "lateness_quiet": {"due_after_s": round(quiet_from - origin, 3), **_lateness(quiet)},
        "pause_late": {
            "count": len(very_late),
            "max_s": very_late[0]["late_s"] if very_late else None,
            "jobs": very_late[:20],
        },
    }


def check(
    calls: list[Record],
    runs: list[Record],
    faults: list[Record],
    end: float,
    *,
    origin: float | None = None,
    leftovers: dict[str, int] | None = None,
    window_s: float = CAUSE_WINDOW_S,
    settle_s: float = SETTLE_S,
    late_s: float = LATE_S,
) -> dict[str, Any]:
    """The verdict over a history; ``end`` is when the workers were told to stop (a job
    due after it may not have run). ``origin`` (default: the first call) is the zero of
    the report's relative times. ``leftovers``: the messages still in the job queues at
    the end, per queue, shown beside the losses (a job stuck in a queue is not gone,
    but it did not run: it counts as lost)."""
    if origin is None:
        origin = min((c["called"] for c in calls), default=end)
    ok = {c["id"]: c for c in calls if c["outcome"] == "ok"}
    raised = [c for c in calls if c["outcome"] != "ok"]
    raised_ids = {c["id"] for c in raised if c.get("id")}
    by_id: dict[str, list[Record]] = defaultdict(list)
    for run in sorted(runs, key=lambda r: r["start"]):
        by_id[run["id"]].append(run)
    disruptions = [f for f in faults if f["kind"] in DISRUPTIONS]
    nemesis = [f for f in faults if f["kind"] in NEMESIS]
    lost, not_due = _lost(ok, by_id, disruptions, end, origin)
    early = _early(calls, runs, origin)
    with_id = {c["id"]: c for c in calls if c.get("id")}
    duplicates = _duplicates(by_id, with_id, disruptions, window_s, origin)
    quiet_from = max((_end(f) for f in nemesis), default=origin) + settle_s

    def exits(kind: str) -> list[dict[str, Any]]:
        return [
            {"target": f.get("target"), "exit_s": f.get("exit_s"), "code": f.get("code")}
            for f in faults
            if f["kind"] == kind
        ]

    causes = Counter(d["cause"]["kind"] if d["cause"] != "none" else "none" for d in duplicates)
    return {
        "deferred": len(ok),
        "raised": len(raised),
        "raised_ran": len(raised_ids & by_id.keys()),
        "raised_without_id": sum(1 for c in raised if not c.get("id")),
        "ran": len(by_id),
        "runs": len(runs),
        "unknown_runs": sorted(by_id.keys() - ok.keys() - raised_ids),
        "not_due_at_end": not_due,
        "lost": lost,
        "leftovers": dict(leftovers or {}),
        "early": early,
        "duplicates": duplicates,
        "duplicate_extra_runs": sum(d["extra"] for d in duplicates),
        "duplicate_causes": dict(sorted(causes.items())),
        **_late(by_id, quiet_from, late_s, origin),
        "faults": dict(sorted(Counter(f["kind"] for f in nemesis).items())),
        "unexpected_exits": exits("exit"),
        "term_exits": exits("term"),
        "stop_exits": exits("stop"),
        "passed": not lost and not early,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} ms"


def _fault(brief: dict[str, Any] | str | None) -> str:
    if not isinstance(brief, dict):
        return "none"
    return f"{brief['kind']} {brief['target'] or ''} at +{brief['start_s']:.1f} s".replace(
        "  ", " "
    )


def report_text(result: dict[str, Any]) -> str:
    """The verdict as a reader wants it: the contract first, then the figures."""
    lines = [
        f"deferred (ok): {result['deferred']:,}; raised: {result['raised']:,} "
        f"({result['raised_ran']} of them ran anyway); jobs run: {result['ran']:,} "
        f"in {result['runs']:,} runs",
        f"lost: {len(result['lost'])}",
    ]
    for item in result["lost"]:
        lines.append(
            f"  {item['id']} due +{item['due_s']:.3f} s, nearest fault: "
            f"{_fault(item['nearest_fault'])} "
            f"(due {item['due_after_fault_start_s']} s after it began)"
        )
    left = result.get("leftovers") or {}
    if left:
        lines.append(f"messages still in the job queues at the end: {sum(left.values())}")
        lines += [f"  {count} in {queue}" for queue, count in sorted(left.items())]
    lines.append(f"early: {len(result['early'])}")
    for item in result["early"][:20]:
        lines.append(f"  {item['id']} on {item['worker']}: {item['early_ms']} ms early")
    lines.append(
        f"duplicates: {len(result['duplicates'])} jobs, {result['duplicate_extra_runs']} extra "
        f"runs; causes: {result['duplicate_causes'] or 'none'}"
    )
    for item in result["duplicates"][:30]:
        where = ", ".join(
            f"{w} pid {p} {t}"
            for w, p, t in zip(item["workers"], item["pids"], item["threads"], strict=True)
        )
        starts = ", ".join(f"+{s:.3f}" for s in item["starts_s"])
        lines.append(
            f"  {item['id']} attempt {item['attempt']}: deferred at +{item['called_s']} s, "
            f"runs at {starts} s ({where}); cause: {_fault(item['cause'])}"
        )
    late, quiet = result["lateness"], result["lateness_quiet"]
    lines.append(
        f"lateness: p50 {_ms(late['p50_ms'])}, p99 {_ms(late['p99_ms'])}, "
        f"max {_ms(late['max_ms'])} (n={late['n']:,})"
    )
    lines.append(
        f"lateness of jobs due after +{quiet['due_after_s']:.1f} s (faults over): "
        f"p50 {_ms(quiet['p50_ms'])}, p99 {_ms(quiet['p99_ms'])}, max {_ms(quiet['max_ms'])} "
        f"(n={quiet['n']:,})"
    )
    pause = result["pause_late"]
    lines.append(
        f"more than {LATE_S:g} s late: {pause['count']}"
        + (f", the latest {pause['max_s']:.1f} s" if pause["count"] else "")
    )
    lines.append(f"faults: {result['faults'] or 'none'}")
    for label, key in (("SIGTERM faults", "term_exits"), ("final SIGTERMs", "stop_exits")):
        shown = "; ".join(f"{e['target']} {e['exit_s']} s code {e['code']}" for e in result[key])
        lines.append(f"{label}: {shown or 'none'}")
    lines.append(
        "unexpected worker exits: "
        + (
            "; ".join(f"{e['target']} code {e['code']}" for e in result["unexpected_exits"])
            or "none"
        )
    )
    if result["unknown_runs"]:
        lines.append(f"runs of ids nobody deferred: {len(result['unknown_runs'])}")
    if result["not_due_at_end"]:
        lines.append(f"not yet due when the workers stopped: {result['not_due_at_end']}")
    lines.append("verdict: " + ("PASSED (none lost, none early)" if result["passed"] else "FAILED"))
    return "\n".join(lines)


def check_folder(out: Path) -> dict[str, Any]:
    """Check the history a soak left in ``out`` (its end and origin from ``soak.json``)."""
    meta = json.loads((out / "soak.json").read_text())
    return check(
        load_jsonl(out / "calls.jsonl"),
        load_jsonl(out / "runs.jsonl"),
        load_jsonl(out / "faults.jsonl"),
        meta["end"],
        origin=meta["origin"],
        leftovers=meta.get("leftovers"),
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    result = check_folder(Path(args[0]))
    print(report_text(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
