"""The HTTP port (--http-port; HTTPS with --ssl-certfile): Prometheus `/metrics`, health for HTTP
probes (`/health/live`, `/health/ready`), and whatever routes the adapters add (KServe v2 REST). Built
on aiohttp, so keep-alive clients, request bodies and server-sent events work as HTTP clients expect."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterable
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)

_PROMETHEUS_TYPE = "text/plain; version=0.0.4"


class HttpEndpoint:
    def __init__(self, server: Any, extra_routes: Iterable[web.AbstractRouteDef] = ()) -> None:
        self.grpc_server = server  # pagedserve.rpc.server.Server: its state and (once bound) engine
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.add_routes(
            [
                web.get("/metrics", self.metrics),
                web.get("/health/live", self.live),
                web.get("/health/ready", self.ready),
            ]
        )
        self.app.add_routes(list(extra_routes))
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on `host:port` (0: any free port), HTTPS with `ssl_context` (rpc/tls.py); the port."""
        # handler_cancellation: a client that hangs up cancels its handler, which aborts its request
        # even while the handler waits for tokens with nothing to write (adapters' rest.py)
        self.runner = web.AppRunner(
            self.app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=ssl_context)
        await site.start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def metrics(self, request: web.Request) -> web.Response:
        if self.grpc_server.state.status == "starting":
            return web.Response(status=503, text="starting\n")
        body = self.grpc_server.engine.engine.metrics.render()
        return web.Response(body=body, content_type=_PROMETHEUS_TYPE.split(";")[0], charset="utf-8")

    async def live(self, request: web.Request) -> web.Response:
        return probe(self.grpc_server.state.status != "dead")

    async def ready(self, request: web.Request) -> web.Response:
        return probe(self.grpc_server.state.ready)


def probe(ok: bool) -> web.Response:
    return web.Response(text="ok\n") if ok else web.Response(status=503, text="unavailable\n")
