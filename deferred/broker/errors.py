"""The broker's errors, as the rest of the library and its users see them.

Every pika error is turned into one of these, with a message that says what
to do, so nothing outside this package needs to know pika.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Something went wrong talking to RabbitMQ.

    Raised by ``defer()`` and ``defer_many()``, it carries the job ids of the
    call (``job_id``, ``job_ids``). After a timeout or a lost connection the
    outcome is unknown, since the broker may have taken a job whose confirm was
    lost: the id is how to find it (it runs at most once more than expected,
    never silently lost).
    """

    #: The id of the job ``defer()`` was publishing (the first one for ``defer_many()``).
    job_id: str | None = None
    #: Every job id of the call, in order.
    job_ids: tuple[str, ...] = ()


class BrokerUnavailable(BrokerError):
    """RabbitMQ could not be reached, or the connection was lost."""


class TopologyNotDeclared(BrokerError):
    """A message had nowhere to go: the exchanges or queues do not exist."""


class TopologyConflict(BrokerError):
    """A queue or exchange exists with other arguments than the plan's."""


class MessageTooLarge(BrokerError, ValueError):
    """The broker refused a message over its ``max_message_size``.

    A ``ValueError`` too, like a body over ``MAX_MESSAGE_BYTES``: the call's
    input is what must change. Nothing of it was taken.
    """


class StreamGone(BrokerUnavailable):
    """The broker cancelled a stream's consumer: the stream was deleted (or moved)."""


class PublishRefused(BrokerUnavailable):
    """The broker kept refusing a message (negative confirms) until the deadline.

    A quorum queue refuses while it has no leader, e.g. for the seconds after
    a node is lost; nothing of a refused publish was taken.
    """


NOT_DECLARED_HINT = (
    "Run `python manage.py declare_delay_topology` (once per deploy) to create it; with "
    "DEFERRED['DECLARE'] = False, create it with the definitions or Terraform that "
    "`declare_delay_topology --format definitions|terraform` prints."
)
