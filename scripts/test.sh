#!/usr/bin/env bash
# Install the project, its dev tools and the embeddings example's extra in ./.venv, then run
# lint, types, the import-layer contract and the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev,embeddings]'
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff";        ruff check . && ruff format --check .
echo "== mypy";        mypy
echo "== lint-imports"; lint-imports
echo "== pytest";      pytest "$@"
