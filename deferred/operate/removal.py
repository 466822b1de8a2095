"""What ``declare_delay_topology --delete`` removes: a whole PREFIX, or one old topology.

Pure: the names come from the plans (the current one and those the registry
records), so the command can show the list, count the jobs in it and ask before
anything is touched. A PREFIX is every queue and exchange this library gives
it, whichever topology declared them: the delay queues and exchanges of every
recorded topology, the ready and hold queues (the FIFO ones left from before
priorities too), the failed queue and exchange, the registry, the scheduler's
queues, the cancels stream and a transfer's staging queue. One old topology
is its own delay queues and exchanges only; the shared queues stay.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deferred.core.topology import Plan, recorded_plan
from deferred.operate.transfer_plan import staging_plan


@dataclass(frozen=True)
class Removal:
    """The queues and exchanges to delete, and what they are, in words."""

    what: str
    queues: tuple[str, ...]
    exchanges: tuple[str, ...]
    #: The registry records to forget with it (a topology's id), none for a PREFIX.
    forget: tuple[str, ...] = ()
    #: Queues whose messages are records, not jobs (the registry, the scheduler's,
    #: the cancels): removed with the rest, and not counted as jobs lost.
    bookkeeping: tuple[str, ...] = ()


def prefix_removal(plan: Plan, records: Iterable[Mapping[str, Any]]) -> Removal:
    """Everything of ``plan``'s PREFIX."""
    plans = [plan, *_recorded(plan, records)]
    legacy_ready, legacy_hold = plan.legacy_queues
    staging = staging_plan(plan)
    queues = [
        # Delay queues first, in the order messages flow (the longest TTL first):
        # nothing is deleted under a message on its way to a queue still there.
        *(q.name for p in plans for q in sorted(p.delay_queues, key=lambda q: -(q.ttl_ms or 0))),
        *(q.name for p in plans for q in (*p.hold_queues.values(), *p.ready_queues.values())),
        *legacy_hold.values(),
        *legacy_ready.values(),
        staging.queue.name,
        *(q.name for q in plan.shared_queues),
    ]
    exchanges = [
        *(e.name for p in plans for e in p.exchanges),
        staging.exchange,
        staging.out,
        plan.failed_exchange.name,
    ]
    bookkeeping = (
        plan.registry_queue.name,
        plan.scheduler_queue.name,
        plan.schedules_queue.name,
        plan.cancels_queue.name,
        plan.results_queue.name,
        *(q.name for q in plan.keeping_queues),
    )
    return Removal(
        f"PREFIX {plan.prefix!r}", _once(queues), _once(exchanges), bookkeeping=bookkeeping
    )


def topology_removal(plan: Plan, records: Iterable[Mapping[str, Any]], topology: str) -> Removal:
    """One old topology of the PREFIX; ``ValueError`` for the current one or an unknown id."""
    if topology == plan.topology_id:
        raise ValueError(
            f"{topology} is the topology these settings use: new jobs go there. Remove the "
            "whole PREFIX (--delete without --topology), or change the settings first."
        )
    found = [p for p in _recorded(plan, records) if p.topology_id == topology]
    if not found:
        known = sorted({p.topology_id for p in _recorded(plan, records)} - {plan.topology_id})
        raise ValueError(
            f"No topology {topology} is recorded under PREFIX {plan.prefix!r}; old ones: "
            f"{', '.join(known) or 'none'} (declare_delay_topology --list)."
        )
    old = found[0]
    queues = [q.name for q in sorted(old.delay_queues, key=lambda q: -(q.ttl_ms or 0))]
    return Removal(
        f"topology {topology}",
        _once(queues),
        _once(e.name for e in old.exchanges),
        forget=(topology,),
    )


def _recorded(plan: Plan, records: Iterable[Mapping[str, Any]]) -> list[Plan]:
    return [recorded_plan(r, prefix=plan.prefix, queues=tuple(plan.ready_queues)) for r in records]


def _once(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))
