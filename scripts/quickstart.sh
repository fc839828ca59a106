#!/usr/bin/env bash
# Set up fleetserve in ./.venv and serve the quick-start example on the local infra.
# Prints the endpoint; `fleetserve down hello` stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e .
export PATH="$PWD/.venv/bin:$PATH"
fleetserve up examples/http_server/service.yaml "$@"
endpoint=$(fleetserve status hello --endpoint)
echo
echo "Try it:   curl $endpoint/hello"
echo "Status:   .venv/bin/fleetserve status hello"
echo "Stop it:  .venv/bin/fleetserve down hello"
