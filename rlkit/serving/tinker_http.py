"""rlkit's Tinker server over HTTP: the SDK's endpoints (:mod:`rlkit.serving.tinker_service`) on a threaded stdlib
server, loopback only unless asked. Every request's API key is checked before its body is read; a body is read only
up to :data:`~rlkit.serving.tinker_wire.MAX_BODY_BYTES` and exactly as long as its Content-Length says; a connection
silent for ``IO_TIMEOUT_S`` mid-request (or idle between requests) is dropped.

Example:
    server = rlkit.serve_tinker(cluster)              # port 0: a free port
    service = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    ...
    server.close()
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import secrets
import socket
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rlkit.config.primitives import PrimitivesConfig
from rlkit.runtime.cluster import Cluster
from rlkit.serving.futures import Reply
from rlkit.serving.tinker_service import TinkerService, error_reply
from rlkit.serving.tinker_wire import MAX_BODY_BYTES
from rlkit.trainer.primitives import TrainingClient

logger = logging.getLogger(__name__)

IO_TIMEOUT_S = 30.0
"""How long a connection may be silent mid-request, or idle between requests, before it is dropped."""
_DRAIN_BYTES = 64 << 10
"""A refused request's body up to this size is read and dropped, so its connection can carry the next request."""


class TinkerHTTPServer(ThreadingHTTPServer):
    """The stdlib's threaded HTTP server, one thread per connection, which knows its open connections so that
    :meth:`drop` can end them."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self.closing = False

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            if self.closing:
                self.shutdown_request(request)
                return
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("tinker http: connection from %s ended by an error", client_address, exc_info=True)

    def drop(self) -> None:
        """Answer nothing more: end every open connection (keep-alive ones included)."""
        with self._connections_lock:
            self.closing = True
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class TinkerServer:
    """A running server: ``url`` and ``api_key`` for ``tinker.ServiceClient``; :meth:`close` stops it."""

    def __init__(self, httpd: TinkerHTTPServer, host: str, service: TinkerService, api_key: str):
        self._httpd, self.service, self.api_key = httpd, service, api_key
        self.url = f"http://{host}:{httpd.server_port}"
        self._thread = threading.Thread(target=httpd.serve_forever, name="rlkit-tinker-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and answering (open connections are ended), cancel the queued calls that have not started,
        and finish the running ones."""
        self._httpd.shutdown()
        self._httpd.drop()
        self._httpd.server_close()
        self._thread.join()
        self.service.close()

    def __enter__(self) -> TinkerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TinkerServer(url={self.url!r})"


def serve_tinker(target: Cluster | TrainingClient, *, config: PrimitivesConfig | None = None,
                 host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False, api_key: str | None = None,
                 poll_s: float = 10.0, state_dir: str | Path | None = None) -> TinkerServer:  # fmt: skip
    """Serve the Tinker SDK's LoRA train + sample API over ``target``.

    Args:
        target: a launched cluster (each ``create_model`` builds an rlkit.TrainingClient there from ``config``
            with the SDK's base model, LoRA rank and seed) or one rlkit.TrainingClient (``create_model`` must name
            its model and rank).
        config: the template of the clients built on a cluster (default PrimitivesConfig()).
        host, port: where to listen (port 0: a free one). A non-loopback host needs ``allow_remote=True``.
        api_key: the key every request must carry (default: a new random "tml-..." key).
        poll_s: how long one ``retrieve_future`` waits for a result before asking the client to poll again.
        state_dir: where ``save_state`` writes (``<state_dir>/<model id>/<name>``, on a filesystem every rank sees);
            default: a new temporary folder, logged, which the server leaves in place.
    """
    problems = serve_problems(host, allow_remote, api_key, poll_s)
    if problems:
        raise ValueError("serve_tinker: " + "; ".join(problems))
    key = api_key or f"tml-{secrets.token_urlsafe(32)}"
    states = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(prefix="rlkit-tinker-states-"))
    service = TinkerService(target, config if config is not None else PrimitivesConfig(), states, poll_s=poll_s)
    httpd = TinkerHTTPServer((host, port), _handler(service, key))
    server = TinkerServer(httpd, host, service, key)
    logger.info("Tinker API served at %s; save_state writes into %s", server.url, states)
    return server


def serve_problems(host: str, allow_remote: bool, api_key: str | None, poll_s: float) -> list[str]:
    """Every problem of serve_tinker's settings, each with its fix (checked before anything starts)."""
    problems = []
    if not allow_remote and not _is_loopback(host):
        problems.append(f"host={host!r} is not loopback: the server trains and samples for anyone holding the key; "
                        "pass allow_remote=True (CLI: --allow-remote) to listen there")  # fmt: skip
    if api_key is not None and not api_key.startswith("tml-"):
        problems.append("api_key must start with 'tml-' (the Tinker SDK refuses other keys)")
    if poll_s <= 0:
        problems.append(f"poll_s={poll_s}: must be > 0")
    return problems


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _handler(service: TinkerService, api_key: str) -> type[BaseHTTPRequestHandler]:
    class TinkerHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = IO_TIMEOUT_S  # on the socket: every read and write
        server: TinkerHTTPServer

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def _answer(self, method: str) -> None:
            if self.server.closing:
                self.close_connection = True
                return
            length, problem = _content_length(self.headers.get("Content-Length"),
                                              self.headers.get("Transfer-Encoding"))  # fmt: skip
            given = self.headers.get("X-API-Key") or ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                self._refuse(401, "missing or wrong X-API-Key: use the api_key this rlkit server printed", length)
                return
            if problem is not None or length is None:
                self._refuse(*(problem or (400, "no Content-Length")), None)
                return
            body = self.rfile.read(length)
            if len(body) < length:
                self._refuse(400, f"the body ended after {len(body)} of its Content-Length {length} bytes", 0)
                return
            reply = service.answer(method, self.path, body, self.headers.get("Content-Encoding"),
                                   self.headers.get("X-Idempotency-Key"))  # fmt: skip
            if self.server.closing:
                self.close_connection = True
                return
            self._send(reply)

        def _refuse(self, status: int, message: str, length: int | None) -> None:
            """Answer ``status`` without reading a body longer than a few KiB (then the connection ends)."""
            if length is not None and length <= _DRAIN_BYTES:
                self.rfile.read(length)
            else:
                self.close_connection = True
            self._send(error_reply(status, message))

        def _send(self, reply: Reply) -> None:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            if 400 <= reply.status < 500:
                self.send_header("X-Should-Retry", "false")  # a refusal is final: the SDK shows it at once
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
            logger.debug("tinker http: " + format, *args)

    return TinkerHandler


def _content_length(header: str | None, transfer_encoding: str | None) -> tuple[int | None, tuple[int, str] | None]:
    """The announced body length (None when unusable) and the refusal it calls for (status, message), if any."""
    if transfer_encoding is not None:
        return None, (411, f"Transfer-Encoding {transfer_encoding!r}: send the body with a Content-Length")
    if header is None:
        return 0, None
    if not header.strip().isdigit() or not header.strip().isascii():
        return None, (400, f"Content-Length {header[:20]!r}: not a byte count")
    length = int(header)
    if length > MAX_BODY_BYTES:
        return None, (413, f"Content-Length {length}: the body limit is {MAX_BODY_BYTES >> 20} MiB")
    return length, None
