"""The /metrics endpoint: prometheus-client's WSGI app, over TLS and behind basic auth.

prometheus-client's start_http_server serves TLS but knows no basic auth (and
does the TLS handshake on its accept thread), so the daemon serves the same
WSGI app itself:
- under the daemon's TLS (--tls-cert), over HTTPS with the same certificate
  and, with --tls-client-ca, the same client certificates required (mutual
  TLS, as gRPC and the data plane); the handshake runs on the request's own
  thread, not on the accept loop;
- with --metrics-auth-file (one line USER:PASSWORD), every request must carry
  `Authorization: Basic` with them (401 otherwise), compared in constant time;
- at most MAX_REQUESTS requests at once (more are closed at once), and each
  connection gets REQUEST_TIMEOUT_S to send its request, so a slow or
  flooding client holds a bounded number of threads for a bounded time.
"""

from __future__ import annotations

import base64
import hmac
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

__all__ = ["MetricsServer", "read_basic_auth", "MAX_REQUESTS", "REQUEST_TIMEOUT_S"]

log = logging.getLogger("reducerd")

MAX_REQUESTS = 16
REQUEST_TIMEOUT_S = 10.0
_REALM = 'Basic realm="reducerd metrics", charset="UTF-8"'


def read_basic_auth(path: str) -> tuple[str, str]:
    """(user, password) from a file of one line USER:PASSWORD; ValueError naming the problem."""
    with open(path, encoding="utf-8") as f:
        line = f.read().strip()
    user, sep, password = line.partition(":")
    if not sep or not user or not password or "\n" in line:
        raise ValueError(f"metrics_auth_file: {path!r} must hold one line USER:PASSWORD")
    return user, password


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # per connection: the request line and headers

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # scrapes are not news; refusals are counted by the scraper


def _with_basic_auth(app: Callable, user: str, password: str) -> Callable:
    expected = b"Basic " + base64.b64encode(f"{user}:{password}".encode())

    def guarded(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("WWW-Authenticate", _REALM),
                                                ("Content-Type", "text/plain")])
            return [b"credentials required (--metrics-auth-file)\n"]
        return app(environ, start_response)
    return guarded


class MetricsServer:
    """Serves `registry` on HOST:PORT (port 0: any free one) on threads of its own."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 ssl_context: ssl.SSLContext | None = None,
                 basic_auth: tuple[str, str] | None = None) -> None:
        app = make_wsgi_app(registry)
        if basic_auth is not None:
            app = _with_basic_auth(app, *basic_auth)
        slots = threading.BoundedSemaphore(MAX_REQUESTS)

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

            def process_request(self, request: Any, client_address: Any) -> None:
                if not slots.acquire(blocking=False):
                    self.shutdown_request(request)  # full: close at once
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

            def handle_error(self, request: Any, client_address: Any) -> None:
                # A failed TLS handshake, a client gone: not worth a traceback on stderr.
                log.debug("metrics: request from %s failed", client_address, exc_info=True)

        self._httpd = make_server(host, port, app, Server, handler_class=_Handler)
        if ssl_context is not None:
            # The handshake happens at the request thread's first read, under its timeout.
            self._httpd.socket = ssl_context.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.scheme = "https" if ssl_context is not None else "http"
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="reducerd-metrics")
        self._thread.start()

    def stop(self) -> None:
        """Stop serving (waits up to 2 s for the accept thread)."""
        stopper = threading.Thread(target=self._httpd.shutdown, daemon=True)
        stopper.start()
        stopper.join(timeout=2.0)
        self._httpd.server_close()
