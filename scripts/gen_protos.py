"""Regenerate every committed gRPC stub from proto/ (run from anywhere: python scripts/gen_protos.py).

A proto's folder path under proto/ is the import path of its stubs, which land in the source root
that holds that package (backend/ for pagedserve, adapters/ for pagedserve_adapters).

The adapters' stubs register their descriptors in a pool of their own (`POOL` in the module) instead
of protobuf's default pool: the KServe v2 / Triton protocol fixes the `inference.*` names, which
tritonclient registers too, and two files defining one symbol cannot share a pool. So pagedserve's
adapters import next to tritonclient in one process; the server hands reflection a pool with both.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
SOURCE_ROOTS = {"pagedserve": ROOT / "backend", "pagedserve_adapters": ROOT / "adapters"}
PRIVATE_POOL_PACKAGES = {"pagedserve_adapters"}
DEFAULT_POOL_LINE = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL_LINES = "POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = POOL.AddSerializedFile("


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
        if relative.parts[0] in PRIVATE_POOL_PACKAGES:
            use_private_pool(stem.with_name(stem.name + "_pb2.py"))
        written += [stem.with_name(stem.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return written


def use_private_pool(module: Path) -> None:
    text = module.read_text()
    if text.count(DEFAULT_POOL_LINE) != 1:
        raise RuntimeError(f"{module}: protoc's output changed, expected one {DEFAULT_POOL_LINE!r}")
    module.write_text(text.replace(DEFAULT_POOL_LINE, PRIVATE_POOL_LINES))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))
    sys.exit(0)
