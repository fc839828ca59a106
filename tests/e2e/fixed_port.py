"""What the fixed-port fleet tests share: SkyServe's shape (`ports: 8080`, 3 replicas) and a
server that binds 8080 and reports its replica, its namespace's interfaces and, on /out, an
outbound connection made from inside it."""

from __future__ import annotations

import textwrap

FIXED = """\
    name: {name}
    service:
      readiness_probe: /health
      replicas: 3
      ports: 8080
      load_balancing_policy: round_robin
    workdir: {workdir}
    run: python3 fixed.py
"""

SERVER = textwrap.dedent(
    """
    import json, os, socket, urllib.parse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    RID = os.environ.get("FLEETSERVE_REPLICA_ID", "?")
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            with open("/proc/self/net/dev") as f:  # this process's network namespace's
                names = [line.split(":")[0].strip() for line in f.readlines()[2:]]
            out = {"replica": RID, "path": url.path, "interfaces": sorted(names)}
            if url.path == "/out":  # an outbound connection from inside the namespace
                q = dict(urllib.parse.parse_qsl(url.query))
                try:
                    with socket.create_connection((q["host"], int(q["port"])), timeout=5) as s:
                        out["out"] = s.recv(16).decode()
                except OSError as e:
                    out["out"] = f"error: {e}"
            body = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
    """
)
