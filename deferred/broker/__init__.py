"""All broker I/O: the only package that imports pika.

pika's ``BlockingConnection`` is not thread-safe, so publishers keep one
connection per thread, and the worker's consuming connection lives on one
I/O thread. pika's exceptions are translated into the library's own, with
messages that say what to do, so nothing outside this package needs to
know pika. One module per role, each importing only those before it:

- ``errors``: the exceptions users and the rest of the library see;
- ``connection``: URLs, TLS, connecting with failover, deadlines;
- ``publisher``: publishing with confirms, one connection per thread;
- ``admin``: declaring, checking, reading and taking from queues;
- ``consumer``: the worker's consuming connection;
- ``streams``: reading and following a stream (the cancels);
- ``results``: writing result records, and reading the stream by timestamp;
- ``lease``: leadership among workers (the scheduler);
- ``ledger``: the keeper's lease, the broker's "up" marker, reading the ledger.
"""

from deferred.broker.admin import (
    Admin,
    DeclareReport,
    QueueStats,
    Taken,
    admin_channel,
    not_declared,
    verify_exchange,
    verify_topology,
)
from deferred.broker.connection import (
    BLOCKED_TIMEOUT_S,
    PUBLISH_TIMEOUT_S,
    Failover,
    Node,
    Urls,
    answers,
    as_urls,
    connect,
    failover,
    open_connection,
    parameters,
    safe_url,
    server_version,
    tls_context,
    vhost_of,
)
from deferred.broker.consumer import LOST_CONSUMER_TIMEOUT, Consumer, Delivery, peek
from deferred.broker.errors import (
    BrokerError,
    BrokerUnavailable,
    MessageTooLarge,
    PublishRefused,
    StreamGone,
    TopologyConflict,
    TopologyNotDeclared,
)
from deferred.broker.lease import Lease
from deferred.broker.ledger import KeeperLink, read_stream
from deferred.broker.publisher import (
    COPY_HEADER,
    RESTART_COPY,
    Outgoing,
    Publisher,
    _publisher,
    publisher,
    publisher_for,
    send_record,
)
from deferred.broker.results import ResultReader, ResultWriter, Written
from deferred.broker.streams import StreamFollower

__all__ = [
    "BLOCKED_TIMEOUT_S",
    "COPY_HEADER",
    "LOST_CONSUMER_TIMEOUT",
    "PUBLISH_TIMEOUT_S",
    "RESTART_COPY",
    "Admin",
    "BrokerError",
    "BrokerUnavailable",
    "Consumer",
    "DeclareReport",
    "Delivery",
    "Failover",  # the tests check the failover order
    "KeeperLink",
    "Lease",
    "MessageTooLarge",
    "Node",
    "Outgoing",
    "PublishRefused",
    "Publisher",
    "QueueStats",
    "ResultReader",
    "ResultWriter",
    "StreamFollower",
    "StreamGone",
    "Taken",
    "TopologyConflict",
    "TopologyNotDeclared",
    "Urls",
    "Written",
    "_publisher",  # the tests clear its cache
    "admin_channel",
    "answers",
    "as_urls",
    "connect",
    "failover",  # the process's node order (the bench resets it)
    "not_declared",
    "open_connection",
    "parameters",
    "peek",
    "publisher",
    "publisher_for",
    "read_stream",
    "safe_url",
    "send_record",
    "server_version",
    "tls_context",
    "verify_exchange",
    "verify_topology",
    "vhost_of",
]
