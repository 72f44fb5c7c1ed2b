"""A stand-in Mooncake master ``/health`` (HTTP, on a 127.x address), for the HA answers a test
cannot hold a real master in: a standby naming a leader, a leader warming up."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

from testing.services import send_body

Answer = Callable[[], dict[str, Any]]


@contextlib.contextmanager
def health_server(host: str, port: int, answer: Answer) -> Iterator[list[str]]:
    """Serve ``answer()`` as JSON at ``/health`` on ``host:port`` (every other path is 404, as a
    standby knows no segment); yields the paths asked, in order."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            if self.path != "/health":
                self.send_error(404)
                return
            send_body(self, json.dumps(answer()).encode(), "application/json")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
