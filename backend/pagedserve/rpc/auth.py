"""`--api-key`: every call on both ports needs `authorization: Bearer <key>` (gRPC metadata or HTTP
header, as vLLM's `--api-key` asks for it), checked before anything runs. Left open, as probes and
scrapers send no key: gRPC health (`grpc.health.v1`, which Kubernetes' gRPC probes and `pagedserve
health` call), reflection (the API's shape, as vLLM leaves its OpenAPI document open), and on HTTP
`/metrics` and the health routes."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

OPEN_GRPC_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
OPEN_HTTP_PATHS = frozenset(
    {"/metrics", "/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"}
)
REFUSAL = "missing or wrong API key: send the header authorization: Bearer <key> (--api-key)"


class ApiKey:
    def __init__(self, key: str) -> None:
        self._expected = f"Bearer {key}".encode()

    def accepts(self, authorization: str | None) -> bool:
        """Compared in constant time: how long a wrong key took tells nothing of the right one."""
        return authorization is not None and hmac.compare_digest(authorization.encode(), self._expected)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call without the key UNAUTHENTICATED before its handler runs (no request is made)."""

    def __init__(self, api_key: ApiKey) -> None:
        self.api_key = api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        metadata = dict(handler_call_details.invocation_metadata or ())
        if (
            handler is None
            or method.startswith(OPEN_GRPC_SERVICES)
            or self.api_key.accepts(metadata.get("authorization"))
        ):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def http_middleware(api_key: ApiKey) -> Any:
    """aiohttp middleware: 401 (a JSON error, as the KServe v2 routes answer) without the key."""

    @web.middleware
    async def require_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in OPEN_HTTP_PATHS or api_key.accepts(request.headers.get("Authorization")):
            return await handler(request)
        return web.json_response(
            {"error": REFUSAL}, status=401, headers={"WWW-Authenticate": 'Bearer realm="pagedserve"'}
        )

    return require_api_key
