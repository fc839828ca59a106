"""A fast benchmark replica: HTTP/1.1 keep-alive on a raw asyncio protocol (uvloop).

POST/GET / -> a small JSON body naming the replica (X-Replica header too).
GET /stream -> 20 server-sent events, 10 ms apart (chunked), like an LLM token stream.
GET /slow -> 30 server-sent events, 1 s apart: a long generation (bench/lb/idle_streams.py).
Only what the benchmark sends is parsed: no pipelining, Content-Length bodies.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import cast

REPLICA = os.environ.get("REPLICA_ID", "?").encode()
BODY = b'{"replica": "' + REPLICA + b'", "ok": true}\n'
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Replica: "
    + REPLICA
    + b"\r\nContent-Length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Replica: "
    + REPLICA
    + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class Http(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                eol = head.find(b"\r\n", i)
                length = int(head[i + 15 : eol if eol > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            if head.startswith(b"get /stream"):
                asyncio.get_running_loop().create_task(self.stream())
            elif head.startswith(b"get /slow"):
                asyncio.get_running_loop().create_task(self.stream(30, 1.0))
            else:
                self.transport.write(RESPONSE)

    async def stream(self, events: int = 20, gap: float = 0.01) -> None:
        self.transport.write(STREAM_HEAD)
        for i in range(events):
            if self.transport.is_closing():
                return
            event = b'data: {"token": %d}\n\n' % i
            self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
            await asyncio.sleep(gap)
        if not self.transport.is_closing():
            self.transport.write(b"0\r\n\r\n")


async def main(port: int, host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Http, host, port, backlog=2048, reuse_address=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(int(sys.argv[1]), *sys.argv[2:3]))
