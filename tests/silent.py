"""A node that goes silent: a TCP relay to the real broker that can stop relaying.

A node that dies with its host, or behind a dropped route, sends no RST: the
client's socket stays open and nothing ever answers. Killing a RabbitMQ node
on this machine does not show that (the kernel resets its sockets at once),
so the tests put this relay in front of the real broker and silence it:
from then on every byte sent to it is swallowed, no connection is closed, and
new connections are accepted but never answered.
"""

from __future__ import annotations

import select
import socket
import threading
from types import TracebackType


class SilentRelay:
    """``127.0.0.1:<port>`` relaying to ``target`` until :meth:`silence`."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._silent = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="silent-relay", daemon=True)

    def url(self, vhost: str = "%2F") -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{vhost}"

    def silence(self) -> None:
        """From now on nothing passes either way and nothing is closed."""
        self._silent.set()

    def __enter__(self) -> SilentRelay:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed.set()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.close()
                except OSError:
                    pass

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._keep(client)
            if self._silent.is_set():
                continue  # accepted, never answered
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            self._keep(upstream)
            threading.Thread(
                target=self._pump, args=(client, upstream), name="silent-relay-pump", daemon=True
            ).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        peers = {client: upstream, upstream: client}
        while not self._closed.is_set():
            try:
                readable, _, _ = select.select(list(peers), [], [], 0.1)
            except (OSError, ValueError):
                return
            if self._silent.is_set():
                # Swallow whatever arrives; keep both sockets open (a side that
                # hung up is no longer watched).
                for sock in readable:
                    try:
                        data = sock.recv(65536)
                    except OSError:
                        data = b""
                    if not data:
                        peers.pop(sock, None)
                if not peers:
                    return
                continue
            for sock in readable:
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    for each in peers:
                        each.close()
                    return
                try:
                    peers[sock].sendall(data)
                except OSError:
                    return
