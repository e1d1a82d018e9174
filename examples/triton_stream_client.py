"""Stream a completion from a running `pagedserve serve` with Triton's own client, unchanged from code
written for Triton's vLLM backend (default: localhost:8001, model SmolLM2-135M-Instruct).

pip install "tritonclient[grpc]"
python examples/triton_stream_client.py "The capital of France is" --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompt")
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([args.prompt.encode()], dtype=object))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    sampling = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))

    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(args.url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(args.model, [text, stream, sampling], request_id="example-1")
        while True:
            result, error = responses.get()
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                client.stop_stream()
                return 1
            print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()  # half-close; returns once the server has ended the stream
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
