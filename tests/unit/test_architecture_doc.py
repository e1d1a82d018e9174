"""docs/architecture.md's layout against the tree: every module and C++ source is named under its
folder, and every path named there exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
SOURCE_ROOTS = ("backend/pagedserve", "kernels/pagedserve_kernels", "adapters/pagedserve_adapters")


def layout_section(text: str) -> str:
    return text.split("\n## Layout\n", 1)[1].split("\n### Beside them\n", 1)[0]


def documented_paths(text: str) -> set[str]:
    """Repository paths the layout names: a `### `root/`` heading opens a source root, a paragraph
    opening with `sub/` a folder in it, and each list item's backticked names before its first colon
    are files (or folders, ending in /) in that folder."""
    paths: set[str] = set()
    root = folder = ""
    for line in layout_section(text).splitlines():
        if heading := re.match(r"### `([\w/]+)/`", line):
            root = folder = heading[1]
        elif sub := re.match(r"`([\w/]+/)`", line):
            folder = f"{root}/{sub[1].rstrip('/')}"
        elif item := re.match(r"\s*- (.*?):", line):
            for name in re.findall(r"`([\w./]+)`", item[1]):
                paths.add(f"{folder}/{name}")
    return paths


def source_files() -> set[str]:
    """The hand-written modules and C++ sources of the three packages (generated stubs and package
    `__init__.py` files aside)."""
    files = set()
    for root in SOURCE_ROOTS:
        for path in (REPO / root).rglob("*"):
            generated = "_pb2" in path.name
            if path.suffix in (".py", ".cpp", ".h") and path.name != "__init__.py" and not generated:
                files.add(str(path.relative_to(REPO)))
    return files


def test_the_layout_names_every_module_under_its_folder() -> None:
    named = {path for path in documented_paths(DOC.read_text()) if not path.endswith("/")}
    missing = sorted(source_files() - named)
    assert not missing, f"modules docs/architecture.md does not name: {missing}"


def test_every_path_the_layout_names_exists() -> None:
    paths = documented_paths(DOC.read_text())
    assert len(paths) > 80  # the parser found the lists
    absent = sorted(path for path in paths if not (REPO / path.rstrip("/")).exists())
    assert not absent, f"docs/architecture.md names paths that do not exist: {absent}"


def test_the_thread_names_drawn_are_the_servers() -> None:
    """The process picture names threads by the names the server gives them (threads.py names them
    in the OS too, where `top -H` and py-spy show them)."""
    drawn = set(re.findall(r"pagedserve-[a-z-]+", DOC.read_text()))
    sources = "".join(path.read_text() for path in (REPO / "backend" / "pagedserve").rglob("*.py"))
    given = set(re.findall(r"\"(pagedserve-[a-z-]+)\"", sources))
    assert drawn and drawn <= given, drawn - given
