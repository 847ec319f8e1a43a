#!/usr/bin/env bash
# Create .venv and install lora-merge with its test oracles. Torch is installed first, pinned, so that
# no dependency pulls a multi-GB CUDA build onto a CPU host.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test]"
