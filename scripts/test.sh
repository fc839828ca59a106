#!/usr/bin/env bash
# Install the project, its dev tools and the embeddings example's extra in ./.venv, then run
# lint, types, the import-layer contract and the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev,embeddings,ray]'
export PATH="$PWD/.venv/bin:$PATH"
# The nginx data plane's tests need nginx (Debian's nginx-light), the Ray tests a network
# namespace (iproute2, root); they are never skipped.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2) >/dev/null
fi
if ! command -v nginx >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing nginx-light"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light) >/dev/null
  else
    echo "nginx is needed by the tests: sudo apt-get install nginx-light" >&2
    exit 1
  fi
fi
# The PostgreSQL store's tests start a private server of their own (tests/pg.py: initdb and
# pg_ctl from Debian's postgresql package, never its cluster service); they are never skipped.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing postgresql"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null
  else
    echo "PostgreSQL is needed by the store's tests: sudo apt-get install postgresql" >&2
    exit 1
  fi
fi
# The dashboard's browser tests drive Debian's Chromium with Playwright (never its download).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing chromium"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null
  else
    echo "chromium is needed by the dashboard's browser tests: sudo apt-get install chromium" >&2
    exit 1
  fi
fi
# Fixed-port replicas get outbound traffic through slirp4netns (tests check that they do).
if ! command -v slirp4netns >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slirp4netns) >/dev/null
fi
# The real-engine tests (tests/e2e/test_vllm.py) run vLLM's CPU build on a small model made
# offline, from .venv-vllm (vLLM pins torch, transformers and fastapi versions of its own).
bash scripts/llm/setup.sh >/dev/null
echo "== ruff";        ruff check . && ruff format --check .
echo "== mypy";        mypy
echo "== lint-imports"; lint-imports
# The suite runs on parallel workers (pytest-xdist: a file's tests on one worker, but the tests
# of a few long files each where a worker is free; the longest first: tests/conftest.py). Most
# end-to-end tests wait on processes and timers, so four workers keep two cores busy.
# FLEETSERVE_TEST_WORKERS=0 runs it in one process.
# With PYTHONDONTWRITEBYTECODE set (this machine's environment sets it) no process writes .pyc
# files, so each of the hundreds of controllers, LBs and CLI calls the suite starts would
# compile fleetserve's sources again (~0.1 s of CPU a controller). Compile them once here;
# reading .pyc files does not depend on the variable.
python -m compileall -q fleetserve >/dev/null
workers="${FLEETSERVE_TEST_WORKERS:-4}"
if [ "$workers" = 0 ]; then
  echo "== pytest";      pytest "$@"
else
  echo "== pytest ($workers workers)"; pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
