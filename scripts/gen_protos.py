"""Regenerate every committed gRPC stub from proto/ (run from anywhere: python scripts/gen_protos.py).

A proto's folder path under proto/ is the import path of its stubs, which land in the source root
that holds that package (backend/ for pagedserve, adapters/ for pagedserve_adapters).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
SOURCE_ROOTS = {"pagedserve": ROOT / "backend", "pagedserve_adapters": ROOT / "adapters"}


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_roots: dict[str, Path] = SOURCE_ROOTS) -> list[Path]:
    """Run protoc for every proto; returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    written = []
    for proto in proto_files():
        relative = proto.relative_to(PROTO_ROOT)
        out = out_roots[relative.parts[0]]
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {relative}")
        stem = out / relative.with_suffix("")
        written += [stem.with_name(stem.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return written


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))
    sys.exit(0)
