"""Least-privilege broker users: what each process needs, as RabbitMQ permission regexes.

RabbitMQ grants a user three regexes per vhost, matched against exchange and
queue names: *configure* (declare, delete), *write* (publish to an exchange;
bind to a queue or exchange as destination) and *read* (consume, get and
purge a queue; bind from an exchange as source). Publishing through the
default exchange is checked as a write on ``amq.default`` and reaches every
queue, so only the worker has it.

* ``publisher`` (web processes: ``defer()``, ``cancel()``, ``result()``):
  writes to the ingest exchanges only, which route jobs into the delay queues,
  cancels into the cancels stream and a result reader's marker into the
  results stream, and reads the results stream. It cannot consume anything
  else, purge, delete, nor publish into a ready queue or past the delays.
  ``defer()`` declares nothing; with ``DECLARE`` off it checks only the
  ingest exchange, passively (RabbitMQ 3.10 to 4.2.5 need no permission for
  a passive declare, 4.2.7+ and 4.3.1+ any of the three, 4.2.6 and 4.3.0
  *configure*).
* ``worker``: reads every queue of the prefix (ready queues, the scheduler's,
  the cancels stream, the failed queue for re-drives), publishes retries,
  re-drives and result records to the ingest exchanges, and failure records,
  requeues and the scheduler's records through the default exchange. It configures nothing,
  so it cannot delete a queue: the topology must exist (``DECLARE`` off).
* ``admin``: declares and removes the topology (``declare_delay_topology``):
  everything under the prefix, and the default exchange for the registry of
  declared topologies; and moves jobs to another broker (``deferred_transfer``:
  its staging exchange and queues, and a server-named exclusive queue that
  tells two URLs of one broker apart).

Pure: no broker I/O. The regexes cover every topology of the prefix (they
change with RADIX, RESOLUTION, MAX_DELAY and QUEUE_TYPE).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROLES = ("publisher", "worker", "admin")
#: What the default exchange is called in permission checks.
DEFAULT_EXCHANGE = "amq.default"
NOTHING = "^$"


@dataclass(frozen=True)
class Permissions:
    """One user's regexes on the vhost."""

    configure: str
    write: str
    read: str


def for_role(role: str, prefix: str) -> Permissions:
    """The permissions of ``role`` (``publisher``, ``worker`` or ``admin``) under ``prefix``."""
    p = re.escape(prefix)
    # The names topology.py gives, and nothing else: a regex as loose as
    # "PREFIX\..+" would also match the names of a prefix nested in this one
    # ("app" and "app.x"). Any topology id: RADIX, RESOLUTION, MAX_DELAY and
    # QUEUE_TYPE change it, HOLD_WINDOW adds the held levels (".H2"),
    # PRIORITIES the classic queues' priority levels (".P9"), and quorum delay
    # queues under classic ready queues ".quorum-delays".
    topology = (
        r"delay\.r\d+\.\d+ms\.L\d+(\.H\d+)?(\.P\d+)?\.(classic|quorum)(\.(classic|quorum)-delays)?"
    )
    ingest = rf"{p}\.{topology}\.ingest"
    everything = (
        rf"{p}\.({topology}\.(ingest|after\.L\d+|L\d+\.d\d+)"
        r"|(ready|hold)\.(p\d\.)?[A-Za-z0-9_-]+|failed|topologies|scheduler|schedules|cancels|results|ledger(-pages|-heads)?|keeper|up)"
    )
    default = re.escape(DEFAULT_EXCHANGE)
    staging = rf"{p}\.transfer(\.out)?|amq\.gen-[A-Za-z0-9_-]+"
    if role == "publisher":
        # Reading a result (deferred.result(), get_result()) consumes the results
        # stream; get_result() of a task not started yet, the ledger (deferred.records.pending);
        # listing the pending jobs (deferred.pending()), the cancels and the checkpoints too.
        return Permissions(
            configure=NOTHING,
            write=f"^{ingest}$",
            read=rf"^{p}\.(results|cancels|ledger(-pages|-heads)?)$",
        )
    if role == "worker":
        return Permissions(
            configure=NOTHING, write=f"^({ingest}|{default})$", read=f"^{everything}$"
        )
    if role == "admin":
        return Permissions(
            configure=f"^({everything}|{staging})$",
            write=f"^({everything}|{staging}|{default})$",
            read=f"^({everything}|{staging})$",
        )
    raise ValueError(f"Unknown role {role!r}: one of {', '.join(ROLES)}.")


def user_name(role: str, prefix: str) -> str:
    """The suggested user name of ``role``: ``PREFIX-role``."""
    return f"{prefix}-{role}"
