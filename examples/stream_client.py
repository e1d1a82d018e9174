"""Stream a chat completion from a running `pagedserve serve` (default: localhost:8001).

python examples/stream_client.py "What is the capital of Japan?" --max-tokens 64
python examples/stream_client.py "Give a person as JSON." --json-schema '{"type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}'
python examples/stream_client.py "Pick a number." --regex "[0-9]{1,3}"
"""

from __future__ import annotations

import argparse
import sys

import grpc
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompt")
    parser.add_argument("--address", default="localhost:8001")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=120.0, help="gRPC deadline in seconds")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", help="structured outputs: the answer is JSON of this schema")
    constraint.add_argument("--regex", help="structured outputs: the answer fullmatches this regex")
    args = parser.parse_args()
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=args.prompt)])
    sampling = pb.SamplingParameters(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.json_schema is not None:
        sampling.structured_outputs.json = args.json_schema
    elif args.regex is not None:
        sampling.structured_outputs.regex = args.regex
    with grpc.insecure_channel(args.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            for response in stub.Generate(
                pb.GenerateRequest(messages=messages, sampling=sampling), timeout=args.timeout
            ):
                print(response.text, end="", flush=True)
                if response.finish_reason:
                    reason = pb.FinishReason.Name(response.finish_reason).lower()
                    print(
                        f"\n[{reason}: {response.prompt_tokens} prompt + {response.completion_tokens} "
                        f"completion tokens, first token after {response.time_to_first_token_s:.3f} s]"
                    )
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
