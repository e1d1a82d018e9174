"""The wheel `pip install /src` builds (the Dockerfile installs the project that way, not editable):
it carries every file the packages need at run time, the C++ kernel sources and the headers they
include among them (torch builds the CPU kernels from the installed package on first use)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from deploy_helpers import REPO

PACKAGES = {
    "backend/pagedserve": "pagedserve",
    "kernels/pagedserve_kernels": "pagedserve_kernels",
    "adapters/pagedserve_adapters": "pagedserve_adapters",
}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Built from a copy of the tree as a clean clone has it: a `build/` folder left by an earlier build
    in the checkout would lend the wheel files the package data no longer names."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for path in git_files("--cached", "--others", "--exclude-standard"):
        if (REPO / path).is_file():
            (src / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / path, src / path)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    [wheel] = out.glob("pagedserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def git_files(*args: str) -> list[str]:
    return subprocess.run(
        ["git", "ls-files", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_every_tracked_package_file_is_in_the_wheel(wheel_names: set[str], folder: str) -> None:
    files = git_files(folder)
    assert files, f"git lists nothing under {folder}"
    missing = [p for p in files if PACKAGES[folder] + p[len(folder) :] not in wheel_names]
    assert not missing, f"left out of the wheel: {missing}"


def test_every_header_the_kernels_include_is_in_the_wheel(wheel_names: set[str]) -> None:
    sources = [n for n in wheel_names if n.startswith("pagedserve_kernels/csrc/") and n.endswith(".cpp")]
    assert sources, "no C++ sources in the wheel"
    for source in sources:
        text = (REPO / "kernels" / source).read_text()
        for header in re.findall(r'#include "([^"]+)"', text):
            assert str(Path(source).parent / header) in wheel_names, f"{source} includes {header}"
