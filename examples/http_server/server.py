"""A tiny HTTP service for the quick start (standard library only).

GET /health -> 200; any other request -> JSON naming the replica that answered, echoing the
method, path and body size; GET /stream?n=5 -> a server-sent-events stream of n events.
"""

from __future__ import annotations

import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPLICA = os.environ.get("FLEETSERVE_REPLICA_ID", "?")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _reply(self, status: int, payload: dict[str, object]) -> None:
        body = json.dumps(payload).encode() + b"\n"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path == "/health":
            self._reply(200, {"ok": True, "replica": REPLICA})
            return
        if self.path.startswith("/stream"):
            n = int(self.path.partition("n=")[2] or 5)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(n):
                chunk = f"data: {json.dumps({'replica': REPLICA, 'event': i})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"0\r\n\r\n")
            return
        self._reply(
            200,
            {"replica": REPLICA, "method": self.command, "path": self.path, "bytes": len(body)},
        )

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _any

    def log_message(self, fmt: str, *args: object) -> None:
        pass  # keep replica logs for the application's own output


if __name__ == "__main__":
    port = int(os.environ.get("PORT", "8080"))
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"replica {REPLICA} listening on 127.0.0.1:{port}", flush=True)
    server.serve_forever()
