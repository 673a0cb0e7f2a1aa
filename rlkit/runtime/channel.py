"""The authenticated control channel between the controller and its workers (local backend).

The controller listens on loopback; every peer must pass multiprocessing's HMAC challenge in
both directions with a 32-byte secret that reaches each worker through its stdin pipe (never
argv or the environment, which other users may read). One connection per worker carries small
tuples pickled by ``Connection.send``; function payloads inside them are bytes made by
``transport.dumps``.

controller -> worker: ("init", {"device", "sys_path", "shm_prefix", "init_method"}),
("call", call_id, payload),
("shutdown",).
worker -> controller: ("hello", {"rank", "pid", "host", "cuda_devices"}), ("ready", {"device"}),
("failed", error), ("loaded", call_id), ("result", call_id, ok, payload_or_error),
("heartbeat", unix_time, rss_mb); ``error`` is a dict with "type", "message", "traceback".
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import struct
import sys
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import IO, Any

logger = logging.getLogger(__name__)


AUTH_TIMEOUT_S = 10.0


class ControlListener:
    """Loopback listener that authenticates each peer in its own thread, so a stalled or hostile
    peer cannot hold up the workers' connections; refused peers are logged. A peer that has not
    answered the challenge within ``auth_timeout`` seconds is refused too."""

    def __init__(self, auth_timeout: float = AUTH_TIMEOUT_S) -> None:
        self.auth_timeout = auth_timeout
        self.authkey = secrets.token_bytes(32)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._sock.getsockname()
        self._accepted: queue.Queue[Connection] = queue.Queue()
        self._sealed = threading.Event()
        threading.Thread(target=self._accept_loop, name="rlkit-control-accept", daemon=True).start()

    def accept(self, timeout: float) -> Connection | None:
        """The next authenticated connection, or None after ``timeout`` s."""
        try:
            return self._accepted.get(timeout=timeout)
        except queue.Empty:
            return None

    def seal(self) -> None:
        """All workers have joined: close any further (authenticated) connection."""
        self._sealed.set()

    def close(self) -> None:
        """Stop listening (wakes the accept thread)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._sock.accept()
            except OSError:  # closed
                return
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _set_receive_timeout(sock, self.auth_timeout)  # a blocked read then fails
            threading.Thread(target=self._authenticate, args=(Connection(sock.detach()), peer),
                             name="rlkit-control-auth", daemon=True).start()

    def _authenticate(self, conn: Connection, peer: Any) -> None:
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except Exception as exc:  # noqa: BLE001 - whatever goes wrong, the peer is refused
            logger.warning("refused a connection to the control port from %s: %s: %s",
                           peer, type(exc).__name__, exc)
            conn.close()
            return
        if self._sealed.is_set():
            logger.warning("closed an unexpected connection from %s: all workers have joined", peer)
            conn.close()
            return
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            _set_receive_timeout(sock, 0.0)  # authenticated: reads may wait as long as they need
        self._accepted.put(conn)


def _set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO: a blocking read on the socket fails after ``seconds`` (0: never)."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", whole, int((seconds - whole) * 1e6)))


class WorkerChannel:
    """The worker's end of the connection: one receiving thread; sends from several threads
    (results, heartbeats) are serialised by a lock."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        # Small messages back to back ("loaded", then "result") must not wait for the peer's
        # delayed ACK (Nagle's algorithm): that would add ~40 ms to every call.
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, msg: tuple) -> None:
        with self._lock:
            self._conn.send(msg)

    def recv(self) -> tuple:
        return self._conn.recv()


def send_authkey(stdin: IO[bytes], authkey: bytes) -> None:
    """Give a just-started worker the secret through its stdin pipe, then close the pipe."""
    try:
        stdin.write(authkey.hex().encode() + b"\n")
        stdin.close()
    except BrokenPipeError:  # the worker already died; start-up reports it
        pass


def read_authkey() -> bytes:
    """Read the secret from stdin (worker side), then point stdin at /dev/null."""
    authkey = bytes.fromhex(sys.stdin.buffer.readline().decode().strip())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return authkey
