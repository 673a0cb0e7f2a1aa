"""rlkit's Tinker server over HTTP: the SDK's endpoints (:mod:`rlkit.serving.tinker_service`) on a threaded stdlib
server, loopback only unless asked, every request checked against the run's API key.

Example:
    server = rlkit.serve_tinker(cluster)              # port 0: a free port
    service = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    ...
    server.close()
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rlkit.config.primitives import PrimitivesConfig
from rlkit.runtime.cluster import Cluster
from rlkit.serving.futures import Reply
from rlkit.serving.tinker_service import TinkerService, error_reply
from rlkit.trainer.primitives import TrainingClient

logger = logging.getLogger(__name__)


class TinkerServer:
    """A running server: ``url`` and ``api_key`` for ``tinker.ServiceClient``; :meth:`close` stops it."""

    def __init__(self, httpd: ThreadingHTTPServer, host: str, service: TinkerService, api_key: str):
        self._httpd, self.service, self.api_key = httpd, service, api_key
        self.url = f"http://{host}:{httpd.server_port}"
        self._thread = threading.Thread(target=httpd.serve_forever, name="rlkit-tinker-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop answering, then finish the calls already queued."""
        self._httpd.shutdown()
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
    httpd = ThreadingHTTPServer((host, port), _handler(service, key))
    httpd.daemon_threads = True
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

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def _answer(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            given = self.headers.get("X-API-Key") or ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                reply = error_reply(401, "missing or wrong X-API-Key: use the api_key this rlkit server printed")
            else:
                reply = service.handle(method, self.path, body, self.headers.get("Content-Encoding"))
            self._send(reply)

        def _send(self, reply: Reply) -> None:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
            logger.debug("tinker http: " + format, *args)

    return TinkerHandler
