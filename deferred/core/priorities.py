"""Job priorities: one scale for ``@task(priority=...)`` and django.tasks, mapped onto
what RabbitMQ offers.

The scale is Django's: an integer from -100 to 100, 0 by default, higher runs
first. The same number means the same thing whichever way a job was made, and
a django.tasks ``priority`` is taken as it is.

RabbitMQ orders a queue's messages by the ``priority`` property:

- classic queues declared with ``x-max-priority`` (levels 0 to that maximum;
  this library declares 9: RabbitMQ advises few levels, each costs some
  memory and CPU);
- quorum queues on 4.0 to 4.2: two levels, "high" for 5 and above, "normal"
  below; quorum queues on 4.3: 32 levels;
- quorum queues on 3.x: none.

:func:`level` maps the scale onto 0-9 with the default at 4: on 4.0-4.2
quorum queues, a job above the default is "high" and every other "normal",
so what two levels can keep of the order is kept. Positive priorities take
levels 5-9 (20 apart), negative ones 3-0 (25 apart): jobs whose priorities
fall in one band share a level, and keep their due order within it.
"""

from __future__ import annotations

from typing import Any

MIN_PRIORITY = -100
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 0
#: The highest level, the classic queues' ``x-max-priority``.
MAX_LEVEL = 9
#: The level of a job of the default priority.
DEFAULT_LEVEL = 4


def validate_priority(value: Any, name: str = "priority") -> int:
    """``value`` if it is an integer from -100 to 100; ``TypeError`` or ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer from -100 to 100, got {value!r}.")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"{name} must be from -100 to 100 (higher runs first), got {value}.")
    return value


def level(priority: int) -> int:
    """The AMQP ``priority`` (0-9) of a job of ``priority`` (-100..100)."""
    if priority > 0:
        return DEFAULT_LEVEL + 1 + (min(priority, MAX_PRIORITY) - 1) // 20
    if priority < 0:
        return max(0, DEFAULT_LEVEL - 1 - (-priority - 1) // 25)
    return DEFAULT_LEVEL


def top_of(amqp_level: int) -> int:
    """The highest priority :func:`level` maps to ``amqp_level``: where a job whose exact
    priority is not known yet (its body not read) waits among jobs whose priority is."""
    if amqp_level > DEFAULT_LEVEL:
        return min(MAX_PRIORITY, (amqp_level - DEFAULT_LEVEL) * 20)
    if amqp_level < DEFAULT_LEVEL:
        return -1 - (DEFAULT_LEVEL - 1 - max(0, amqp_level)) * 25
    return DEFAULT_PRIORITY


def broker_levels(queue_type: str, version: tuple[int, ...] | None) -> int:
    """How many priority levels RabbitMQ ``version`` gives ``queue_type`` queues as this
    library declares them (1: none); ``version`` ``None``: not known, assumed 4.0's."""
    if queue_type == "classic":
        return MAX_LEVEL + 1
    if version is not None and version < (4, 0):
        return 1
    if version is not None and version >= (4, 3):
        return 32
    return 2


def honoured(priority: int, levels: int) -> bool:
    """Whether a job of ``priority`` runs before the default ones, or after them, as it
    asks, on queues of ``levels`` levels."""
    if priority == DEFAULT_PRIORITY:
        return True
    if levels <= 1:
        return False
    if levels == 2:
        return priority > 0  # only "high": nothing runs after the default ones
    return True
