"""Fake OpenAI-compatible LLM replicas: one process serving K of them on K loopback ports, each
with its own modelled KV cache and scheduler (bench/llm/model.py).

Each replica's port:
  POST /v1/chat/completions, /v1/completions   OpenAI's shapes; `"stream": true` for SSE
  GET  /v1/models, /health
  GET  /metrics      vLLM's Prometheus names (vllm/v1/metrics/loggers.py), label model_name
  POST /-/reset      empty this replica's cache and counters (requests in flight are aborted)
  GET  /-/stats      JSON: every replica of this process (running, waiting, counters), so that
                     one request samples the whole fleet

    .venv/bin/python bench/llm/replica.py --replicas 4 [--ready-file F] [model options]
prints (and writes to F) {"ports": [...]} once every replica listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from aiohttp import web
from model import ModelConfig, Rejected, Request, Scheduler, render_chat

MODEL_NAME = "fake"
# vLLM's names and help texts (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
METRICS = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:gpu_cache_usage_perc": (
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
        "vllm:kv_cache_usage_perc instead.",
    ),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries_total": (
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "vllm:prefix_cache_hits_total": (
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    "vllm:prompt_tokens_total": ("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens_total": ("counter", "Number of generation tokens processed."),
    "vllm:request_success_total": ("counter", "Count of successfully processed requests."),
}


class Replica:
    """One replica: the model's scheduler, run by a loop that sleeps through each step."""

    def __init__(self, index: int, config: ModelConfig) -> None:
        self.index = index
        self.port = 0
        loop = asyncio.get_running_loop()
        self.sched = Scheduler(config, clock=loop.time)
        self.wake = asyncio.Event()
        self.streams: dict[int, asyncio.Queue[None]] = {}  # rid -> one item per token batch
        self.task = loop.create_task(self.run())

    async def run(self) -> None:
        while True:
            step = self.sched.schedule()
            if step is None:
                self.wake.clear()
                await self.wake.wait()
                continue
            await asyncio.sleep(step.duration)
            for req in self.sched.complete(step):
                q = self.streams.get(req.rid)
                if q is not None and q.empty():
                    q.put_nowait(None)

    def submit(self, text: str, max_tokens: int) -> tuple[Request, asyncio.Queue[None]]:
        req = self.sched.submit(text, max_tokens)
        q: asyncio.Queue[None] = asyncio.Queue()
        self.streams[req.rid] = q
        self.wake.set()
        return req, q

    def forget(self, req: Request) -> None:
        self.streams.pop(req.rid, None)
        if not req.done:
            self.sched.abort(req)
            self.wake.set()

    def reset(self) -> None:
        for req in self.sched.reset():
            q = self.streams.get(req.rid)
            if q is not None and q.empty():
                q.put_nowait(None)  # the handler sees an aborted request
        self.wake.set()

    def stats(self) -> dict[str, Any]:
        return {"replica": self.index, "port": self.port, **self.sched.stats()}

    def metrics(self) -> str:
        s = self.sched
        c = s.counters
        usage = s.cache.in_use / s.cache.capacity
        values = {
            "vllm:num_requests_running": len(s.running),
            "vllm:num_requests_waiting": len(s.waiting),
            "vllm:gpu_cache_usage_perc": usage,
            "vllm:kv_cache_usage_perc": usage,
            "vllm:prefix_cache_queries_total": c.prefix_cache_queries,
            "vllm:prefix_cache_hits_total": c.prefix_cache_hits,
            "vllm:prompt_tokens_total": c.prompt_tokens,
            "vllm:generation_tokens_total": c.generation_tokens,
            "vllm:request_success_total": c.success,
        }
        label = f'model_name="{MODEL_NAME}",engine="0"'
        out = []
        for name, (kind, doc) in METRICS.items():
            base = name.removesuffix("_total") if kind == "counter" else name
            labels = label + (',finished_reason="length"' if "success" in name else "")
            out += [f"# HELP {base} {doc}", f"# TYPE {base} {kind}"]
            out.append(f"{name}{{{labels}}} {float(values[name])}")
        return "\n".join(out) + "\n"


def chunk(kind: str, rid: int, created: int, content: str, finish: str | None) -> bytes:
    fin = "null" if finish is None else f'"{finish}"'
    if kind == "chat":
        choice = f'{{"index":0,"delta":{{"content":"{content}"}},"finish_reason":{fin}}}'
        obj = "chat.completion.chunk"
    else:
        choice = f'{{"index":0,"text":"{content}","finish_reason":{fin}}}'
        obj = "text_completion"
    return (
        f'data: {{"id":"cmpl-{rid}","object":"{obj}","created":{created},'
        f'"model":"{MODEL_NAME}","choices":[{choice}]}}\n\n'
    ).encode()


def error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


def make_app(replica: Replica, fleet: list[Replica]) -> web.Application:
    async def generate(request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await request.json()
            if kind == "chat":
                messages = body["messages"]
                text = render_chat(
                    {"role": str(m["role"]), "content": str(m["content"])} for m in messages
                )
            else:
                prompt = body["prompt"]
                text = prompt if isinstance(prompt, str) else "".join(map(str, prompt))
            # OpenAI's current name first (SGLang's router forwards only that one), then the
            # older one; vLLM reads both alike.
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            stream = bool(body.get("stream", False))
        except (ValueError, KeyError, TypeError) as e:
            return error(400, f"bad request: {e!r}")
        try:
            req, queue = replica.submit(text, max_tokens)
        except Rejected as e:
            return error(e.status, str(e))
        created = int(time.time())
        headers = {"X-Replica": str(replica.index)}
        try:
            if not stream:
                while not req.done:
                    await queue.get()
                if req.aborted:
                    return error(503, "aborted (replica reset)")
                content = req.reply
                choice: dict[str, Any] = (
                    {"index": 0, "message": {"role": "assistant", "content": content}}
                    if kind == "chat"
                    else {"index": 0, "text": content}
                )
                choice["finish_reason"] = "length"
                usage = {
                    "prompt_tokens": req.prompt_tokens,
                    "completion_tokens": req.generated,
                    "total_tokens": req.prompt_tokens + req.generated,
                    "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
                }
                obj = "chat.completion" if kind == "chat" else "text_completion"
                return web.json_response(
                    {
                        "id": f"cmpl-{req.rid}",
                        "object": obj,
                        "created": created,
                        "model": MODEL_NAME,
                        "choices": [choice],
                        "usage": usage,
                    },
                    headers=headers,
                )
            resp = web.StreamResponse(
                headers={
                    **headers,
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                }
            )
            await resp.prepare(request)
            sent = 0
            try:
                while sent < req.max_tokens:
                    await queue.get()
                    if req.aborted:
                        break
                    parts = []
                    while sent < req.generated:
                        fin = "length" if sent + 1 == req.max_tokens else None
                        parts.append(chunk(kind, req.rid, created, req.token(sent), fin))
                        sent += 1
                    await resp.write(b"".join(parts))
                if not req.aborted:
                    await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except ConnectionError:
                pass  # the client went away: `forget` aborts the request
            return resp
        finally:
            replica.forget(req)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await generate(request, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await generate(request, "text")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]}
        )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=replica.metrics(), content_type="text/plain")

    async def reset(_: web.Request) -> web.Response:
        replica.reset()
        return web.json_response(replica.stats())

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"replicas": [r.stats() for r in fleet]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/-/reset", reset)
    app.router.add_get("/-/stats", stats)
    return app


async def serve(args: argparse.Namespace, config: ModelConfig) -> None:
    fleet = [Replica(i, config) for i in range(args.replicas)]
    ports = [int(p) for p in args.ports.split(",")] if args.ports else [0] * args.replicas
    if len(ports) != args.replicas:
        sys.exit("--ports must name one port per replica")
    runners = []
    for replica, port in zip(fleet, ports, strict=True):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, port))
        replica.port = int(sock.getsockname()[1])
        # handler_cancellation: a client that goes away takes its request out of the queue.
        runner = web.AppRunner(make_app(replica, fleet), access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.SockSite(runner, sock, backlog=1024).start()
        runners.append(runner)
    ready = json.dumps({"ports": [r.port for r in fleet], "pid": os.getpid(), **asdict(config)})
    print(ready, flush=True)
    if args.ready_file:
        tmp = Path(args.ready_file + ".tmp")
        tmp.write_text(ready)
        tmp.replace(args.ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for r in fleet:
        r.task.cancel()
    for runner in runners:
        await runner.cleanup()


def model_options(ap: argparse.ArgumentParser) -> None:
    """One --option per ModelConfig field (also used by run.py)."""
    defaults = ModelConfig()
    for f in fields(ModelConfig):
        value = getattr(defaults, f.name)
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(value),
            default=value,
            help=f"default {value}",
        )


def config_of(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(**{f.name: getattr(args, f.name) for f in fields(ModelConfig)})


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--ports", help="comma-separated; default: any free ports")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--ready-file", help="write the ports here (JSON) once listening")
    model_options(ap)
    args = ap.parse_args()
    config = config_of(args)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args, config))
    else:
        uvloop.run(serve(args, config))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
