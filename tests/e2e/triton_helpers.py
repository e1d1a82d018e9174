"""What the tests of Triton's extensions (repository, shared memory, trace settings) share: the
served model's name as tritonclient reads it, a refused call's status and message, and a JSON request
to the server's HTTP port answered with its status and JSON body, errors included."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import tritonclient.grpc as tgrpc
from grpc_helpers import ServerProcess
from tritonclient.utils import InferenceServerException


def served_model(client: tgrpc.InferenceServerClient) -> str:
    [model] = client.get_model_repository_index(as_json=True)["models"]
    return str(model["name"])


def refusal(call: Callable[[], Any]) -> tuple[str | None, str]:
    """The status (`StatusCode.X` over gRPC) and message of the InferenceServerException `call` raises."""
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value.status(), str(caught.value.message())


def http_json(
    server: ServerProcess, path: str, body: bytes | None = None, method: str = "POST"
) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}{path}", data=body if method == "POST" else None, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
