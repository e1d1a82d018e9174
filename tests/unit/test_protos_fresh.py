"""The committed gRPC stubs are exactly what scripts/gen_protos.py generates from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    out_roots = {name: tmp_path / name for name in gen.SOURCE_ROOTS}
    for path in out_roots.values():
        path.mkdir()
    generated = gen.generate(out_roots)
    assert generated, "no protos found"
    for path in generated:
        package_root = next(p for p in out_roots.values() if path.is_relative_to(p))
        package = next(name for name, p in out_roots.items() if p == package_root)
        committed = gen.SOURCE_ROOTS[package] / path.relative_to(package_root)
        assert committed.exists(), f"{committed} is missing: run python scripts/gen_protos.py"
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run python scripts/gen_protos.py"
        )
