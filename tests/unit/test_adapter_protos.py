"""The adapters' `inference.*` stubs and tritonclient's define the same protobuf symbols; ours keep
to a pool of their own, so both load into one process in either order and speak the same wire."""

from __future__ import annotations

import subprocess
import sys

import pytest

ROUND_TRIP = """
import sys
first = sys.argv[1]
if first == "tritonclient":
    from tritonclient.grpc import service_pb2 as triton
    from pagedserve_adapters.v2 import inference_pb2 as ours
else:
    from pagedserve_adapters.v2 import inference_pb2 as ours
    from tritonclient.grpc import service_pb2 as triton
request = ours.ModelInferRequest(model_name="m", id="r1")
request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
request.parameters["max_tokens"].int64_param = 5
echoed = triton.ModelInferRequest.FromString(request.SerializeToString())
assert (echoed.model_name, echoed.id, echoed.inputs[0].name) == ("m", "r1", "text_input"), echoed
assert echoed.parameters["max_tokens"].int64_param == 5
back = ours.ModelInferRequest.FromString(echoed.SerializeToString())
assert back == request
print("ok")
"""


@pytest.mark.parametrize("first", ["tritonclient", "pagedserve_adapters"])
def test_adapter_stubs_load_next_to_tritonclient(first: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP, first], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
