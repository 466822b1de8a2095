"""RabbitMQ's management HTTP API: what AMQP cannot tell.

AMQP answers a passive declare with a queue's ready messages and consumers,
and nothing else. The management plugin's API also knows the messages a
worker holds (unacked), where a quorum queue's leader and members are, which
nodes of the cluster run, and how many messages a queue has dead-lettered
without its target confirming them yet: the figure that shows RabbitMQ's
stuck at-least-once dead-letters (see :mod:`deferred.cluster.stuck`).

It is optional: the plugin may be off, its port closed or the user refused.
Every call then returns ``None`` within a short timeout and the caller shows
the figure as unknown. Several base URLs (one per node) are tried in order.
Credentials are those of the API URL if it has any, else those of the broker
URL; a redirect is never followed, since it would carry them elsewhere.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deferred.broker import Urls, as_urls, tls_context, vhost_of

logger = logging.getLogger("deferred.http_api")

#: The management API is optional: a status never waits long for it.
MANAGEMENT_TIMEOUT_S = 1.0
#: How long a change (a replica removed or added) may take to answer: it waits for Raft.
CHANGE_TIMEOUT_S = 30.0
NOT_FOUND = 404
METHOD_NOT_ALLOWED = 405

#: The columns asked for when listing queues (the API sends everything otherwise).
QUEUE_COLUMNS = (
    "name",
    "type",
    "node",
    "leader",
    "members",
    "online",
    "messages",
    "messages_ready",
    "messages_unacknowledged",
    "messages_dlx",
    "consumers",
)
#: With a history asked for: the figures whose samples the API keeps.
HISTORY_COLUMNS = ("messages_details", "messages_ready_details", "messages_unacknowledged_details")
#: The management plugin's default sampling interval (collect_statistics_interval).
SAMPLE_EVERY_S = 5


class ManagementError(Exception):
    """The management API refused a request or does not answer."""


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect would carry the broker credentials elsewhere: treat it as a failure."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


@dataclass(frozen=True)
class QueueInfo:
    """One queue as the management API reports it."""

    name: str
    type: str
    messages: int
    ready: int
    unacked: int
    #: Dead-lettered by this queue and not yet confirmed by the target queue
    #: (quorum queues, at-least-once dead-lettering); 0 elsewhere.
    dead_lettered: int
    #: The node of the queue's leader (quorum) or of the queue (classic).
    leader: str | None
    members: tuple[str, ...]
    online: tuple[str, ...]
    #: ``(unix time in s, dead-lettered)`` samples, oldest first, when a
    #: history was asked for: derived as messages - ready - unacked, the
    #: figures whose history the management API keeps.
    dead_lettered_history: tuple[tuple[float, int], ...] = ()

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> QueueInfo:
        messages = int(data.get("messages") or 0)
        ready = int(data.get("messages_ready") or 0)
        unacked = int(data.get("messages_unacknowledged") or 0)
        if data.get("messages_dlx") is not None:
            dead_lettered = int(data["messages_dlx"])
        else:
            # Brokers that do not report it: what is counted in neither
            # ready nor unacked is waiting for its dead-letter confirm.
            dead_lettered = max(0, messages - ready - unacked)
        leader = data.get("leader") or data.get("node")
        return cls(
            name=str(data["name"]),
            type=str(data.get("type") or "classic"),
            messages=messages,
            ready=ready,
            unacked=unacked,
            dead_lettered=dead_lettered if data.get("type") == "quorum" else 0,
            leader=str(leader) if leader else None,
            members=tuple(str(m) for m in data.get("members") or ()),
            online=tuple(str(m) for m in data.get("online") or ()),
            dead_lettered_history=_history(data) if data.get("type") == "quorum" else (),
        )


def _samples(data: dict[str, Any], key: str) -> dict[int, int]:
    details = data.get(key) or {}
    return {int(s["timestamp"]): int(s["sample"]) for s in details.get("samples") or ()}


def _history(data: dict[str, Any]) -> tuple[tuple[float, int], ...]:
    messages = _samples(data, "messages_details")
    ready = _samples(data, "messages_ready_details")
    unacked = _samples(data, "messages_unacknowledged_details")
    return tuple(
        (at / 1000, max(0, count - ready.get(at, 0) - unacked.get(at, 0)))
        for at, count in sorted(messages.items())
    )


@dataclass(frozen=True)
class NodeInfo:
    """A cluster node as the management API reports it."""

    name: str
    running: bool
    #: Resource alarms in effect on the node ("memory", "disk").
    alarms: tuple[str, ...]

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> NodeInfo:
        alarms = [
            name
            for name, key in (("memory", "mem_alarm"), ("disk", "disk_free_alarm"))
            if data.get(key)
        ]
        return cls(str(data["name"]), bool(data.get("running")), tuple(alarms))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "running": self.running, "alarms": list(self.alarms)}


class ManagementAPI:
    """A client for the API of one cluster, through the first base URL that answers."""

    def __init__(
        self,
        api_urls: Sequence[str],
        broker_urls: Urls,
        *,
        timeout: float = MANAGEMENT_TIMEOUT_S,
        change_timeout: float = CHANGE_TIMEOUT_S,
    ) -> None:
        self.api_urls = tuple(api_urls)
        self.broker_urls = as_urls(broker_urls)
        self.timeout = timeout
        self.change_timeout = change_timeout
        self.vhost = vhost_of(self.broker_urls)
        # An https:// API is verified with the broker URL's CA (and client
        # certificate) when it has TLS options; else with the system's CAs.
        try:
            context = tls_context(self.broker_urls[0])
        except (OSError, ValueError):
            context = None
        self._opener = (
            urllib.request.build_opener(
                _RefuseRedirects, urllib.request.HTTPSHandler(context=context)
            )
            if context is not None
            else _NO_REDIRECTS
        )
        #: The base URL that answered last (tried first next time).
        self.answered: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.api_urls)

    def _base_and_token(self, api_url: str) -> tuple[str, str]:
        api = urllib.parse.urlsplit(api_url)
        if api.username is not None:
            user = urllib.parse.unquote(api.username)
            password = urllib.parse.unquote(api.password or "")
        else:
            broker = urllib.parse.urlsplit(self.broker_urls[0])
            user = urllib.parse.unquote(broker.username or "guest")
            password = urllib.parse.unquote(broker.password or "guest")
        host = api.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if api.port:
            netloc += f":{api.port}"
        base = urllib.parse.urlunsplit((api.scheme, netloc, api.path.rstrip("/"), "", ""))
        return base, base64.b64encode(f"{user}:{password}".encode()).decode()

    def request(self, method: str, path: str, body: Any = None, *, change: bool = False) -> Any:
        """Send one request to the first base URL that answers; the decoded JSON, or ``None``.

        ``ManagementError`` when no base URL answers or the API refuses
        (after trying the others: a node that is down refuses too). A 404 is
        final, not a reason to ask another node: it raises ``LookupError``.

        A ``change`` (removing a replica, adding one) gets a longer timeout
        and is never sent again to another node once one may have received
        it: a change that timed out may still be under way, and repeating
        it could remove a second replica.
        """
        if not self.api_urls:
            raise ManagementError("DEFERRED['MANAGEMENT_URL'] is False: the API is not asked.")
        order = sorted(self.api_urls, key=lambda url: url != self.answered)
        problems = []
        data = None if body is None else json.dumps(body).encode()
        for api_url in order:
            base, token = self._base_and_token(api_url)
            request = urllib.request.Request(
                f"{base}/api/{path}",
                data=data,
                method=method,
                headers={
                    "Authorization": f"Basic {token}",
                    "Accept": "application/json",
                    "Content-Type": "application/json",
                },
            )
            timeout = max(self.timeout, self.change_timeout) if change else self.timeout
            try:
                with self._opener.open(request, timeout=timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as exc:
                if exc.code in (NOT_FOUND, METHOD_NOT_ALLOWED):
                    self.answered = api_url
                    raise LookupError(f"{method} {path}: HTTP {exc.code} {exc.reason}") from exc
                problems.append(f"{base}: HTTP {exc.code} {exc.reason}")
                continue
            except (OSError, ValueError, http.client.HTTPException) as exc:
                # HTTPException: a node dying in the middle of its answer.
                refused = isinstance(getattr(exc, "reason", exc), ConnectionRefusedError)
                if change and not refused:
                    raise ManagementError(
                        f"{method} {path} through {base}: no answer ({exc!r}); it may or may "
                        "not have been done, so it is not sent to another node"
                    ) from exc
                problems.append(f"{base}: {exc!r}")
                continue
            self.answered = api_url
            try:
                return json.loads(raw) if raw.strip() else None
            except ValueError as exc:
                raise ManagementError(f"{base} answered something that is not JSON") from exc
        raise ManagementError("The management API does not answer: " + "; ".join(problems))

    def _quoted_vhost(self) -> str:
        return _quote(self.vhost)

    def queues(self, prefix: str, *, history_s: float = 0) -> dict[str, QueueInfo] | None:
        """Every queue of the vhost under ``prefix`` (``PREFIX.*``); ``None`` if unknown.

        ``history_s``: also the samples of the last that many seconds, from
        which each queue's dead-lettered history is derived.
        """
        columns = QUEUE_COLUMNS + (HISTORY_COLUMNS if history_s else ())
        query = f"columns={','.join(columns)}"
        if history_s:
            age = int(history_s) + SAMPLE_EVERY_S
            query += f"&lengths_age={age}&lengths_incr={SAMPLE_EVERY_S}"
        try:
            rows = self.request("GET", f"queues/{self._quoted_vhost()}?{query}")
            return {
                row["name"]: QueueInfo.from_api(row)
                for row in rows
                if str(row.get("name", "")).startswith(f"{prefix}.")
            }
        except (ManagementError, LookupError, TypeError, KeyError, AttributeError) as exc:
            logger.debug("Management API: cannot list queues: %s", exc)
            return None

    def counts_disabled(self) -> bool:
        """Whether the API keeps no message counts (``disable_stats`` in its overview).

        RabbitMQ 4.3 with the deprecated feature management_metrics_collection
        denied (or ``management_agent.disable_metrics_collector``) lists queues
        without them. A queue not yet sampled has none either, so the overview
        tells the two apart. ``False`` when unknown.
        """
        try:
            return bool(self.request("GET", "overview").get("disable_stats"))
        except (ManagementError, LookupError, TypeError, AttributeError) as exc:
            logger.debug("Management API: cannot read the overview: %s", exc)
            return False

    def nodes(self) -> list[NodeInfo] | None:
        """The cluster's nodes and whether they run; ``None`` if unknown."""
        try:
            return [NodeInfo.from_api(row) for row in self.request("GET", "nodes")]
        except (ManagementError, LookupError, TypeError, KeyError, AttributeError) as exc:
            logger.debug("Management API: cannot list nodes: %s", exc)
            return None

    def delete_member(self, queue: str, node: str) -> None:
        """Remove ``node``'s replica of quorum queue ``queue`` (RabbitMQ 3.13+, administrator).

        ``LookupError`` when the API has no such endpoint (older brokers) or
        the queue is gone; ``ManagementError`` when it refuses.
        """
        self.request(
            "DELETE",
            f"queues/quorum/{self._quoted_vhost()}/{_quote(queue)}/replicas/delete",
            {"node": node},
            change=True,
        )

    def add_member(self, queue: str, node: str) -> None:
        """Add a replica of quorum queue ``queue`` on ``node`` (see :meth:`delete_member`)."""
        self.request(
            "POST",
            f"queues/quorum/{self._quoted_vhost()}/{_quote(queue)}/replicas/add",
            {"node": node},
            change=True,
        )

    def unacked(self, prefix: str, queues: Sequence[str]) -> dict[str, int] | None:
        """Unacked messages of each of ``queues`` (existing ones only); ``None`` if unknown."""
        found = self.queues(prefix)
        if found is None:
            return None
        return {name: found[name].unacked for name in queues if name in found}
