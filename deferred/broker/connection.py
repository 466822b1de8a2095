"""Connections: URLs and TLS, connecting with failover across a cluster's nodes,
deadlines, and closing without waiting on a dying broker."""

from __future__ import annotations

import ast
import logging
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import pika
import pika.exceptions as px
from pika.adapters.utils import connection_workflow

from deferred.broker.errors import BrokerUnavailable

logger = logging.getLogger("deferred.broker")


PERSISTENT = pika.DeliveryMode.Persistent
NOT_FOUND = 404
PRECONDITION_FAILED = 406


# pika hands a failed handshake's own error up as it is (a stack timeout: a
# node that accepts the TCP connection and then never answers), not as an
# AMQPConnectionError.
CONNECTION_ERRORS = (
    px.AMQPConnectionError,
    px.ChannelWrongStateError,
    ConnectionError,
    OSError,
    connection_workflow.AMQPConnectorException,
    connection_workflow.AMQPConnectionWorkflowFailed,
)


#: How long a long-lived connection (worker, commands) may stay blocked by
#: RabbitMQ (memory or disk alarm) before it fails, unless the URL sets
#: ``blocked_connection_timeout``. A publish has its own, shorter deadline.
BLOCKED_TIMEOUT_S = 30.0

#: A refused publish (negative confirm) is tried again after this pause, doubling up to the cap.
REFUSED_PAUSE_S = 0.05
REFUSED_PAUSE_CAP_S = 0.5

#: The default deadline of one publish (``DEFERRED['PUBLISH_TIMEOUT']``).
PUBLISH_TIMEOUT_S = 10.0

#: One URL, or the URLs of a cluster's nodes in the order they are tried.
Urls = str | Sequence[str]


def as_urls(urls: Urls) -> tuple[str, ...]:
    """``urls`` as a tuple (a single URL is a cluster of one)."""
    return (urls,) if isinstance(urls, str) else tuple(urls)


class Failover:
    """Which node of a URL list each new connection tries first.

    In order, starting from the first URL; the node last connected to stays
    first while it works, and when a connection to it is lost the next
    connection starts from the node after it. So every client of a process
    moves off a dead node together, and nobody waits on the dead node first
    while another one answers.
    """

    def __init__(self) -> None:
        self._first: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()

    def order(self, urls: tuple[str, ...]) -> list[int]:
        with self._lock:
            first = self._first.get(urls, 0)
        return [(first + i) % len(urls) for i in range(len(urls))]

    def connected(self, urls: tuple[str, ...], index: int) -> None:
        with self._lock:
            self._first[urls] = index

    def lost(self, urls: tuple[str, ...], index: int) -> None:
        with self._lock:
            if self._first.get(urls, 0) == index:
                self._first[urls] = (index + 1) % len(urls)


failover = Failover()


@dataclass(frozen=True)
class Node:
    """The node a connection went to: its place in the URL list, and the URL."""

    urls: tuple[str, ...]
    index: int

    @property
    def url(self) -> str:
        return self.urls[self.index]

    @property
    def address(self) -> str:
        """``host:port/vhost``, without credentials: for messages, logs and status."""
        return safe_url(self.url)

    def lost(self) -> None:
        """Note that the connection to this node was lost: try the next node first."""
        failover.lost(self.urls, self.index)


def parameters(url: str) -> pika.URLParameters:
    """pika's parameters for ``url``, with its TLS options read as pika reads them.

    An ``amqps://`` URL verifies the broker's certificate against the system's
    CAs and checks its host name (pika's default). Its ``ssl_options`` query
    argument is pika's (a dict literal: ``cafile``, ``certfile``, ``keyfile``,
    ``password``, ``ciphers``, ``server_hostname``), read here rather than by
    pika so that naming a CA file or a client certificate keeps verification
    and host-name checks on, and leaves the system's CAs out only when a CA
    file is given. The ``TLS_*`` settings arrive this way (:func:`with_tls_options`).
    """
    rest, ssl_value = _split_ssl_options(url)
    params = pika.URLParameters(rest)
    if ssl_value is not None:
        # As pika does: ssl_options turns TLS on, whatever the scheme says.
        params.ssl_options = _ssl_options(ssl_value)
    return params


def tls_context(url: str) -> ssl.SSLContext | None:
    """The SSL context of an ``amqps://`` URL with ``ssl_options`` (``None`` otherwise).

    The management API is asked with it too: the same CA, the same client certificate.
    """
    ssl_value = _split_ssl_options(url)[1]
    if ssl_value is None:
        return None
    context: ssl.SSLContext = _ssl_options(ssl_value).context
    return context


def with_tls_options(url: str, source: str, **options: str | None) -> str:
    """``url`` with ``options`` (``cafile``, ``certfile``, ``keyfile``,
    ``server_hostname``; None left out) as pika's ``ssl_options`` query argument.

    The URL is what every connection is made from, so the options travel with
    it: :func:`parameters` turns them into an SSL context. ``ValueError`` for a
    URL that is not amqps://, or that has ``ssl_options`` of its own; its
    message names the options as ``source`` (where the reader set them).
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "amqps":
        raise ValueError(
            f"{source} apply to amqps:// broker URLs; "
            f"{parts.scheme}://{parts.hostname}:{parts.port or 5672} is not encrypted."
        )
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "ssl_options" for key, _ in query):
        raise ValueError(
            f"A broker URL has its own ssl_options and {source} are given too: use one or "
            "the other."
        )
    given = {key: value for key, value in options.items() if value is not None}
    query.append(("ssl_options", repr(given)))
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def _split_ssl_options(url: str) -> tuple[str, str | None]:
    """``url`` without its ``ssl_options`` query argument, and that argument."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    ssl_value = next((v for k, v in query if k == "ssl_options"), None)
    if ssl_value is None:
        return url, None
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "ssl_options"])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), ssl_value


@lru_cache(maxsize=16)
def _ssl_options(value: str) -> pika.SSLOptions:
    """An ``ssl_options`` dict literal as ``pika.SSLOptions`` (cached: CA files are read once)."""
    try:
        opts = ast.literal_eval(value)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"ssl_options in the broker URL is not a dict literal: {exc}") from None
    if not isinstance(opts, dict):
        raise ValueError("ssl_options in the broker URL must be a dict literal")
    context = ssl.create_default_context(
        cafile=opts.get("cafile") or opts.get("ca_certs"),
        capath=opts.get("capath") or opts.get("ca_path"),
        cadata=opts.get("cadata") or opts.get("ca_data"),
    )
    if opts.get("certfile"):
        context.load_cert_chain(opts["certfile"], opts.get("keyfile"), opts.get("password"))
    if opts.get("ciphers"):
        context.set_ciphers(opts["ciphers"])
    return pika.SSLOptions(context, server_hostname=opts.get("server_hostname"))


def open_connection(
    urls: Urls, *, timeout: float | None = None, heartbeat: int | None = None
) -> tuple[pika.BlockingConnection, Node]:
    """Connect to the first node that answers, in failover order.

    ``timeout`` bounds the whole call (every node tried); without it each
    node gets pika's own connect timeouts. ``BrokerUnavailable`` names every
    node tried and why it failed.
    """
    all_urls = as_urls(urls)
    deadline = None if timeout is None else time.monotonic() + timeout
    failures = []
    order = failover.order(all_urls)
    for position, index in enumerate(order):
        url = all_urls[index]
        try:
            params = parameters(url)
        except (OSError, ValueError) as exc:  # a CA or certificate file that cannot be read
            failures.append(f"{safe_url(url)}: bad TLS options: {exc}")
            continue
        if "blocked_connection_timeout" not in url:
            # pika's default is to wait forever: a web request would hang.
            params.blocked_connection_timeout = BLOCKED_TIMEOUT_S
        if heartbeat is not None and "heartbeat" not in url:
            params.heartbeat = heartbeat
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failures.append(f"{safe_url(url)}: not tried, out of time")
                continue
            # A node that died without a word (no RST: a lost host, a dropped
            # route) holds a connect until its timeout: each node gets an equal
            # share of what is left, so one such node cannot eat the deadline
            # of the nodes after it. URL options that retry (connection_attempts,
            # retry_delay) would wait past the share: one attempt each here.
            share = remaining / (len(order) - position)
            params.socket_timeout = min(params.socket_timeout or share, share)
            params.stack_timeout = min(params.stack_timeout or share, share)
            params.connection_attempts = 1
            params.retry_delay = 0
        try:
            connection = pika.BlockingConnection(params)
        except (*CONNECTION_ERRORS, px.AMQPError) as exc:
            hint = _tls_hint(repr(exc), tls=params.ssl_options is not None)
            failures.append(f"{safe_url(url)}: {exc!r}{hint}")
            continue
        failover.connected(all_urls, index)
        return connection, Node(all_urls, index)
    where = "at " if len(all_urls) == 1 else f"at any of its {len(all_urls)} nodes: "
    raise BrokerUnavailable(f"Cannot connect to RabbitMQ {where}{'; '.join(failures)}")


def _tls_hint(error: str, *, tls: bool = True) -> str:
    """What to change when a TLS handshake failed, from pika's description of it.

    Under TLS 1.3 the client's handshake ends before the broker has checked
    the client's certificate: a broker that requires one and gets none sends
    its alert and closes, and the client, already sending the AMQP header,
    may read the alert (``CERTIFICATE_REQUIRED``) or only a reset connection,
    by a race. A TLS connection reset or cut short during the AMQP handshake
    gets the same hint, said as a likely cause.
    """
    if "CERTIFICATE_VERIFY_FAILED" in error:
        return (
            " (the broker's certificate does not verify: DEFERRED['TLS_CA_FILE'] names the CA "
            "that signed it, DEFERRED['TLS_SERVER_NAME'] the name it carries)"
        )
    if "CERTIFICATE_REQUIRED" in error or "PEER_DID_NOT_RETURN_A_CERTIFICATE" in error:
        return (
            " (the broker requires a client certificate: set DEFERRED['TLS_CERT_FILE'] and "
            "DEFERRED['TLS_KEY_FILE'])"
        )
    closed = ("ConnectionResetError", "Connection reset", "BrokenPipeError", "SSLEOFError")
    if tls and any(sign in error for sign in closed):
        return (
            " (the broker closed the TLS connection during the handshake: most likely it "
            "requires a client certificate: set DEFERRED['TLS_CERT_FILE'] and "
            "DEFERRED['TLS_KEY_FILE'])"
        )
    return ""


def answers(url: str, timeout: float = 1.0) -> bool:
    """Whether the node at ``url`` accepts a connection now (the failover order is untouched)."""
    try:
        params = parameters(url)
    except (OSError, ValueError):
        return False
    params.socket_timeout = params.stack_timeout = timeout
    params.connection_attempts = 1
    try:
        connection = pika.BlockingConnection(params)
    except (*CONNECTION_ERRORS, px.AMQPError):
        return False
    close_quietly(connection)
    return True


def server_version(urls: Urls, *, timeout: float = 5.0) -> tuple[int, ...]:
    """The RabbitMQ release of the first node that answers, e.g. ``(4, 3, 6)``, from
    what it says when a connection opens; ``BrokerUnavailable`` if none answers."""
    connection, _ = open_connection(urls, timeout=timeout)
    try:
        raw = connection._impl.server_properties.get("version", b"0")
    finally:
        close_quietly(connection)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    parts = []
    for part in text.split("-")[0].split(".")[:3]:
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def connect(urls: Urls, *, timeout: float | None = None) -> pika.BlockingConnection:
    """Open a connection to the first node that answers (see :func:`open_connection`)."""
    return open_connection(urls, timeout=timeout)[0]


def safe_url(url: str) -> str:
    """The URL without its password (nor any query), for messages and logs."""
    params = pika.URLParameters(_split_ssl_options(url)[0])
    vhost = "" if params.virtual_host == "/" else params.virtual_host
    return f"{params.host}:{params.port}/{vhost}"


def vhost_of(urls: Urls) -> str:
    """The virtual host the URL(s) connect to, read exactly as pika reads it (no I/O)."""
    return str(pika.URLParameters(_split_ssl_options(as_urls(urls)[0])[0]).virtual_host)


class DeadlineExceeded(px.AMQPConnectionError):  # type: ignore[misc]
    """The call's deadline passed: the connection was torn down under it."""


@contextmanager
def within_deadline(connection: pika.BlockingConnection, seconds: float) -> Iterator[None]:
    """Tear ``connection`` down if the block is still running after ``seconds``.

    A blocking publish waits for its confirm with no limit, and a closing
    handshake waits for an answer that a blocked broker never sends. This
    timer lives in pika's own I/O loop, which runs while pika waits, and
    aborts the socket: the wait ends with ``DeadlineExceeded``.
    """
    impl = connection._impl

    def expire() -> None:
        if not connection.is_closed:
            impl._terminate_stream(DeadlineExceeded(f"no answer within {seconds:.1f} s"))

    timer = impl._adapter_call_later(max(seconds, 0.0), expire)
    try:
        yield
    finally:
        impl._adapter_remove_timeout(timer)


CLOSE_TIMEOUT_S = 2.0


def close_quietly(connection: pika.BlockingConnection) -> None:
    """Close ``connection``, never waiting long: a blocked or dying broker may not answer."""
    try:
        if connection.is_open:
            with within_deadline(connection, CLOSE_TIMEOUT_S):
                connection.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass


@contextmanager
def setting_up(connection: pika.BlockingConnection, node: Node, doing: str) -> Iterator[None]:
    """Guard the set-up of a connection just opened (channels, declares, consumers).

    Whatever fails, the connection is closed, so a failed start never leaks one.
    A broker or network error also marks ``node`` lost, so the next attempt tries
    another node first, and becomes ``BrokerUnavailable`` saying what was being
    done; our own errors (``TopologyNotDeclared``...) pass through unchanged.
    """
    try:
        yield
    except (*CONNECTION_ERRORS, px.AMQPError) as exc:
        close_quietly(connection)
        node.lost()
        raise BrokerUnavailable(f"Could not {doing} at {node.address}: {exc!r}") from exc
    except BaseException:
        close_quietly(connection)
        raise


class _HideLines(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextmanager
def hide_pika_lines(logger_name: str, text: str) -> Iterator[None]:
    """Hide the lines of pika's logger ``logger_name`` that contain ``text``, in the
    block: what pika reports as news that is expected where it is used."""
    quiet = _HideLines(text)
    pika_logger = logging.getLogger(logger_name)
    pika_logger.addFilter(quiet)
    try:
        yield
    finally:
        pika_logger.removeFilter(quiet)
