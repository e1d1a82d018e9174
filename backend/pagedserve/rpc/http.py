"""A small HTTP/1.1 endpoint on --http-port: Prometheus `/metrics` and health for HTTP probes
(`/health/live`, `/health/ready`, and KServe's `/v2/health/live`, `/v2/health/ready`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

_PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class HttpEndpoint:
    def __init__(self, server: Any) -> None:
        self.grpc_server = server  # pagedserve.rpc.server.Server: its state and (once bound) engine
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._handle, host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method != "GET":
            return 405, "text/plain", b"method not allowed\n"
        state = self.grpc_server.state
        if path == "/metrics":
            if state.status == "starting":
                return 503, "text/plain", b"starting\n"
            return 200, _PROMETHEUS_TYPE, self.grpc_server.engine.engine.metrics.render()
        if path in ("/health/live", "/v2/health/live"):
            return _probe(state.status != "dead")
        if path in ("/health/ready", "/v2/health/ready"):
            return _probe(state.ready)
        return 404, "text/plain", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = (await reader.readline()).decode("latin-1").split()
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing here needs them
            if len(request_line) < 2:
                status, content_type, body = 400, "text/plain", b"bad request\n"
            else:
                status, content_type, body = self.route(request_line[0], request_line[1].split("?")[0])
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


def _probe(ok: bool) -> tuple[int, str, bytes]:
    return (200, "text/plain", b"ok\n") if ok else (503, "text/plain", b"unavailable\n")
